// vq_sign_scores: header

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

// vq_sign_scores: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup, vq_warp = simdgroup_index_in_threadgroup;
const uint vq_tid = thread_position_in_threadgroup.x;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

// u: [ROWS, M] projected queries S q (float32), ROWS = BH*REP; signs: [BH, CAP, M/32] uint32 (bit 1 = +1, LSB first);
// norms: [BH, CAP, 1] fp16; params: [n, cap, float bits of the factor c = sqrt(pi/2)/M]. Out: [ROWS, n] float32,
// c * norm * <u~, z>, u~ the QB-bit quantization of u. Threadgroup: 32*NW threads on (bh, block of 32*NW keys).
constexpr int MW = M / 32;
VQ_SHARED uint planes[REP * QB * MW];
VQ_SHARED float qlo[REP], qdelta[REP];
VQ_SHARED float red[2 * NW];
const int n = params[0], cap = params[1];
const float cfac = vq_as_float(params[2]);
const int bh = vq_group_y, blk = vq_group_x;
for (int r = 0; r < REP; r++) {                       // quantize u of query head r to QB bits, build its bit planes
  const long urow = ((long)bh * REP + r) * M;
  float lo = 3.0e38f, hi = -3.0e38f;
  for (int i = vq_tid; i < M; i += 32 * NW) { const float x = u[urow + i]; lo = fmin(lo, x); hi = fmax(hi, x); }
  lo = vq_simd_min(lo); hi = vq_simd_max(hi);
  if (vq_lane == 0) { red[vq_warp] = lo; red[NW + vq_warp] = hi; }
  vq_barrier();
  lo = red[0]; hi = red[NW];
  for (int w = 1; w < NW; w++) { lo = fmin(lo, red[w]); hi = fmax(hi, red[NW + w]); }
  const float delta = fmax((hi - lo) / float((1 << QB) - 1), 1e-30f);
  for (int w = vq_warp; w < MW; w += NW) {            // simdgroup w: projections 32w .. 32w+31, one per lane
    const uint qb = (uint)fmin(fmax(round((u[urow + w * 32 + vq_lane] - lo) / delta), 0.0f), float((1 << QB) - 1));
    for (int k = 0; k < QB; k++) {
      const uint word = vq_ballot(((qb >> k) & 1u) != 0u);
      if (vq_lane == 0) planes[(r * QB + k) * MW + w] = word;
    }
  }
  if (vq_tid == 0) { qlo[r] = lo; qdelta[r] = delta; }
  vq_barrier();
}
const int t = blk * 32 * NW + (int)vq_tid;
if (t < n) {
  const long tok = (long)bh * cap + t;
  int pb = 0, acc[REP];
  VQ_UNROLL
  for (int r = 0; r < REP; r++) acc[r] = 0;
  for (int w4 = 0; w4 < MW; w4 += 4) {
    const uint4 s4 = vq_load4(signs, tok * MW + w4);
    const uint sw[4] = {s4.x, s4.y, s4.z, s4.w};
    VQ_UNROLL
    for (int j = 0; j < 4; j++) {
      const int pc = vq_popcount(sw[j]);
      pb += pc;
      VQ_UNROLL
      for (int r = 0; r < REP; r++) {
        VQ_UNROLL
        for (int k = 0; k < QB; k++) acc[r] += (pc - (int)vq_popcount(planes[(r * QB + k) * MW + w4 + j] ^ sw[j])) << k;
      }
    }
  }
  const float nk = vq_float(norms[tok]) * cfac;
  VQ_UNROLL
  for (int r = 0; r < REP; r++)
    out[((long)bh * REP + r) * n + t] = nk * (qlo[r] * float(2 * pb - M) + qdelta[r] * float(acc[r]));
}
