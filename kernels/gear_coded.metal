// vq_gear_coded: header

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

// vq_gear_coded: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup, vq_warp = simdgroup_index_in_threadgroup;
const uint vq_tid = thread_position_in_threadgroup.x;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

// Chunk partials of one decode step: qt [ROWS, DK] float32, the queries in the keys' (tile) domain, already multiplied by
// scale·log2(e); tokens [lo, T) of each row bh = b·Hkv + kv count (the RANGE part sets T and lo); the KEY and VALUE parts load token
// tok's key and value channels of this lane (a decoded tile's, or a codec's codes decoded in registers: `coded_partials`). One threadgroup of NW simdgroups per (chunk of split = sref_shape[0] tokens, a runtime value, bh); simdgroups
// take U tokens at a time in turn, lanes own DK/32 key and DV/32 value channels, each simdgroup keeps the online softmax of the
// REP query rows of its kv head (log2 units). Out, per (row = bh·REP + r, chunk): out_m (natural log units: the
// merge's), out_l, out_acc [ROWS, NS, DV]; a chunk without a valid token writes m = -inf, l = 0, acc = 0.
constexpr int KPL = DK / 32, VPL = DV / 32;
VQ_SHARED float wm[NW * REP], wl[NW * REP], wacc[NW * REP * DV];
const int chunk = vq_group_x, bh = vq_group_y;
const int T = nref_shape[0], lo = 0;
const int k_CAP = k_w_shape[2], v_CAP = v_w_shape[2];
#define VQ_FIELD(p, o, s, nb) ((((s) + (nb) <= 32) ? ((p)[o] >> (s)) : (((p)[o] >> (s)) | ((p)[(o) + 1] << (32 - (s))))) & ((1u << (nb)) - 1u))

const int split = sref_shape[0], ns = (T + split - 1) / split;
float q[REP][KPL], m[REP], l[REP], acc[REP][VPL];
VQ_UNROLL
for (int r = 0; r < REP; r++) {
  VQ_UNROLL
  for (int k = 0; k < KPL; k++) q[r][k] = qt[((long)bh * REP + r) * DK + vq_lane * KPL + k];
  m[r] = VQ_NEG_INF; l[r] = 0.0f;
  VQ_UNROLL
  for (int k = 0; k < VPL; k++) acc[r][k] = 0.0f;
}
const int t0 = chunk * split, t1 = min(T, t0 + split), tb = max(t0, lo);
for (int t = tb + U * (int)vq_warp; t < t1; t += U * NW) {   // U tokens per simdgroup step: independent sums (ILP)
  float s[U][REP], vv[U][VPL];
  VQ_UNROLL
  for (int u = 0; u < U; u++) {
    const int tok = t + u < t1 ? t + u : t;   // token tok of row bh: its key channels vq_lane·KPL + k into kk, values into vv[u]
    float kk[KPL];
    {
      {
      const int g_ = tok / 128, j_ = (tok % 128) * 2;
      const long r0_ = (long)bh * k_CAP + (long)g_ * 128;             // the group's first token
      const long wb_ = r0_ * 8 + (j_ >> 5), pb_ = r0_ * 6;
      VQ_UNROLL
      for (int i_ = 0; i_ < KPL; i_ += 2) {                        // channel pairs: one word of scales, one of biases
        const int c_ = vq_lane * KPL + i_;
        const float2 s_ = vq_h2_float2(vq_load1(k_p, pb_ + 2 * c_)), z_ = vq_h2_float2(vq_load1(k_p, pb_ + 2 * (128 + c_)));
        kk[i_] = s_.x * (float)VQ_FIELD(k_w, wb_ + (long)c_ * 8, j_ & 31, 2) + z_.x;
        kk[i_ + 1] = s_.y * (float)VQ_FIELD(k_w, wb_ + (long)(c_ + 1) * 8, j_ & 31, 2) + z_.y;
      }
      }
      {                                                  // + a[tok] · B[c] (rank 1)
        const long rt_ = (long)bh * k_CAP + tok, bb_ = ((long)bh * k_CAP + (long)(tok / 128) * 128) * 6 + 512;
        const float a_ = vq_float(k_a[rt_]);
        VQ_UNROLL
        for (int i_ = 0; i_ < KPL; i_ += 2) {
          const float2 h_ = vq_h2_float2(vq_load1(k_p, bb_ + 2L * (vq_lane * KPL + i_)));
          kk[i_] += a_ * h_.x; kk[i_ + 1] += a_ * h_.y;
        }
      }
    }
    {
      {
      const long r_ = (long)bh * v_CAP + tok;
      VQ_UNROLL
      for (int j_ = 0; j_ < VPL; j_++) {
        const int c_ = vq_lane * VPL + j_, b_ = c_ * 2;
        const uint x_ = VQ_FIELD(v_w, r_ * 8 + (b_ >> 5), b_ & 31, 2);
        const long g_ = r_ * 2 + c_ / 64;
        vv[u][j_] = vq_float(v_s[g_]) * (float)x_ + vq_float(v_b[g_]);
      }
      }
      {                                                  // + a[tok] · B[c] (rank 1)
        const long rt_ = (long)bh * v_CAP + tok, bb_ = ((long)bh * v_CAP + (long)(tok / 128) * 128) * 2 + 0;
        const float a_ = vq_float(v_a[rt_]);
        VQ_UNROLL
        for (int i_ = 0; i_ < VPL; i_ += 2) {
          const float2 h_ = vq_h2_float2(vq_load1(v_p, bb_ + 2L * (vq_lane * VPL + i_)));
          vv[u][i_] += a_ * h_.x; vv[u][i_ + 1] += a_ * h_.y;
        }
      }
    }
    VQ_UNROLL
    for (int r = 0; r < REP; r++) {
      float d = 0.0f;
      VQ_UNROLL
      for (int k = 0; k < KPL; k++) d += q[r][k] * kk[k];
      s[u][r] = d;
    }
  }
  VQ_UNROLL
  for (int u = 0; u < U; u++) {
    VQ_UNROLL
    for (int r = 0; r < REP; r++) s[u][r] = t + u < t1 ? vq_simd_sum(s[u][r]) : VQ_NEG_INF;
  }
  VQ_UNROLL
  for (int r = 0; r < REP; r++) {
    float mx_ = s[0][r];
    VQ_UNROLL
    for (int u = 1; u < U; u++) mx_ = fmax(mx_, s[u][r]);
    const float mn = fmax(m[r], mx_), c = vq_exp2(m[r] - mn);
    m[r] = mn; l[r] *= c;
    VQ_UNROLL
    for (int k = 0; k < VPL; k++) acc[r][k] *= c;
    VQ_UNROLL
    for (int u = 0; u < U; u++) {
      const float p = vq_exp2(s[u][r] - mn);
      l[r] += p;
      VQ_UNROLL
      for (int k = 0; k < VPL; k++) acc[r][k] += p * vv[u][k];
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
