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

__global__ void vq_affine_decode(
    const float* q,
    const uint32_t* kw,
    const __half* ks,
    const __half* kb,
    const uint32_t* vw,
    const __half* vs,
    const __half* vb,
    const int32_t* params,
    float* out_m,
    float* out_l,
    float* out_acc) {
  constexpr int D = 128;
  constexpr int KBITS = 4;
  constexpr int VBITS = 4;
  constexpr int G = 64;
  constexpr int REP = 4;

const uint vq_lane = threadIdx.x % 32;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

// q: [B*Hkv*REP, D] float32, already scaled; kw/vw: [B*Hkv, CAP, D*KBITS/32 | D*VBITS/32] uint32 codes
// (mx.quantize layout, LSB first); ks, kb, vs, vb: [B*Hkv, CAP, D/G] fp16 scales/biases;
// params: [n_tokens, CAP, split]. Out m, l: [B*Hkv*REP, NS]; acc: [B*Hkv*REP, NS, D].
// One simdgroup per (b*Hkv + h, chunk of `split` tokens), walking the chunk in tiles of 32 tokens:
// scores with one token per lane (no reduction per token), values with head_dim/32 channels per lane.
constexpr int DPL = D / 32, NG = D / G;
constexpr int KWPT = D * KBITS / 32, VWPT = D * VBITS / 32;  // uint32 words per token
constexpr int KPW = 32 / KBITS;                              // key codes per word
constexpr uint KMASK = (1u << KBITS) - 1u, VMASK = (1u << VBITS) - 1u;
VQ_SHARED float qs[REP * D];    // the rep query heads of this kv head
VQ_SHARED float qg[REP * NG];   // their sums over each quantization group (for the biases)
const int n = params[0], cap = params[1], split = params[2];
const int bh = vq_group_y, chunk = vq_group_x, ns = (n + split - 1) / split;
const int t0 = chunk * split, t1 = min(n, t0 + split);
for (int i = vq_lane; i < REP * D; i += 32) qs[i] = q[bh * REP * D + i];
vq_barrier();
for (int i = vq_lane; i < REP * NG; i += 32) {
  float a = 0.0f;
  for (int d = 0; d < G; d++) a += qs[(i / NG) * D + (i % NG) * G + d];
  qg[i] = a;
}
vq_barrier();
float m[REP], l[REP], acc[REP][DPL];
for (int r = 0; r < REP; r++) { m[r] = VQ_NEG_INF; l[r] = 0.0f; for (int k = 0; k < DPL; k++) acc[r][k] = 0.0f; }
for (int tt = t0; tt < t1; tt += 32) {
  const int t = tt + (int)vq_lane;
  const bool valid = t < t1;
  float s[REP];
  for (int r = 0; r < REP; r++) s[r] = 0.0f;
  if (valid) {
    const long tok = (long)bh * cap + t;
    for (int g = 0; g < NG; g++) {
      float part[REP];
      for (int r = 0; r < REP; r++) part[r] = 0.0f;
      for (int w = 0; w < G / KPW; w++) {
        const uint word = kw[tok * KWPT + g * (G / KPW) + w];
        for (int c = 0; c < KPW; c++) {
          const float x = float((word >> (c * KBITS)) & KMASK);
          const int d = g * G + w * KPW + c;
          for (int r = 0; r < REP; r++) part[r] += qs[r * D + d] * x;
        }
      }
      const float sc = vq_float(ks[tok * NG + g]), bi = vq_float(kb[tok * NG + g]);
      for (int r = 0; r < REP; r++) s[r] += sc * part[r] + bi * qg[r * NG + g];
    }
  }
  float p[REP];
  for (int r = 0; r < REP; r++) {
    const float sv = valid ? s[r] : VQ_NEG_INF;
    const float mn = fmax(m[r], vq_simd_max(sv));
    const float c = exp(m[r] - mn);
    p[r] = valid ? exp(sv - mn) : 0.0f;
    l[r] = l[r] * c + vq_simd_sum(p[r]);
    m[r] = mn;
    for (int k = 0; k < DPL; k++) acc[r][k] *= c;
  }
  const int cnt = min(32, t1 - tt);
  for (int j = 0; j < cnt; j++) {
    const long tok = (long)bh * cap + tt + j;
    float vx[DPL];
    for (int k = 0; k < DPL; k++) {
      const int d = (int)vq_lane * DPL + k, g = d / G, vbit = d * VBITS;
      const uint code = (vw[tok * VWPT + vbit / 32] >> (vbit % 32)) & VMASK;
      vx[k] = vq_float(vs[tok * NG + g]) * float(code) + vq_float(vb[tok * NG + g]);
    }
    for (int r = 0; r < REP; r++) {
      const float pj = vq_simd_shuffle(p[r], j);
      for (int k = 0; k < DPL; k++) acc[r][k] += pj * vx[k];
    }
  }
}
for (int r = 0; r < REP; r++) {
  const int row = (bh * REP + r) * ns + chunk;
  if (vq_lane == 0) { out_m[row] = m[r]; out_l[row] = l[r]; }
  for (int k = 0; k < DPL; k++) out_acc[row * D + vq_lane * DPL + k] = acc[r][k];
}

}

} // namespace mlx::core::cu
