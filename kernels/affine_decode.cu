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

__global__ void vq_affine_decode(
    const __half* q,
    const uint32_t* kw,
    const __grid_constant__ Shape kw_shape,
    const __half* ks,
    const __half* kb,
    const uint32_t* vw,
    const __half* vs,
    const __half* vb,
    const uint8_t* nref,
    const __grid_constant__ Shape nref_shape,
    const uint8_t* sref,
    const __grid_constant__ Shape sref_shape,
    const int32_t* rr,
    float* out_m,
    float* out_l,
    float* out_acc) {
  constexpr int D = 128;
  constexpr int KBITS = 4;
  constexpr int VBITS = 4;
  constexpr int G = 64;
  constexpr int REP = 4;
  constexpr int NW = 4;
  constexpr int SCALE = 1035273459;
  constexpr int PR = 0;

const uint vq_lane = threadIdx.x % 32, vq_warp = threadIdx.x / 32, vq_tid = threadIdx.x;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

// q: [ROWS, D] queries in the model dtype (unscaled), ROWS = B*Hkv*REP; kw/vw: [B*Hkv, CAP, D*KBITS/32 | D*VBITS/32]
// uint32 codes (mx.quantize layout, LSB first); ks, kb, vs, vb: [B*Hkv, CAP, D/G] fp16 scales/biases;
// nref: any array of shape [n] (n = tokens to attend; only its shape is read); sref: of shape [split] (tokens per chunk, a runtime value: one compile serves every length),
// SCALE (float bits of the softmax scale).
// Out m, l: [ROWS, NS]; acc: [ROWS, NS, D] (unnormalised), NS = ceil(n / split).
constexpr int NG = D / G, KWPT = D * KBITS / 32, VWPT = D * VBITS / 32;
constexpr int KPW = 32 / KBITS, VPW = 32 / VBITS;
constexpr uint KMASK = (1u << KBITS) - 1u, VMASK = (1u << VBITS) - 1u;
constexpr int VLPT = D / 16, VTPI = 32 / VLPT, VW = VBITS / 2;  // value pass: VLPT lanes per token, 16 channels (VW words) per lane
constexpr uint MAGIC = 0x4B000000u;                              // as_float(MAGIC | c) = 2^23 + c exactly
VQ_SHARED_A16 float qs[REP * D];
VQ_SHARED float qg[REP * NG];
VQ_SHARED float wm[NW * REP], wl[NW * REP];
VQ_SHARED float wacc[NW * REP * D];
const int n = nref_shape[0], cap = kw_shape[2], split = sref_shape[0];
const float scale = vq_as_float(SCALE);
const int bh = vq_group_y, chunk = vq_group_x, ns = (n + split - 1) / split;
const int cs = PR ? rr[3 * bh] : 0, ce = PR ? rr[3 * bh + 1] : n;
const int t0 = cs + chunk * split, t1 = min(ce, t0 + split);
for (int i = vq_tid; i < REP * D; i += 32 * NW) qs[i] = vq_float(q[(long)bh * REP * D + i]) * scale;
vq_barrier();
for (int i = vq_tid; i < REP * NG; i += 32 * NW) {
  float a = 0.0f;
  for (int d = 0; d < G; d++) a += qs[(i / NG) * D + (i % NG) * G + d];
  qg[i] = a;
}
vq_barrier();
const long base = (long)bh * cap;
const int vsub = vq_lane % VLPT, vtok = vq_lane / VLPT, vg = vsub * 16 / G;
float m[REP], lsum[REP], accb[REP], acc[REP][16];
VQ_UNROLL
for (int r = 0; r < REP; r++) {
  m[r] = VQ_NEG_INF; lsum[r] = 0.0f; accb[r] = 0.0f;
  VQ_UNROLL
  for (int c = 0; c < 16; c++) acc[r][c] = 0.0f;
}
for (int tt = t0 + (int)vq_warp * 32; tt < t1; tt += 32 * NW) {
  const int t = tt + (int)vq_lane;
  const bool valid = t < t1;
  // issue every load of the tile first (keys: one token per lane; values: VLPT steps of VTPI tokens), one round trip
  uint kr[KWPT];
  float ksc[NG], kbi[NG];
  if (valid) {
    VQ_UNROLL
    for (int i = 0; i < KWPT; i += 4) {
      const uint4 u = vq_load4(kw, (base + t) * KWPT + i);
      kr[i] = u.x; kr[i + 1] = u.y; kr[i + 2] = u.z; kr[i + 3] = u.w;
    }
    VQ_UNROLL
    for (int g = 0; g < NG; g++) { ksc[g] = vq_float(ks[(base + t) * NG + g]); kbi[g] = vq_float(kb[(base + t) * NG + g]); }
  } else {
    VQ_UNROLL
    for (int i = 0; i < KWPT; i++) kr[i] = 0u;
    VQ_UNROLL
    for (int g = 0; g < NG; g++) { ksc[g] = 0.0f; kbi[g] = 0.0f; }
  }
  uint vr[VLPT][4];
  float vsc[VLPT], vbi[VLPT];
  VQ_UNROLL
  for (int it = 0; it < VLPT; it++) {
    const int tv = tt + it * VTPI + vtok;
    vr[it][0] = vr[it][1] = vr[it][2] = vr[it][3] = 0u; vsc[it] = 0.0f; vbi[it] = 0.0f;
    if (tv < t1) {
      const long tok = base + tv;
      if (VW == 4) { const uint4 u = vq_load4(vw, tok * VWPT + vsub * 4); vr[it][0] = u.x; vr[it][1] = u.y; vr[it][2] = u.z; vr[it][3] = u.w; }
      else if (VW == 2) { const uint2 u = vq_load2(vw, tok * VWPT + vsub * 2); vr[it][0] = u.x; vr[it][1] = u.y; }
      else { vr[it][0] = vw[tok * VWPT + vsub]; }
      vsc[it] = vq_float(vs[tok * NG + vg]); vbi[it] = vq_float(vb[tok * NG + vg]);
    }
  }
  // scores: q·k = sum_g s_g (sum_{d in g} q_d c_d) + b_g (sum_{d in g} q_d)
  float s[REP];
  VQ_UNROLL
  for (int r = 0; r < REP; r++) s[r] = 0.0f;
  VQ_UNROLL
  for (int g = 0; g < NG; g++) {
    float part[REP];
    VQ_UNROLL
    for (int r = 0; r < REP; r++) part[r] = 0.0f;
    VQ_UNROLL
    for (int wi = 0; wi < G / KPW; wi++) {
      const uint word = kr[g * (G / KPW) + wi];
      VQ_UNROLL
      for (int c = 0; c < KPW; c += 4) {
        const float x0 = vq_as_float(((word >> (c * KBITS)) & KMASK) | MAGIC) - 8388608.0f;
        const float x1 = vq_as_float(((word >> ((c + 1) * KBITS)) & KMASK) | MAGIC) - 8388608.0f;
        const float x2 = vq_as_float(((word >> ((c + 2) * KBITS)) & KMASK) | MAGIC) - 8388608.0f;
        const float x3 = vq_as_float(((word >> ((c + 3) * KBITS)) & KMASK) | MAGIC) - 8388608.0f;
        const int d = g * G + wi * KPW + c;
        VQ_UNROLL
        for (int r = 0; r < REP; r++) {
          const float4 qv = vq_lds4(qs, r * D + d);
          part[r] = fma(qv.x, x0, part[r]); part[r] = fma(qv.y, x1, part[r]);
          part[r] = fma(qv.z, x2, part[r]); part[r] = fma(qv.w, x3, part[r]);
        }
      }
    }
    VQ_UNROLL
    for (int r = 0; r < REP; r++) s[r] += ksc[g] * part[r] + kbi[g] * qg[r * NG + g];
  }
  // online softmax: one simd max per query head and tile; denominators stay per lane
  float p[REP];
  VQ_UNROLL
  for (int r = 0; r < REP; r++) {
    const float sv = valid ? s[r] : VQ_NEG_INF;
    const float mn = fmax(m[r], vq_simd_max(sv));
    const float c = exp(m[r] - mn);
    p[r] = valid ? exp(sv - mn) : 0.0f;
    lsum[r] = lsum[r] * c + p[r];
    m[r] = mn; accb[r] *= c;
    VQ_UNROLL
    for (int k = 0; k < 16; k++) acc[r][k] *= c;
  }
  // values: token it*VTPI + vtok of the tile, channels vsub*16 .. vsub*16+15; its weight from the lane that scored it
  VQ_UNROLL
  for (int it = 0; it < VLPT; it++) {
    float ps[REP];
    VQ_UNROLL
    for (int r = 0; r < REP; r++) {
      const float pj = vq_simd_shuffle(p[r], it * VTPI + vtok);
      ps[r] = pj * vsc[it]; accb[r] += pj * vbi[it];
    }
    VQ_UNROLL
    for (int c = 0; c < 16; c++) {
      const float x = vq_as_float(((vr[it][c / VPW] >> ((c % VPW) * VBITS)) & VMASK) | MAGIC) - 8388608.0f;
      VQ_UNROLL
      for (int r = 0; r < REP; r++) acc[r][c] += ps[r] * x;
    }
  }
}
VQ_UNROLL
for (int r = 0; r < REP; r++) {
  const float lt = vq_simd_sum(lsum[r]);
  for (int o = VLPT; o < 32; o <<= 1) {
    accb[r] += vq_simd_shuffle_xor(accb[r], o);
    VQ_UNROLL
    for (int c = 0; c < 16; c++) acc[r][c] += vq_simd_shuffle_xor(acc[r][c], o);
  }
  if (vq_lane == 0) { wm[vq_warp * REP + r] = m[r]; wl[vq_warp * REP + r] = lt; }
  if (vtok == 0) {
    VQ_UNROLL
    for (int c = 0; c < 16; c++) wacc[(vq_warp * REP + r) * D + vsub * 16 + c] = acc[r][c] + accb[r];
  }
}
vq_barrier();
for (int i = vq_tid; i < REP * D; i += 32 * NW) {
  const int r = i / D;
  float M = VQ_NEG_INF;
  for (int w = 0; w < NW; w++) M = fmax(M, wm[w * REP + r]);
  float L = 0.0f, A = 0.0f;
  for (int w = 0; w < NW; w++) {
    const float e = M == VQ_NEG_INF ? 0.0f : exp(wm[w * REP + r] - M);   // an empty chunk: nothing
    L += wl[w * REP + r] * e; A += wacc[w * REP * D + i] * e;
  }
  const long row = (long)(bh * REP + r) * ns + chunk;
  out_acc[row * D + i % D] = A;
  if (i % D == 0) { out_m[row] = M; out_l[row] = L; }
}

}

} // namespace mlx::core::cu
