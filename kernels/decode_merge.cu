#include <cooperative_groups.h>
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef unsigned int uint;
#define VQ_SHARED __shared__
#define vq_barrier() __syncthreads()
__device__ __forceinline__ float vq_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float vq_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
#define vq_simd_shuffle(x, i) __shfl_sync(0xffffffffu, (x), (i))
#define vq_popcount(x) __popc(x)
__device__ __forceinline__ float vq_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float vq_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float vq_float(float x) { return x; }
#define VQ_NEG_INF (-__int_as_float(0x7f800000))
namespace mlx::core::cu {

namespace cg = cooperative_groups;

__global__ void vq_decode_merge(
    const float* pm,
    const float* pl,
    const float* pacc,
    const float* q,
    const __half* ek,
    const __half* ev,
    const float* sinks,
    const int32_t* params,
    float* out) {
  constexpr int D = 128;
  constexpr int REP = 4;

const uint vq_lane = threadIdx.x % 32;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

// pm, pl: [ROWS, NS]; pacc: [ROWS, NS, D]; q: [ROWS, D] float32, scaled; ek, ev: [ROWS / REP, E, D];
// sinks: [ROWS] (read only when params[2] != 0); params: [NS, E, has_sinks]. out: [ROWS, D] float32.
constexpr int DPL = D / 32;
const int row = vq_group_x, kv = row / REP;
const int ns = params[0], E = params[1], has_sinks = params[2];
float qv[DPL], acc[DPL];
for (int k = 0; k < DPL; k++) { qv[k] = q[row * D + vq_lane * DPL + k]; acc[k] = 0.0f; }
float M = has_sinks ? sinks[row] : VQ_NEG_INF;
for (int c = 0; c < ns; c++) M = fmax(M, pm[row * ns + c]);
for (int e = 0; e < E; e++) {
  float s = 0.0f;
  for (int k = 0; k < DPL; k++) s += qv[k] * vq_float(ek[((long)kv * E + e) * D + vq_lane * DPL + k]);
  M = fmax(M, vq_simd_sum(s));
}
float L = has_sinks ? exp(sinks[row] - M) : 0.0f;
for (int c = 0; c < ns; c++) {
  const float w = exp(pm[row * ns + c] - M);
  L += pl[row * ns + c] * w;
  for (int k = 0; k < DPL; k++) acc[k] += pacc[((long)row * ns + c) * D + vq_lane * DPL + k] * w;
}
for (int e = 0; e < E; e++) {
  float s = 0.0f;
  for (int k = 0; k < DPL; k++) s += qv[k] * vq_float(ek[((long)kv * E + e) * D + vq_lane * DPL + k]);
  const float w = exp(vq_simd_sum(s) - M);
  L += w;
  for (int k = 0; k < DPL; k++) acc[k] += w * vq_float(ev[((long)kv * E + e) * D + vq_lane * DPL + k]);
}
for (int k = 0; k < DPL; k++) out[row * D + vq_lane * DPL + k] = acc[k] / L;

}

} // namespace mlx::core::cu
