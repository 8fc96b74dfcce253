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

__global__ void vq_sign_scores(
    const float* u,
    const uint32_t* signs,
    const __half* norms,
    const int32_t* params,
    float* out) {
  constexpr int M = 256;
  constexpr int REP = 4;
  constexpr int QB = 8;
  constexpr int NW = 4;

const uint vq_lane = threadIdx.x % 32, vq_warp = threadIdx.x / 32, vq_tid = threadIdx.x;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

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

}

} // namespace mlx::core::cu
