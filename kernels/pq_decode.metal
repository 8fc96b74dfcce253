// vq_pq_decode: header

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

// vq_pq_decode: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup, vq_warp = simdgroup_index_in_threadgroup;
const uint vq_tid = thread_position_in_threadgroup.x;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

// Chunk partials of one decode step over product-VQ codes, scored from a query × centroid table (no key is decoded).
// tab [ROWS, KSUB·NC] float32: row = bh·REP + r, entry m·NC + c = q'_m·C[c] times scale·log2(e) (computed once per step);
// kc [B, Hkv, CAP, KSUB] uint8 key codes (KSUB a multiple of 4: read as words); vc [B, Hkv, CAP, VSUB] uint8 value codes;
// vcb [Hkv, NC, VD] float32 value codebooks (the rotated domain: the merge undoes the rotation); tokens [0, n), n = nref_shape[0].
// One threadgroup of NW simdgroups per (chunk of split = sref_shape[0] tokens, a runtime value, bh). Scores: each lane one token (32 a simdgroup step),
// s_r = Σ_m tab[r, m·NC + code_m]; values: lanes own DV/32 channels, the tokens' weights broadcast by shuffles, the
// centroids read from threadgroup memory. Out as every decode kernel's partials: out_m (natural log), out_l, out_acc.
constexpr int VPL = DV / 32, MK = KSUB * NC;
VQ_SHARED float wm[NW * REP], wl[NW * REP], wacc[NW * REP * DV], cbs[NC * VD];
const int chunk = vq_group_x, bh = vq_group_y;
const int Hkv = kc_shape[1], CAP = kc_shape[2], h = bh % Hkv;
const int n = nref_shape[0], split = sref_shape[0], ns = (n + split - 1) / split;
for (int i = vq_tid; i < NC * VD; i += 32 * NW) cbs[i] = vcb[(long)h * NC * VD + i];
vq_barrier();
float m[REP], l[REP], acc[REP][VPL], p[REP];
VQ_UNROLL
for (int r = 0; r < REP; r++) {
  m[r] = VQ_NEG_INF; l[r] = 0.0f;
  VQ_UNROLL
  for (int k = 0; k < VPL; k++) acc[r][k] = 0.0f;
}
const int t0 = chunk * split, t1 = min(n, t0 + split);
for (int tb = t0 + 32 * (int)vq_warp; tb < t1; tb += 32 * NW) {
  const int t = tb + (int)vq_lane;
  const bool ok = t < t1;
  float s[REP];
  VQ_UNROLL
  for (int r = 0; r < REP; r++) s[r] = 0.0f;
  if (ok) {
    const long co = ((long)bh * CAP + t) * KSUB;
    for (int w = 0; w < KSUB / 4; w++) {
      const uint word = vq_load1(kc, co + 4 * w);
      VQ_UNROLL
      for (int b = 0; b < 4; b++) {
        const int idx = (4 * w + b) * NC + (int)((word >> (8 * b)) & 0xffu);
        VQ_UNROLL
        for (int r = 0; r < REP; r++) s[r] += tab[((long)bh * REP + r) * MK + idx];
      }
    }
  }
  VQ_UNROLL
  for (int r = 0; r < REP; r++) {
    const float sv = ok ? s[r] : VQ_NEG_INF;
    const float mn = fmax(m[r], vq_simd_max(sv)), c = vq_exp2(m[r] - mn);
    p[r] = ok ? vq_exp2(sv - mn) : 0.0f;
    l[r] = l[r] * c + vq_simd_sum(p[r]);
    m[r] = mn;
    VQ_UNROLL
    for (int k = 0; k < VPL; k++) acc[r][k] *= c;
  }
  const int cnt = min(32, t1 - tb);
  for (int j = 0; j < cnt; j++) {
    float pj[REP];
    VQ_UNROLL
    for (int r = 0; r < REP; r++) pj[r] = vq_simd_shuffle(p[r], j);
    const long vo = ((long)bh * CAP + tb + j) * VSUB;
    VQ_UNROLL
    for (int k = 0; k < VPL; k++) {
      const int ch = (int)vq_lane * VPL + k;
      const float y = cbs[(int)vc[vo + ch / VD] * VD + ch % VD];
      VQ_UNROLL
      for (int r = 0; r < REP; r++) acc[r][k] += pj[r] * y;
    }
  }
}
VQ_UNROLL
for (int r = 0; r < REP; r++) {
  if (vq_lane == 0) { wm[vq_warp * REP + r] = m[r]; wl[vq_warp * REP + r] = l[r]; }
  VQ_UNROLL
  for (int k = 0; k < VPL; k++) wacc[(vq_warp * REP + r) * DV + vq_lane * VPL + k] = acc[r][k];
}
vq_barrier();
for (int i = vq_tid; i < REP * DV; i += 32 * NW) {
  const int r = i / DV;
  float M = VQ_NEG_INF;
  for (int w = 0; w < NW; w++) M = fmax(M, wm[w * REP + r]);
  float L = 0.0f, A = 0.0f;
  if (M > VQ_NEG_INF) {
    for (int w = 0; w < NW; w++) {
      const float e = wm[w * REP + r] > VQ_NEG_INF ? vq_exp2(wm[w * REP + r] - M) : 0.0f;
      L += wl[w * REP + r] * e; A += wacc[(w * REP + r) * DV + i % DV] * e;
    }
  }
  const long row = (long)bh * REP + r;
  out_acc[(row * ns + chunk) * DV + i % DV] = A;
  if (i % DV == 0) { out_m[row * ns + chunk] = M * 0.6931471805599453f; out_l[row * ns + chunk] = L; }
}
