#include <cooperative_groups.h>
#include <cstdint>
#include <cuda/std/array>

#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef unsigned int uint;
typedef __half vq_half;
#define VQ_SHARED __shared__
#define VQ_SHARED_A16 __shared__ __align__(16)
#define VQ_UNROLL _Pragma("unroll")
#define VQ_UNROLL4 _Pragma("unroll 4")
#define vq_barrier() __syncthreads()
__device__ __forceinline__ float vq_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float vq_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float vq_simd_min(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
#define vq_simd_shuffle(x, i) __shfl_sync(0xffffffffu, (x), (i))
#define vq_simd_shuffle_xor(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define vq_ballot(p) __ballot_sync(0xffffffffu, (p))
#define vq_popcount(x) __popc(x)
__device__ __forceinline__ float vq_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float vq_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float vq_float(float x) { return x; }
template <typename T> __device__ __forceinline__ T vq_from_float(float x) { return T(x); }
template <> __device__ __forceinline__ __half vq_from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 vq_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
#define vq_cast(T, x) vq_from_float<T>(x)
#define vq_as_float(u) __uint_as_float((unsigned int)(u))
#define vq_load2(p, i) (*reinterpret_cast<const uint2*>((p) + (i)))
#define vq_load4(p, i) (*reinterpret_cast<const uint4*>((p) + (i)))
#define vq_lds4(a, i) (*reinterpret_cast<const float4*>(&(a)[i]))
#define VQ_NEG_INF (-__int_as_float(0x7f800000))
typedef __half2 vq_h2;
#define VQ_FN __device__ __forceinline__
#define VQ_THREAD
VQ_FN vq_h2 vq_h2_bits(uint u) { union { uint u; __half2 h; } x; x.u = u; return x.h; }
VQ_FN uint vq_bits_h2(vq_h2 h) { union { uint u; __half2 h; } x; x.h = h; return x.u; }
VQ_FN float2 vq_h2_float2(uint u) { return __half22float2(vq_h2_bits(u)); }
#define vq_h2_fma(a, b, c) __hfma2((a), (b), (c))
#define vq_h2_sub(a, b) __hsub2((a), (b))
#define vq_h2_splat(x) __float2half2_rn(x)
#define vq_h2_pair(lo, hi) __floats2half2_rn((lo), (hi))
#define vq_byte_perm(a, b, s) __byte_perm((a), (b), (s))
#define vq_exp2(x) exp2f(x)
#define vq_load1(p, i) (*reinterpret_cast<const uint*>((p) + (i)))
#define vq_device_fence() __threadfence()
#define vq_atomic_inc(p) atomicAdd((unsigned int*)(p), 1u)
#define vq_atomic_zero(p) atomicExch((unsigned int*)(p), 0u)
#define vq_ld_cg(p) __ldcg(p)
#define vq_simd_sync() __syncwarp()
VQ_FN void vq_mma16816(float* c, const uint* a, uint b0, uint b1, uint lane) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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
namespace mlx::core::cu {

namespace cg = cooperative_groups;
using Shape = cuda::std::array<int32_t, 8>;  // as MLX's device/utils.cuh

__global__ void vq_pq_nearest(
    const float* x,
    const __grid_constant__ Shape x_shape,
    const float* cb,
    const float* hn,
    uint8_t* out) {
  constexpr int DS = 8;
  constexpr int NC = 256;
  constexpr int TPG = 256;

const uint vq_lane = threadIdx.x % 32, vq_warp = threadIdx.x / 32, vq_tid = threadIdx.x;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

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

}

} // namespace mlx::core::cu
