// vq_tq_mma_decode: header

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

// vq_tq_mma_decode: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup, vq_warp = simdgroup_index_in_threadgroup;
const uint vq_tid = thread_position_in_threadgroup.x;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

// Tensor-core decode attention over TurboQuant MSE codes (one Lloyd-Max codebook per side, KB / VB bits per
// coordinate packed LSB-first, fp16 norm per token; Zandieh et al. 2025, arXiv 2504.19874, Alg. 1). The scores are
// taken in the rotated domain, <q, k> = |k| <q R, c[codes]>, and the values summed there (the caller rotates back).
// q: [ROWS, D] queries (any float dtype, unscaled, not rotated: the threadgroup rotates them with qrot = R [D, D]
// float32, row-major), ROWS = BH*REP, REP <= 16; kc: [BH, CAP, ceil(D KB/32)]
// uint32, kn: [BH, CAP, 1] fp16; vc, vn likewise; klut: [2^(2 KB)] uint32, entry x | y << KB = the fp16 pair
// (c[x], c[y]) of the key codebook (vlut likewise): one threadgroup-memory read turns two codes into an MMA operand
// register. The tables are held KLR / VLR times in threadgroup memory, copy j read by the lanes j mod KLR, so that
// the 32 lanes' reads of random codes fall in different banks (one table shared by all lanes: a 64-entry table read at
// random indices costs several bank-conflict wavefronts per read). Template LC (a power of 2, 1-32) caps the copies. nref: shape [n]; sref: shape [split] (tokens per chunk, at run time). Template SCALE, NW, U, EMU as the affine kernel. Out m (natural log), l, acc.
#define VQ_MMA(c, a, b0, b1) do { if (EMU) vq_mma16816_emul(c, a, b0, b1, vq_lane); else vq_mma16816(c, a, b0, b1, vq_lane); } while (0)
constexpr int KW = (D * KB + 31) / 32, VW = (D * VB + 31) / 32, KS = D / 16, NT = D / 8, DPT = D / 8, CPT = D / 4;
constexpr int KSH = (CPT * KB) % 32 != 0, VSH = (DPT * VB) % 32 != 0;          // windows that may start mid-word
constexpr int KL = (CPT * KB + 31) / 32 + KSH, VL = (DPT * VB + 31) / 32 + VSH;  // words loaded per lane and token
VQ_SHARED float qs[REP * D];
constexpr int LB = REP <= 4 ? 8192 : REP <= 8 ? 4096 : 1024;                  // bytes per side for the table copies
#define VQ_TQ_COPIES(B) ((4 << (2 * (B))) * 32 <= LB ? 32 : (4 << (2 * (B))) * 8 <= LB ? 8 : (4 << (2 * (B))) * 2 <= LB ? 2 : 1)
constexpr int KLR = VQ_TQ_COPIES(KB) < LC ? VQ_TQ_COPIES(KB) : LC, VLR = VQ_TQ_COPIES(VB) < LC ? VQ_TQ_COPIES(VB) : LC;
VQ_SHARED uint lk[(1 << (2 * KB)) * KLR], lv[(1 << (2 * VB)) * VLR];
VQ_SHARED float wm[NW * REP], wl[NW * REP];
VQ_SHARED float wacc[NW * REP * D];
const int n = nref_shape[0], cap = kc_shape[2], split = sref_shape[0];
const float scale = vq_as_float(SCALE) * 1.4426950408889634f;          // log2 units: exp2 below
const int bh = vq_group_y, chunk = vq_group_x, ns = (n + split - 1) / split;
const int cs = PR ? rr[3 * bh] : 0, ce = PR ? rr[3 * bh + 1] : n;
const int t0 = cs + chunk * split, t1 = min(ce, t0 + split);
for (int i = vq_tid; i < REP * D; i += 32 * NW)  // q (HAD: q ⊙ s, s_j = sign R[j][0]), then q R below
  wacc[i] = HAD && qrot[(long)(i % D) * D] < 0.0f ? -vq_float(q[(long)bh * REP * D + i]) : vq_float(q[(long)bh * REP * D + i]);
vq_barrier();
if (HAD) {  // R = diag(s) H / sqrt(D) (quant.randomized_hadamard): q R = FWHT(q ⊙ s) / sqrt(D), log2 D butterfly stages in shared memory
  for (int h = 1; h < D; h <<= 1) {
    for (int p = vq_tid; p < REP * D / 2; p += 32 * NW) {
      const int r = p / (D / 2), j = p % (D / 2), i = r * D + (j / h) * 2 * h + j % h;
      const float a = wacc[i], b = wacc[i + h];
      wacc[i] = a + b; wacc[i + h] = a - b;
    }
    vq_barrier();
  }
  constexpr float HN = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : D == 256 ? 0.0625f : 0.0f;
  static_assert(!HAD || HN > 0.0f, "HAD = 1 needs head_dim 64, 128 or 256");
  for (int i = vq_tid; i < REP * D; i += 32 * NW) qs[i] = wacc[i] * (HN * scale);
} else
for (int d = vq_tid; d < D; d += 32 * NW) {  // qs = scale (q R), one launch less per step than rotating outside: a thread
  float a[REP];                                // per channel d, all REP rows; 32 loads of R's column in flight at a time
  VQ_UNROLL
  for (int r = 0; r < REP; r++) a[r] = 0.0f;
  for (int j0 = 0; j0 < D; j0 += 32) {
    float R[32];
    VQ_UNROLL
    for (int i = 0; i < 32; i++) R[i] = qrot[(long)(j0 + i) * D + d];
    VQ_UNROLL
    for (int i = 0; i < 32; i++) {
      VQ_UNROLL
      for (int r = 0; r < REP; r++) a[r] += wacc[r * D + j0 + i] * R[i];
    }
  }
  VQ_UNROLL
  for (int r = 0; r < REP; r++) qs[r * D + d] = a[r] * scale;
}
for (int i = vq_tid; i < (1 << (2 * KB)) * KLR; i += 32 * NW) lk[i] = klut[i / KLR];   // entry e, copy j at e KLR + j
for (int i = vq_tid; i < (1 << (2 * VB)) * VLR; i += 32 * NW) lv[i] = vlut[i / VLR];
vq_barrier();
const int g = vq_lane / 4, t = vq_lane % 4;
const bool ok0 = g < REP, ok1 = g + 8 < REP;
const uint klo = vq_lane & (KLR - 1), vlo = vq_lane & (VLR - 1);   // this lane's copies of the tables
// A operand of S: lane t owns channels CPT t .. CPT t + CPT - 1; k-step s: channels CPT t + 4s + {0, 1} (regs 0, 1)
// and + {2, 3} (regs 2, 3), matching the code pairs (4s, 4s+1), (4s+2, 4s+3) of its window
uint qa[KS][4];
VQ_UNROLL
for (int s = 0; s < KS; s++) {
  const int c0 = CPT * t + 4 * s;
  qa[s][0] = ok0 ? vq_bits_h2(vq_h2_pair(qs[g * D + c0], qs[g * D + c0 + 1])) : 0u;
  qa[s][1] = ok1 ? vq_bits_h2(vq_h2_pair(qs[(g + 8) * D + c0], qs[(g + 8) * D + c0 + 1])) : 0u;
  qa[s][2] = ok0 ? vq_bits_h2(vq_h2_pair(qs[g * D + c0 + 2], qs[g * D + c0 + 3])) : 0u;
  qa[s][3] = ok1 ? vq_bits_h2(vq_h2_pair(qs[(g + 8) * D + c0 + 2], qs[(g + 8) * D + c0 + 3])) : 0u;
}
const long base = (long)bh * cap;
const int kbit = CPT * KB * t, vbit = DPT * VB * g;                     // this lane's window in a token's bit stream
const int kw0 = kbit >> 5, ksh = kbit & 31, vw0 = vbit >> 5, vsh = vbit & 31;
#define VQ_TQ_LOAD_TILE(TT, KR, KN, VR, VN) do { \
  VQ_UNROLL \
  for (int nt = 0; nt < 2 * U; nt++) { \
    const int tok = (TT) + 8 * nt + g; \
    VQ_UNROLL \
    for (int i = 0; i < KL; i++) KR[nt][i] = tok < t1 && kw0 + i < KW ? kc[(base + tok) * KW + kw0 + i] : 0u; \
    VQ_UNROLL \
    for (int e = 0; e < 2; e++) { const int tk = (TT) + 8 * nt + 2 * t + e; KN[nt][e] = tk < t1 ? vq_float(kn[base + tk]) : 0.0f; } \
  } \
  VQ_UNROLL \
  for (int e = 0; e < 4 * U; e++) { \
    const int tk = (TT) + 16 * (e / 4) + 2 * t + (e & 1) + 8 * ((e >> 1) & 1); \
    VQ_UNROLL \
    for (int i = 0; i < VL; i++) VR[e][i] = tk < t1 && vw0 + i < VW ? vc[(base + tk) * VW + vw0 + i] : 0u; \
    VN[e] = tk < t1 ? vq_float(vn[base + tk]) : 0.0f; \
  } \
} while (0)
float m2[2] = {VQ_NEG_INF, VQ_NEG_INF}, lsum[2] = {0.0f, 0.0f};
float o[NT][4];
VQ_UNROLL
for (int j = 0; j < NT; j++) { o[j][0] = 0.0f; o[j][1] = 0.0f; o[j][2] = 0.0f; o[j][3] = 0.0f; }
uint nkr[2 * U][KL], nvr[4 * U][VL];      // the next tile, in flight while this one is computed
float nkn[2 * U][2], nvn[4 * U];
{ const int tt = t0 + (int)vq_warp * 16 * U; VQ_TQ_LOAD_TILE(tt, nkr, nkn, nvr, nvn); }
for (int tt = t0 + (int)vq_warp * 16 * U; tt < t1; tt += 16 * U * NW) {
  uint kr[2 * U][KL + 1], vr[4 * U][VL + 1];
  float kn_[2 * U][2], vn_[4 * U];
  VQ_UNROLL
  for (int i = 0; i < 2 * U; i++) {
    kn_[i][0] = nkn[i][0]; kn_[i][1] = nkn[i][1];
    VQ_UNROLL
    for (int w = 0; w < KL; w++) kr[i][w] = KSH ? (nkr[i][w] >> ksh) | (ksh && w + 1 < KL ? nkr[i][w + 1] << (32 - ksh) : 0u) : nkr[i][w];
    kr[i][KL] = 0u;
  }
  VQ_UNROLL
  for (int i = 0; i < 4 * U; i++) {
    vn_[i] = nvn[i];
    VQ_UNROLL
    for (int w = 0; w < VL; w++) vr[i][w] = VSH ? (nvr[i][w] >> vsh) | (vsh && w + 1 < VL ? nvr[i][w + 1] << (32 - vsh) : 0u) : nvr[i][w];
    vr[i][VL] = 0u;
  }
  { const int tn = tt + 16 * U * NW; VQ_TQ_LOAD_TILE(tn, nkr, nkn, nvr, nvn); }
  // scores: c0, c1 = row g, tokens 2t, 2t+1 of the 8; c2, c3 = row g + 8
  float sc[2 * U][4];
  VQ_UNROLL
  for (int nt = 0; nt < 2 * U; nt++) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    VQ_UNROLL
    for (int s = 0; s < KS; s++) {
      const uint b0 = lk[vq_code(kr[nt], (4 * s) * KB, 2 * KB) * KLR + klo];      // codes 4s, 4s+1: adjacent, one field
      const uint b1 = lk[vq_code(kr[nt], (4 * s + 2) * KB, 2 * KB) * KLR + klo];
      VQ_MMA(c, qa[s], b0, b1);
    }
    VQ_UNROLL
    for (int j = 0; j < 4; j++) sc[nt][j] = tt + 8 * nt + 2 * t + (j & 1) < t1 ? c[j] * kn_[nt][j & 1] : VQ_NEG_INF;
  }
  float pv[2 * U][4];
  VQ_UNROLL
  for (int r = 0; r < 2; r++) {
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
    VQ_UNROLL
    for (int j = 0; j < NT; j++) { o[j][2 * r] *= corr; o[j][2 * r + 1] *= corr; }
  }
  // values: A = P times the value norms; B = codebook pairs (token 2t | 2t+1, 2t+8 | 2t+9) of channel g*DPT + j
  VQ_UNROLL
  for (int u = 0; u < U; u++) {
    const uint pa[4] = {vq_bits_h2(vq_h2_pair(pv[2 * u][0] * vn_[4 * u], pv[2 * u][1] * vn_[4 * u + 1])),
                        vq_bits_h2(vq_h2_pair(pv[2 * u][2] * vn_[4 * u], pv[2 * u][3] * vn_[4 * u + 1])),
                        vq_bits_h2(vq_h2_pair(pv[2 * u + 1][0] * vn_[4 * u + 2], pv[2 * u + 1][1] * vn_[4 * u + 3])),
                        vq_bits_h2(vq_h2_pair(pv[2 * u + 1][2] * vn_[4 * u + 2], pv[2 * u + 1][3] * vn_[4 * u + 3]))};
    VQ_UNROLL
    for (int j = 0; j < NT; j++) {
      const uint b0 = lv[(vq_code(vr[4 * u], j * VB, VB) | (vq_code(vr[4 * u + 1], j * VB, VB) << VB)) * VLR + vlo];
      const uint b1 = lv[(vq_code(vr[4 * u + 2], j * VB, VB) | (vq_code(vr[4 * u + 3], j * VB, VB) << VB)) * VLR + vlo];
      VQ_MMA(o[j], pa, b0, b1);
    }
  }
}
VQ_UNROLL
for (int r = 0; r < 2; r++) {
  float l = lsum[r];
  l += vq_simd_shuffle_xor(l, 1);
  l += vq_simd_shuffle_xor(l, 2);
  const int row = g + 8 * r;
  if (row < REP) {
    if (t == 0) { wm[vq_warp * REP + row] = m2[r]; wl[vq_warp * REP + row] = l; }
    VQ_UNROLL
    for (int e = 0; e < 2; e++) {
      VQ_UNROLL
      for (int j = 0; j < NT; j++) wacc[(vq_warp * REP + row) * D + (2 * t + e) * DPT + j] = o[j][2 * r + e];
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
