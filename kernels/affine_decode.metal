// vq_affine_decode: header

#define VQ_SHARED threadgroup
#define vq_barrier() threadgroup_barrier(mem_flags::mem_threadgroup)
#define vq_simd_sum(x) simd_sum(x)
#define vq_simd_max(x) simd_max(x)
#define vq_simd_shuffle(x, i) simd_shuffle((x), (ushort)(i))
#define vq_popcount(x) popcount(x)
#define vq_float(x) float(x)
#define VQ_NEG_INF (-INFINITY)

// vq_affine_decode: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

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
