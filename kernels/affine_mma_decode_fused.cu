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

__global__ void vq_affine_mma_decode_fused(
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
    const __half* xq,
    const __half* ek,
    const __grid_constant__ Shape ek_shape,
    const __half* ev,
    const uint8_t* eref,
    const __grid_constant__ Shape eref_shape,
    const float* sinks,
    const float* rott,
    const uint32_t* cnt,
    float* out_m,
    float* out_l,
    float* out_acc,
    __half* out) {
  constexpr int D = 128;
  constexpr int G = 64;
  constexpr int REP = 4;
  constexpr int NW = 4;
  constexpr int U = 2;
  constexpr int EMU = 0;
  constexpr int PF = 1;
  constexpr int SCALE = 1035273459;
  constexpr int HS = 0;
  constexpr int ROT = 0;
  using OT = __half;
  constexpr int PR = 0;

const uint vq_lane = threadIdx.x % 32, vq_warp = threadIdx.x / 32, vq_tid = threadIdx.x;
const uint vq_group_x = blockIdx.x, vq_group_y = blockIdx.y;

// Tensor-core decode attention over 4-bit affine K/V (mx.quantize layout), one or two groups per head (D/G <= 2).
// q: [ROWS, D] (model dtype, unscaled), ROWS = BH*REP (REP <= 16/NG); kw, vw: [BH, CAP, D/8] uint32; ks, kb, vs, vb:
// [BH, CAP, D/G] fp16; nref, sref, SCALE as the scalar kernel. Out m (natural-log units), l: [ROWS, NS]; acc: [ROWS, NS, D].
// Per simdgroup step of 16*U tokens: S = Q K^T (m16n8k16, 8 tokens per product), online softmax on the fragments,
// O += P V (16 tokens per product; P re-read from the score fragments). Codes enter the products raw, as the fp16
// 1024 + c (low nibble) and 1024 + 16 c (high nibble) that one AND/OR makes of a packed word; the scales, biases,
// the 1024 offset and the 1/16 go on the other operand or on the float32 results. With two groups, MMA rows g and
// g + 8 hold the same query head restricted to group 0 and group 1 (the rows a decode step leaves empty).
#define VQ_MMA(c, a, b0, b1) do { if (EMU) vq_mma16816_emul(c, a, b0, b1, vq_lane); else vq_mma16816(c, a, b0, b1, vq_lane); } while (0)
constexpr int NG = D / G, WPT = D / 8, KS = D / 16, NT = D / 8, DPT = D / 8, VWT = DPT / 8, KWT = D / 32, NQ = 3 - NG;
constexpr uint MAGIC = 0x64006400u, LO = 0x000f000fu, HI = 0x00f000f0u;
VQ_SHARED float qs[REP * D];
VQ_SHARED float wm[NW * REP], wl[NW * REP];
VQ_SHARED float wacc[NW * REP * D];
const int n = nref_shape[0], cap = kw_shape[2], split = sref_shape[0];
const float scale = vq_as_float(SCALE) * 1.4426950408889634f;          // log2 units: exp2 below
const int bh = vq_group_y, chunk = vq_group_x, ns = (n + split - 1) / split;
const int cs = PR ? rr[3 * bh] : 0, ce = PR ? rr[3 * bh + 1] : n;
const int t0 = cs + chunk * split, t1 = min(ce, t0 + split);
for (int i = vq_tid; i < REP * D; i += 32 * NW) {   // fp16-rounded scaled query, odd channels / 16 (they meet 16 c)
  const float x = vq_float(q[(long)bh * REP * D + i]) * scale * ((i & 1) ? 0.0625f : 1.0f);
  qs[i] = vq_h2_float2(vq_bits_h2(vq_h2_pair(x, 0.0f))).x;
}
vq_barrier();
const int g = vq_lane / 4, t = vq_lane % 4;
// MMA row half r2 (rows g, g + 8): query head qh(r2) restricted to key group gh(r2)
const int qh0 = g, qh1 = NG == 2 ? g : g + 8;
const bool ok0 = qh0 < REP, ok1 = qh1 < REP;
const int kgr = 8 * KWT * t / G;
// A operand of S: k-step s = 2p + h holds channels 8(KWT t + p) + 2h + {0, 4} (regs 0, 1) and + {1, 5} (regs 2, 3)
uint qa[KS][4];
VQ_UNROLL
for (int s = 0; s < KS; s++) {
  const int d0 = 8 * (KWT * t + s / 2) + 2 * (s % 2);
  const bool u0 = ok0 && (NG == 1 || kgr == 0), u1 = ok1 && (NG == 1 || kgr == 1);
  qa[s][0] = u0 ? vq_bits_h2(vq_h2_pair(qs[qh0 * D + d0], qs[qh0 * D + d0 + 4])) : 0u;
  qa[s][1] = u1 ? vq_bits_h2(vq_h2_pair(qs[qh1 * D + d0], qs[qh1 * D + d0 + 4])) : 0u;
  qa[s][2] = u0 ? vq_bits_h2(vq_h2_pair(qs[qh0 * D + d0 + 1], qs[qh0 * D + d0 + 5])) : 0u;
  qa[s][3] = u1 ? vq_bits_h2(vq_h2_pair(qs[qh1 * D + d0 + 1], qs[qh1 * D + d0 + 5])) : 0u;
}
// per row half: offset 1024 * sum of its A values, and the plain channel sum (for the key biases)
float koff[2], qsum[2];
VQ_UNROLL
for (int r2 = 0; r2 < 2; r2++) {
  const int qh = r2 ? qh1 : qh0, gr = NG == 2 ? r2 : 0;
  float a = 0.0f, b = 0.0f;
  if (qh < REP)
    for (int d = gr * G; d < gr * G + G; d++) { const float x = qs[qh * D + d]; a += x; b += (d & 1) ? 16.0f * x : x; }
  koff[r2] = 1024.0f * a; qsum[r2] = b;
}
#define VQ_LOAD_TILE(TT, KR, KSR, KBR, VR, VSR, VBR) do { \
  VQ_UNROLL \
  for (int nt = 0; nt < 2 * U; nt++) { \
    const int tok = (TT) + 8 * nt + g; \
    const bool ok = tok < t1; \
    if (KWT == 4) { \
      uint4 u4 = {0u, 0u, 0u, 0u}; \
      if (ok) u4 = vq_load4(kw, (base + tok) * WPT + 4 * t); \
      KR[nt][0] = u4.x; KR[nt][1 % KWT] = u4.y; KR[nt][2 % KWT] = u4.z; KR[nt][3 % KWT] = u4.w; \
    } else { \
      uint2 u2 = {0u, 0u}; \
      if (ok) u2 = vq_load2(kw, (base + tok) * WPT + 2 * t); \
      KR[nt][0] = u2.x; KR[nt][1] = u2.y; \
    } \
    VQ_UNROLL \
    for (int e = 0; e < 2; e++) { \
      const int tk = (TT) + 8 * nt + 2 * t + e; \
      KSR[nt][e] = tk >= t1 ? 0u : NG == 2 ? vq_load1(ks, (base + tk) * 2) : vq_bits_h2(vq_h2_pair(vq_float(ks[base + tk]), 0.0f)); \
      KBR[nt][e] = tk >= t1 ? 0u : NG == 2 ? vq_load1(kb, (base + tk) * 2) : vq_bits_h2(vq_h2_pair(vq_float(kb[base + tk]), 0.0f)); \
    } \
  } \
  VQ_UNROLL \
  for (int e = 0; e < 4 * U; e++) { \
    const int tk = (TT) + 16 * (e / 4) + 2 * t + (e & 1) + 8 * ((e >> 1) & 1); \
    const bool ok = tk < t1; \
    if (VWT == 2) { \
      uint2 u2 = {0u, 0u}; \
      if (ok) u2 = vq_load2(vw, (base + tk) * WPT + 2 * g); \
      VR[e][0] = u2.x; VR[e][1 % VWT] = u2.y; \
    } else { \
      VR[e][0] = ok ? vw[(base + tk) * WPT + g] : 0u; \
    } \
    VSR[e] = !ok ? 0u : NG == 2 ? vq_load1(vs, (base + tk) * 2) : vq_bits_h2(vq_h2_pair(vq_float(vs[base + tk]), 0.0f)); \
    VBR[e] = !ok ? 0u : NG == 2 ? vq_load1(vb, (base + tk) * 2) : vq_bits_h2(vq_h2_pair(vq_float(vb[base + tk]), 0.0f)); \
  } \
} while (0)
const long base = (long)bh * cap;
float m2[NQ], lsum[NQ], ps[2], pb[2];
VQ_UNROLL
for (int r = 0; r < NQ; r++) { m2[r] = VQ_NEG_INF; lsum[r] = 0.0f; }
ps[0] = ps[1] = pb[0] = pb[1] = 0.0f;
float o[NT][4];
VQ_UNROLL
for (int j = 0; j < NT; j++) { o[j][0] = 0.0f; o[j][1] = 0.0f; o[j][2] = 0.0f; o[j][3] = 0.0f; }
uint nkr[2 * U][KWT], nksr[2 * U][2], nkbr[2 * U][2], nvr[4 * U][VWT], nvsr[4 * U], nvbr[4 * U];   // the next tile, in flight
{ const int tt = t0 + (int)vq_warp * 16 * U; VQ_LOAD_TILE(tt, nkr, nksr, nkbr, nvr, nvsr, nvbr); }
for (int tt = t0 + (int)vq_warp * 16 * U; tt < t1; tt += 16 * U * NW) {
  uint kr[2 * U][KWT], ksr[2 * U][2], kbr[2 * U][2], vr[4 * U][VWT], vsr[4 * U], vbr[4 * U];
  VQ_UNROLL
  for (int i = 0; i < 2 * U; i++) {
    ksr[i][0] = nksr[i][0]; ksr[i][1] = nksr[i][1]; kbr[i][0] = nkbr[i][0]; kbr[i][1] = nkbr[i][1];
    VQ_UNROLL
    for (int w = 0; w < KWT; w++) kr[i][w] = nkr[i][w];
  }
  VQ_UNROLL
  for (int i = 0; i < 4 * U; i++) {
    vsr[i] = nvsr[i]; vbr[i] = nvbr[i];
    VQ_UNROLL
    for (int w = 0; w < VWT; w++) vr[i][w] = nvr[i][w];
  }
  if (PF) { const int tn = tt + 16 * U * NW; VQ_LOAD_TILE(tn, nkr, nksr, nkbr, nvr, nvsr, nvbr); }
  else if (tt + 16 * U * NW < t1) { const int tn = tt + 16 * U * NW; VQ_LOAD_TILE(tn, nkr, nksr, nkbr, nvr, nvsr, nvbr); }
  // scores sc[nt][2 r + e]: query row r of this lane (qh0 or qh1), token tt + 8 nt + 2t + e
  float sc[2 * U][2 * NQ];
  VQ_UNROLL
  for (int nt = 0; nt < 2 * U; nt++) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    VQ_UNROLL
    for (int p = 0; p < KWT; p++) {
      const uint w = kr[nt][p], w8 = w >> 8;
      VQ_MMA(c, qa[2 * p], (w & LO) | MAGIC, (w & HI) | MAGIC);
      VQ_MMA(c, qa[2 * p + 1], (w8 & LO) | MAGIC, (w8 & HI) | MAGIC);
    }
    VQ_UNROLL
    for (int e = 0; e < 2; e++) {
      const bool live = tt + 8 * nt + 2 * t + e < t1;
      const float2 ksf = vq_h2_float2(ksr[nt][e]), kbf = vq_h2_float2(kbr[nt][e]);
      if (NG == 2) {
        sc[nt][e] = live ? ksf.x * (c[e] - koff[0]) + ksf.y * (c[2 + e] - koff[1]) + kbf.x * qsum[0] + kbf.y * qsum[1] : VQ_NEG_INF;
      } else {
        VQ_UNROLL
        for (int r = 0; r < NQ; r++)
          sc[nt][2 * r + e] = live ? ksf.x * (c[2 * r + e] - koff[r]) + kbf.x * qsum[r] : VQ_NEG_INF;
      }
    }
  }
  // online softmax per query row (a row's scores sit in the 4 lanes of its quad)
  float pv[2 * U][2 * NQ];
  VQ_UNROLL
  for (int r = 0; r < NQ; r++) {
    float mx_ = VQ_NEG_INF;
    VQ_UNROLL
    for (int nt = 0; nt < 2 * U; nt++) mx_ = fmax(mx_, fmax(sc[nt][2 * r], sc[nt][2 * r + 1]));
    mx_ = fmax(mx_, vq_simd_shuffle_xor(mx_, 1));
    mx_ = fmax(mx_, vq_simd_shuffle_xor(mx_, 2));
    const float mn = fmax(m2[r], mx_), corr = vq_exp2(m2[r] - mn);
    m2[r] = mn;
    float s_ = 0.0f;
    VQ_UNROLL
    for (int nt = 0; nt < 2 * U; nt++) {
      VQ_UNROLL
      for (int e = 0; e < 2; e++) { pv[nt][2 * r + e] = vq_exp2(sc[nt][2 * r + e] - mn); s_ += pv[nt][2 * r + e]; }
    }
    lsum[r] = lsum[r] * corr + s_;
    // the accumulators of the MMA row halves that belong to this query row
    VQ_UNROLL
    for (int r2 = 0; r2 < 2; r2++) {
      if (NG == 2 || r2 == r) {
        ps[r2] *= corr; pb[r2] *= corr;
        VQ_UNROLL
        for (int j = 0; j < NT; j++) { o[j][2 * r2] *= corr; o[j][2 * r2 + 1] *= corr; }
      }
    }
  }
  // values: A = P scaled per token (row half r2: its query row, its value group); B = raw codes of channels g*DPT + j
  VQ_UNROLL
  for (int u = 0; u < U; u++) {
    uint pa[4];
    VQ_UNROLL
    for (int hh = 0; hh < 2; hh++) {          // hh 0: tokens 2t, 2t+1 (n-tile 2u); hh 1: tokens 2t+8, 2t+9 (n-tile 2u+1)
      VQ_UNROLL
      for (int r2 = 0; r2 < 2; r2++) {
        const int r = NG == 2 ? 0 : r2, gr = NG == 2 ? r2 : 0, e0 = 4 * u + 2 * hh;
        const float pa0 = pv[2 * u + hh][2 * r], pa1 = pv[2 * u + hh][2 * r + 1];
        const float2 s0 = vq_h2_float2(vsr[e0]), s1 = vq_h2_float2(vsr[e0 + 1]);
        const float2 b0 = vq_h2_float2(vbr[e0]), b1 = vq_h2_float2(vbr[e0 + 1]);
        const uint h = vq_bits_h2(vq_h2_pair(pa0 * (gr ? s0.y : s0.x), pa1 * (gr ? s1.y : s1.x)));
        const float2 hf = vq_h2_float2(h);
        ps[r2] += hf.x + hf.y;
        pb[r2] += pa0 * (gr ? b0.y : b0.x) + pa1 * (gr ? b1.y : b1.x);
        pa[2 * hh + r2] = h;
      }
    }
    VQ_UNROLL
    for (int i = 0; i < VWT; i++) {
      VQ_UNROLL
      for (int b = 0; b < 4; b++) {
        const uint sel = (uint)(b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12));
        const uint xa = vq_byte_perm(vr[4 * u][i], vr[4 * u + 1][i], sel), xb = vq_byte_perm(vr[4 * u + 2][i], vr[4 * u + 3][i], sel);
        VQ_MMA(o[8 * i + 2 * b], pa, (xa & LO) | MAGIC, (xb & LO) | MAGIC);
        VQ_MMA(o[8 * i + 2 * b + 1], pa, (xa & HI) | MAGIC, (xb & HI) | MAGIC);
      }
    }
  }
}
// this simdgroup's state to threadgroup memory. Lane (g, t) holds channels (2t + e)*DPT + j of row halves g, g + 8.
VQ_UNROLL
for (int r2 = 0; r2 < 2; r2++) {
  ps[r2] += vq_simd_shuffle_xor(ps[r2], 1); ps[r2] += vq_simd_shuffle_xor(ps[r2], 2);
  pb[r2] += vq_simd_shuffle_xor(pb[r2], 1); pb[r2] += vq_simd_shuffle_xor(pb[r2], 2);
}
VQ_UNROLL
for (int r = 0; r < NQ; r++) {
  float l = lsum[r];
  l += vq_simd_shuffle_xor(l, 1);
  l += vq_simd_shuffle_xor(l, 2);
  const int row = r ? qh1 : qh0;
  if (row < REP) {
    if (t == 0) { wm[vq_warp * REP + row] = m2[r]; wl[vq_warp * REP + row] = l; }
    VQ_UNROLL
    for (int e = 0; e < 2; e++) {
      const int d0 = (2 * t + e) * DPT;
      const bool hi = NG == 2 ? d0 >= G : r == 1;           // row half g + 8 (no dynamic register indexing)
      const float off = 1024.0f * (hi ? ps[1] : ps[0]), add = hi ? pb[1] : pb[0];
      VQ_UNROLL
      for (int j = 0; j < NT; j++)
        wacc[(vq_warp * REP + row) * D + d0 + j] = ((hi ? o[j][2 + e] : o[j][e]) - off) * ((j & 1) ? 0.0625f : 1.0f) + add;
    }
  }
}
vq_barrier();
for (int i = vq_tid; i < REP * D; i += 32 * NW) {
  const int r = i / D;
  float M = VQ_NEG_INF;
  for (int w = 0; w < NW; w++) M = fmax(M, wm[w * REP + r]);
  float L = 0.0f, A = 0.0f;
  for (int w = 0; w < NW; w++) {
    const float e = M == VQ_NEG_INF ? 0.0f : vq_exp2(wm[w * REP + r] - M);   // an empty chunk: nothing
    L += wl[w * REP + r] * e; A += wacc[w * REP * D + i] * e;
  }
  const long row = (long)(bh * REP + r) * ns + chunk;
  out_acc[row * D + i % D] = A;
  if (i % D == 0) { out_m[row] = M * 0.6931471805599453f; out_l[row] = L; }
}

// One dispatch for a whole decode step, appended after a chunk tail: the last threadgroup of this (batch, kv head) bh
// to write its partials merges all NS chunks of its REP rows with the E = eref_shape[0] exact tokens of ek / ev
// [BH, ECAP, D] (scored with the unrotated queries xq [ROWS, D], model dtype), the sink logits [ROWS] (HS) and, with
// ROT, the value rotation: the chunks' acc are then rotated (p·(v R)) and rott [D, D] float32 holds Rᵀ row-major.
// cnt [BH] uint32 (an input the kernel writes) is zero before and after: the last threadgroup resets it.
// out: [ROWS, D] in OT. The partials are read back past L1 (vq_ld_cg) after a device-scope fence.
VQ_SHARED int f_last[1];
VQ_SHARED float f_rot[ROT ? NW * D : 1];
vq_device_fence();
vq_barrier();
if (vq_tid == 0) f_last[0] = vq_atomic_inc(cnt + bh) == (uint)(ns - 1);
vq_barrier();
if (f_last[0]) {
  vq_device_fence();
  constexpr int FDPL = D / 32;
  const int f_E = eref_shape[0], f_cap = ek_shape[2];
  const float f_sc = vq_as_float(SCALE);
  for (int r = vq_warp; r < REP; r += NW) {   // one simdgroup per query row; lanes own D/32 channels
    const long qrow = (long)bh * REP + r;
    float qv[FDPL], ax[FDPL], ac[FDPL];
    VQ_UNROLL
    for (int k = 0; k < FDPL; k++) { qv[k] = vq_float(xq[qrow * D + vq_lane * FDPL + k]) * f_sc; ax[k] = 0.0f; ac[k] = 0.0f; }
    float M = HS ? sinks[qrow] : VQ_NEG_INF;
    for (int c = vq_lane; c < ns; c += 32) M = fmax(M, vq_ld_cg(out_m + qrow * ns + c));
    M = vq_simd_max(M);
    float L = 0.0f;
    for (int c = 0; c < ns; c++) {
      const float w = exp(vq_ld_cg(out_m + qrow * ns + c) - M);
      L += vq_ld_cg(out_l + qrow * ns + c) * w;
      VQ_UNROLL
      for (int k = 0; k < FDPL; k++) ac[k] += vq_ld_cg(out_acc + (qrow * ns + c) * D + vq_lane * FDPL + k) * w;
    }
    for (int e = 0; e < f_E; e++) {                // the exact tokens, with a running maximum (one pass)
      const long o_ = ((long)bh * f_cap + e) * D + vq_lane * FDPL;
      float s = 0.0f;
      VQ_UNROLL
      for (int k = 0; k < FDPL; k++) s += qv[k] * vq_float(ek[o_ + k]);
      s = vq_simd_sum(s);
      if (s > M) {
        const float c = exp(M - s);
        L *= c;
        VQ_UNROLL
        for (int k = 0; k < FDPL; k++) { ax[k] *= c; ac[k] *= c; }
        M = s;
      }
      const float w = exp(s - M);
      L += w;
      VQ_UNROLL
      for (int k = 0; k < FDPL; k++) ax[k] += w * vq_float(ev[o_ + k]);
    }
    if (HS) L += exp(sinks[qrow] - M);
    const float inv = 1.0f / L;
    if (ROT) {
      VQ_UNROLL
      for (int k = 0; k < FDPL; k++) f_rot[vq_warp * D + vq_lane * FDPL + k] = ac[k];
      vq_simd_sync();
      for (int j = 0; j < D; j++) {
        const float x = f_rot[vq_warp * D + j];
        VQ_UNROLL
        for (int k = 0; k < FDPL; k++) ax[k] += x * rott[(long)j * D + vq_lane * FDPL + k];
      }
      vq_simd_sync();
      VQ_UNROLL
      for (int k = 0; k < FDPL; k++) out[qrow * D + vq_lane * FDPL + k] = vq_cast(OT, ax[k] * inv);
    } else {
      VQ_UNROLL
      for (int k = 0; k < FDPL; k++) out[qrow * D + vq_lane * FDPL + k] = vq_cast(OT, (ac[k] + ax[k]) * inv);
    }
  }
  if (vq_tid == 0) vq_atomic_zero(cnt + bh);
}

}

} // namespace mlx::core::cu
