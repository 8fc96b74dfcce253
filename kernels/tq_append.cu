#include <cooperative_groups.h>
#include <cstdint>

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
namespace mlx::core::cu {

namespace cg = cooperative_groups;

__global__ void vq_tq_append(
    const __nv_bfloat16* xk,
    const __nv_bfloat16* xv,
    const float* R,
    const float* bk,
    const float* bv,
    uint32_t* kc,
    __half* kn,
    uint32_t* vc,
    __half* vn) {
  constexpr int D = 128;
  constexpr int KBITS = 3;
  constexpr int VBITS = 3;

const uint vq_lane = threadIdx.x % 32, vq_warp = threadIdx.x / 32, vq_tid = threadIdx.x;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

// xk, xv: [N, D] new keys / values (any float dtype); R: [D, D] float32 rotation (y = x R); bk, bv: the codebook
// boundaries [2^KBITS - 1], [2^VBITS - 1] float32 (ascending). Threadgroup: D threads on token vq_group_x of side
// vq_group_y. Out kc: [N, ceil(D*KBITS/32)] uint32 packed codes, kn: [N, 1] fp16 norms; vc, vn likewise.
constexpr int KW = (D * KBITS + 31) / 32, VW = (D * VBITS + 31) / 32;
VQ_SHARED float xs[D], red[D / 32];
VQ_SHARED uint codes[D];
const int tok = vq_group_x, side = vq_group_y, d = vq_tid;
const float x = vq_float(side ? xv[(long)tok * D + d] : xk[(long)tok * D + d]);
const float ss = vq_simd_sum(x * x);
if (vq_lane == 0) red[vq_warp] = ss;
xs[d] = x;
vq_barrier();
float nrm2 = 0.0f;
for (int w = 0; w < D / 32; w++) nrm2 += red[w];
const float nrm = sqrt(nrm2), inv = 1.0f / fmax(nrm, 1e-30f);
float y = 0.0f;
for (int i = 0; i < D; i++) y += (xs[i] * inv) * R[i * D + d];
uint c = 0u;
if (side) { for (int i = 0; i < (1 << VBITS) - 1; i++) c += y > bv[i] ? 1u : 0u; }
else      { for (int i = 0; i < (1 << KBITS) - 1; i++) c += y > bk[i] ? 1u : 0u; }
codes[d] = c;
if (d == 0) { if (side) vn[tok] = vq_cast(vq_half, nrm); else kn[tok] = vq_cast(vq_half, nrm); }
vq_barrier();
if (side) {
  for (int w = vq_tid; w < VW; w += D) {   // packed word w of the LSB-first bit stream of D codes of VBITS bits
    uint word = 0u;
    const int b0 = w * 32, i0 = b0 / VBITS, i1 = min(D, (b0 + 32 + VBITS - 1) / VBITS);
    for (int i = i0; i < i1; i++) { const int sh = i * VBITS - b0; word |= sh >= 0 ? (codes[i] << sh) : (codes[i] >> (-sh)); }
    vc[(long)tok * VW + w] = word;
  }
} else {
  for (int w = vq_tid; w < KW; w += D) {   // packed word w of the LSB-first bit stream of D codes of KBITS bits
    uint word = 0u;
    const int b0 = w * 32, i0 = b0 / KBITS, i1 = min(D, (b0 + 32 + KBITS - 1) / KBITS);
    for (int i = i0; i < i1; i++) { const int sh = i * KBITS - b0; word |= sh >= 0 ? (codes[i] << sh) : (codes[i] >> (-sh)); }
    kc[(long)tok * KW + w] = word;
  }
}

}

} // namespace mlx::core::cu
