// vq_decode_merge: header

#define VQ_SHARED threadgroup
#define VQ_SHARED_A16 threadgroup alignas(16)
#define VQ_UNROLL _Pragma("clang loop unroll(full)")
#define VQ_UNROLL4 _Pragma("clang loop unroll_count(4)")
#define vq_barrier() threadgroup_barrier(mem_flags::mem_threadgroup)
#define vq_simd_sum(x) simd_sum(x)
#define vq_simd_max(x) simd_max(x)
#define vq_simd_min(x) simd_min(x)
#define vq_simd_shuffle(x, i) simd_shuffle((x), (ushort)(i))
#define vq_simd_shuffle_xor(x, m) simd_shuffle_xor((x), (ushort)(m))
#define vq_ballot(p) ((uint)(static_cast<simd_vote::vote_t>(simd_ballot(p))))
#define vq_popcount(x) popcount(x)
#define vq_float(x) float(x)
#define vq_cast(T, x) static_cast<T>(x)
#define vq_as_float(u) as_type<float>((uint)(u))
#define vq_load2(p, i) (*((const device uint2*)((p) + (i))))
#define vq_load4(p, i) (*((const device uint4*)((p) + (i))))
#define vq_lds4(a, i) (*((const threadgroup float4*)(&(a)[i])))
typedef half vq_half;
#define VQ_NEG_INF (-INFINITY)
typedef half2 vq_h2;
#define VQ_FN inline
#define VQ_THREAD thread
VQ_FN vq_h2 vq_h2_bits(uint u) { return as_type<half2>(u); }
VQ_FN uint vq_bits_h2(vq_h2 h) { return as_type<uint>(h); }
VQ_FN float2 vq_h2_float2(uint u) { return float2(as_type<half2>(u)); }
#define vq_h2_fma(a, b, c) fma((a), (b), (c))
#define vq_h2_sub(a, b) ((a) - (b))
#define vq_h2_splat(x) half2(half(x))
#define vq_h2_pair(lo, hi) half2(half(lo), half(hi))
VQ_FN uint vq_byte_perm(uint a, uint b, uint s) {
  uint r = 0u;
  for (uint i = 0; i < 4; i++) { const uint k = (s >> (4 * i)) & 7u; r |= (((k < 4 ? a : b) >> (8 * (k & 3u))) & 0xffu) << (8 * i); }
  return r;
}
#define vq_exp2(x) exp2(x)
#define vq_load1(p, i) (*((const device uint*)((p) + (i))))
#define vq_mma16816(c, a, b0, b1, lane) vq_mma16816_emul(c, a, b0, b1, lane)
#define vq_device_fence() atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device)
#define vq_atomic_inc(p) atomic_fetch_add_explicit((device atomic_uint*)(p), 1u, memory_order_relaxed)
#define vq_atomic_zero(p) atomic_store_explicit((device atomic_uint*)(p), 0u, memory_order_relaxed)
#define vq_ld_cg(p) (*(p))
#define vq_simd_sync() simdgroup_barrier(mem_flags::mem_threadgroup)

VQ_FN void vq_mma16816_emul(VQ_THREAD float* c, VQ_THREAD const uint* a, uint b0, uint b1, uint lane) {
  const uint g = lane / 4, t = lane % 4;
  for (uint kk = 0; kk < 4; kk++) {
    const float2 a0 = vq_h2_float2(vq_simd_shuffle(a[0], g * 4 + kk)), a1 = vq_h2_float2(vq_simd_shuffle(a[1], g * 4 + kk));
    const float2 a2 = vq_h2_float2(vq_simd_shuffle(a[2], g * 4 + kk)), a3 = vq_h2_float2(vq_simd_shuffle(a[3], g * 4 + kk));
    const float2 x0 = vq_h2_float2(vq_simd_shuffle(b0, 8 * t + kk)), x1 = vq_h2_float2(vq_simd_shuffle(b1, 8 * t + kk));
    const float2 y0 = vq_h2_float2(vq_simd_shuffle(b0, 8 * t + 4 + kk)), y1 = vq_h2_float2(vq_simd_shuffle(b1, 8 * t + 4 + kk));
    c[0] += a0.x * x0.x + a0.y * x0.y + a2.x * x1.x + a2.y * x1.y;
    c[1] += a0.x * y0.x + a0.y * y0.y + a2.x * y1.x + a2.y * y1.y;
    c[2] += a1.x * x0.x + a1.y * x0.y + a3.x * x1.x + a3.y * x1.y;
    c[3] += a1.x * y0.x + a1.y * y0.y + a3.x * y1.x + a3.y * y1.y;
  }
}

VQ_FN uint vq_code(VQ_THREAD const uint* w, int bit, int bits) {   // code at bit offset `bit` of an LSB-first word array
  uint x = w[bit >> 5] >> (bit & 31);
  if ((bit & 31) + bits > 32) x |= w[(bit >> 5) + 1] << (32 - (bit & 31));
  return x & ((1u << bits) - 1u);
}

// vq_decode_merge: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup, vq_warp = simdgroup_index_in_threadgroup;
const uint vq_tid = thread_position_in_threadgroup.x;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

// pm, pl: [ROWS, NS]; pacc: [ROWS, NS, D]; q: [ROWS, D] (model dtype, unscaled); ek, ev: [ROWS / REP, ECAP, D], of which
// the first E tokens are read (a preallocated window buffer: ECAP >= E): E = eref_shape[0] or, with template EV = 1, the
// value eref[0] (int32: the step's graph then keeps its shapes from one step to the next); sinks: [ROWS] float32 (read
// only when HS); template SCALE as the decode kernels. ROT = 1: the chunk partials are in a rotated domain (acc = p·(v R)),
// the exact keys/values and q are not; out = (acc_chunks · Rᵀ + acc_exact) / L with rot: [D, D] float32 = Rᵀ, row-major
// (`_merge_partials` passes the transpose of R). PR = 1 (a padded batch): exact token e of kv row kv counts from
// rr[3 kv + 2] on (`DECODE_ROWS`); PR = 0: all of them. out: [ROWS, D] in OT. One threadgroup of NW simdgroups per
// query-head row; lanes own D/32 channels. One pass (online softmax, Milakov & Gimelshein 2018): simdgroup w takes
// blocks of CU chunks and of EU exact tokens in turn, all of a block's loads issued before the first is used (the
// kernel is bound by memory latency, not bandwidth), with its own running maximum; the NW partial results are rescaled
// to the common maximum at the end.
constexpr int DPL = D / 32, CU = 4, EU = 8, RU = 32;
VQ_SHARED float wm[NW], wl[NW], wacc[NW * D], wex[ROT ? NW * D : 1], ac[ROT ? D : 1], ax[ROT ? D : 1];
const int row = vq_group_x, kv = row / REP, es = PR ? rr[3 * kv + 2] : 0;
const int E = EV ? (int)eref[0] : eref_shape[0], ecap = ek_shape[2], has_sinks = HS;
const int ns = pm_shape[1];
const float scale = vq_as_float(SCALE);
float qv[DPL], acc[DPL], acx[DPL];
VQ_UNROLL
for (int k = 0; k < DPL; k++) { qv[k] = vq_float(q[(long)row * D + vq_lane * DPL + k]) * scale; acc[k] = 0.0f; acx[k] = 0.0f; }
float m = VQ_NEG_INF, L = 0.0f;
for (int c0 = vq_warp * CU; c0 < ns; c0 += NW * CU) {  // the chunks' partials, CU at a time
  float mc[CU], lc[CU], pc[CU][DPL];
  VQ_UNROLL
  for (int u = 0; u < CU; u++) {
    const int c = min(c0 + u, ns - 1);
    mc[u] = c0 + u < ns ? pm[(long)row * ns + c] : VQ_NEG_INF; lc[u] = pl[(long)row * ns + c];
    VQ_UNROLL
    for (int k = 0; k < DPL; k++) pc[u][k] = pacc[((long)row * ns + c) * D + vq_lane * DPL + k];
  }
  float nm = m;
  VQ_UNROLL
  for (int u = 0; u < CU; u++) nm = fmax(nm, mc[u]);
  if (!(nm > VQ_NEG_INF)) continue;                    // only chunks without tokens so far
  const float a = exp(m - nm);
  L *= a;
  VQ_UNROLL
  for (int k = 0; k < DPL; k++) acc[k] *= a;
  VQ_UNROLL
  for (int u = 0; u < CU; u++) {
    const float b = mc[u] > VQ_NEG_INF ? exp(mc[u] - nm) : 0.0f;   // a chunk without tokens adds nothing
    L += lc[u] * b;
    VQ_UNROLL
    for (int k = 0; k < DPL; k++) acc[k] += pc[u][k] * b;
  }
  m = nm;
}
const long kb = (long)kv * ecap * D + vq_lane * DPL;
for (int e0 = es + vq_warp * EU; e0 < E; e0 += NW * EU) {  // the exact tokens, EU at a time
  float s[EU], vx[EU][DPL];
  VQ_UNROLL
  for (int u = 0; u < EU; u++) {
    const long o = kb + (long)min(e0 + u, E - 1) * D;
    s[u] = 0.0f;
    VQ_UNROLL
    for (int k = 0; k < DPL; k++) { s[u] += qv[k] * vq_float(ek[o + k]); vx[u][k] = vq_float(ev[o + k]); }
  }
  float nm = m;
  VQ_UNROLL
  for (int u = 0; u < EU; u++) { s[u] = vq_simd_sum(s[u]); if (e0 + u < E) nm = fmax(nm, s[u]); }
  const float a = exp(m - nm);
  L *= a;
  VQ_UNROLL
  for (int k = 0; k < DPL; k++) { acc[k] *= a; acx[k] *= a; }
  VQ_UNROLL
  for (int u = 0; u < EU; u++) {
    const float w = e0 + u < E ? exp(s[u] - nm) : 0.0f;
    L += w;
    VQ_UNROLL
    for (int k = 0; k < DPL; k++) acx[k] += w * vx[u][k];
  }
  m = nm;
}
if (vq_lane == 0) { wm[vq_warp] = m; wl[vq_warp] = L; }
VQ_UNROLL
for (int k = 0; k < DPL; k++) {
  if (ROT) { wacc[vq_warp * D + vq_lane * DPL + k] = acc[k]; wex[vq_warp * D + vq_lane * DPL + k] = acx[k]; }
  else wacc[vq_warp * D + vq_lane * DPL + k] = acc[k] + acx[k];
}
vq_barrier();
float M = has_sinks ? sinks[row] : VQ_NEG_INF;         // the common maximum (simdgroups, sink)
for (int w = 0; w < NW; w++) M = fmax(M, wm[w]);
float f[NW];
float Lt = has_sinks ? exp(sinks[row] - M) : 0.0f;
VQ_UNROLL
for (int w = 0; w < NW; w++) { f[w] = wm[w] > VQ_NEG_INF ? exp(wm[w] - M) : 0.0f; Lt += wl[w] * f[w]; }
if (ROT) {
  for (int d = vq_tid; d < D; d += 32 * NW) {
    float A = 0.0f, X = 0.0f;
    for (int w = 0; w < NW; w++) { A += wacc[w * D + d] * f[w]; X += wex[w * D + d] * f[w]; }
    ac[d] = A; ax[d] = X;
  }
  vq_barrier();
  for (int d = vq_tid; d < D; d += 32 * NW) {          // (acc · Rᵀ)_d = sum_j acc_j (Rᵀ)[j, d]: coalesced, RU loads in flight
    float A = 0.0f;
    for (int j0 = 0; j0 < D; j0 += RU) {
      float r[RU];
      VQ_UNROLL
      for (int i = 0; i < RU; i++) r[i] = j0 + i < D ? rot[(long)(j0 + i) * D + d] : 0.0f;
      VQ_UNROLL
      for (int i = 0; i < RU; i++) A += (j0 + i < D ? ac[j0 + i] : 0.0f) * r[i];
    }
    out[(long)row * D + d] = vq_cast(OT, (A + ax[d]) / Lt);
  }
} else {
  for (int d = vq_tid; d < D; d += 32 * NW) {
    float A = 0.0f;
    for (int w = 0; w < NW; w++) A += wacc[w * D + d] * f[w];
    out[(long)row * D + d] = vq_cast(OT, A / Lt);
  }
}
