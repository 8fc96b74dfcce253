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

__global__ void vq_decode_merge(
    const float* pm,
    const __grid_constant__ Shape pm_shape,
    const float* pl,
    const float* pacc,
    const __half* q,
    const __half* ek,
    const __grid_constant__ Shape ek_shape,
    const __half* ev,
    const float* sinks,
    const uint8_t* eref,
    const __grid_constant__ Shape eref_shape,
    const float* rot,
    const int32_t* rr,
    __half* out) {
  constexpr int D = 128;
  constexpr int REP = 4;
  constexpr int NW = 4;
  using OT = __half;
  constexpr int HS = 0;
  constexpr int ROT = 0;
  constexpr int SCALE = 1035273459;
  constexpr int PR = 0;
  constexpr int EV = 0;

const uint vq_lane = threadIdx.x % 32, vq_warp = threadIdx.x / 32, vq_tid = threadIdx.x;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

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

}

} // namespace mlx::core::cu
