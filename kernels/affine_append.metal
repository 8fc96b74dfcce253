// vq_affine_append: header

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

// vq_affine_append: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup, vq_warp = simdgroup_index_in_threadgroup;
const uint vq_tid = thread_position_in_threadgroup.x;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

// xk, xv: [N, D] new keys / values (any float dtype), N = B*Hkv*T tokens. Threadgroup: D threads on token
// vq_group_x of side vq_group_y (0 keys, 1 values). Out kw: [N, D*KBITS/32] uint32, ks, kb: [N, D/G] fp16; vw, vs, vb likewise.
constexpr int NG = D / G, KW = D * KBITS / 32, VW = D * VBITS / 32;
VQ_SHARED float gmin[D / 32], gmax[D / 32];
VQ_SHARED uint codes[D];
const int tok = vq_group_x, side = vq_group_y, d = vq_tid, g = d / G;
const int bits = side ? VBITS : KBITS;
const float x = vq_float(vq_cast(vq_half, vq_float(side ? xv[(long)tok * D + d] : xk[(long)tok * D + d])));
const float wmin = vq_simd_min(x), wmax = vq_simd_max(x);
if (vq_lane == 0) { gmin[vq_warp] = wmin; gmax[vq_warp] = wmax; }
vq_barrier();
float lo = gmin[g * (G / 32)], hi = gmax[g * (G / 32)];
for (int w = 1; w < G / 32; w++) { lo = fmin(lo, gmin[g * (G / 32) + w]); hi = fmax(hi, gmax[g * (G / 32) + w]); }
const float nb = float((1 << bits) - 1);
float sc = fmax((hi - lo) / nb, 1e-7f);
const bool neg = fabs(lo) > fabs(hi);
sc = neg ? sc : -sc;
const float edge = neg ? lo : hi;
const float q0 = round(edge / sc);
sc = q0 == 0.0f ? sc : edge / q0;
const float bias = q0 == 0.0f ? 0.0f : edge;
codes[d] = (uint)fmin(fmax(round((x - bias) / sc), 0.0f), nb);
if (d % G == 0) {
  if (side) { vs[(long)tok * NG + g] = vq_cast(vq_half, sc); vb[(long)tok * NG + g] = vq_cast(vq_half, bias); }
  else      { ks[(long)tok * NG + g] = vq_cast(vq_half, sc); kb[(long)tok * NG + g] = vq_cast(vq_half, bias); }
}
vq_barrier();
if (side) {
  for (int w = vq_tid; w < VW; w += D) {   // packed word w of the LSB-first bit stream of D codes of VBITS bits
    uint word = 0u;
    const int b0 = w * 32, i0 = b0 / VBITS, i1 = min(D, (b0 + 32 + VBITS - 1) / VBITS);
    for (int i = i0; i < i1; i++) { const int sh = i * VBITS - b0; word |= sh >= 0 ? (codes[i] << sh) : (codes[i] >> (-sh)); }
    vw[(long)tok * VW + w] = word;
  }
} else {
  for (int w = vq_tid; w < KW; w += D) {   // packed word w of the LSB-first bit stream of D codes of KBITS bits
    uint word = 0u;
    const int b0 = w * 32, i0 = b0 / KBITS, i1 = min(D, (b0 + 32 + KBITS - 1) / KBITS);
    for (int i = i0; i < i1; i++) { const int sh = i * KBITS - b0; word |= sh >= 0 ? (codes[i] << sh) : (codes[i] >> (-sh)); }
    kw[(long)tok * KW + w] = word;
  }
}
