// vq_decode_merge: header

#define VQ_SHARED threadgroup
#define vq_barrier() threadgroup_barrier(mem_flags::mem_threadgroup)
#define vq_simd_sum(x) simd_sum(x)
#define vq_simd_max(x) simd_max(x)
#define vq_simd_shuffle(x, i) simd_shuffle((x), (ushort)(i))
#define vq_popcount(x) popcount(x)
#define vq_float(x) float(x)
#define VQ_NEG_INF (-INFINITY)

// vq_decode_merge: body (MLX generates the [[kernel]] signature)
const uint vq_lane = thread_index_in_simdgroup;
const uint vq_group_x = threadgroup_position_in_grid.x, vq_group_y = threadgroup_position_in_grid.y;

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
