// vq_pq_nearest: header

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

// vq_pq_nearest: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup, vq_warp = simdgroup_index_in_threadgroup;
const uint vq_tid = thread_position_in_threadgroup.x;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

// Fused nearest-centroid encode: x [B, H, N, DS] float32 sub-vectors (already smoothed and rotated), cb [H, NC, DS]
// float32 codebooks, hn [H, NC] float32 half squared norms ½‖c‖². out [B, H, N] uint8: argmax_c (x·c − ½‖c‖²), the first
// of equal maxima. One threadgroup of TPG threads per (block of TPG rows, b·H + h); the head's codebook sits in
// threadgroup memory; each thread keeps its row in registers and walks the NC centroids: no distance tensor exists.
VQ_SHARED float cbs[NC * DS], hs[NC];
const int bh = vq_group_y, H = x_shape[1], N = x_shape[2], h = bh % H;
for (int i = vq_tid; i < NC * DS; i += TPG) cbs[i] = cb[(long)h * NC * DS + i];
for (int i = vq_tid; i < NC; i += TPG) hs[i] = hn[(long)h * NC + i];
vq_barrier();
const long row = (long)vq_group_x * TPG + vq_tid;
if (row < N) {
  float xv[DS];
  VQ_UNROLL
  for (int j = 0; j < DS; j++) xv[j] = x[((long)bh * N + row) * DS + j];
  float best = VQ_NEG_INF;
  int arg = 0;
  for (int c = 0; c < NC; c++) {
    float d = 0.0f;
    VQ_UNROLL
    for (int j = 0; j < DS; j++) d += xv[j] * cbs[c * DS + j];
    d -= hs[c];
    if (d > best) { best = d; arg = c; }
  }
  out[(long)bh * N + row] = (uint8_t)arg;
}
