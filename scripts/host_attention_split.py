"""Host time (graph building, no evaluation) of one B = 1 decode layer split into the cache update and the attention call,
with MLX's `mx.fast.cuda_kernel` replaced by launches that cost nothing (they return cached zero arrays), beside stock
mlx-lm's KVCache update and SDPA call: the Python of veloxquant's GPU path alone, on a machine without a GPU. Medians of
1000 steps, µs; every 16 steps the outputs are evaluated, untimed.

    python scripts/host_attention_split.py "affine:key_bits=4,value_bits=4"
"""
import sys, time
import mlx.core as mx
mx.cuda.is_available = lambda: True
_C = {}
def _fake_cuda_kernel(**_):
    def f(**a):
        key = (tuple(map(tuple, a["output_shapes"])), tuple(a["output_dtypes"]))
        if key not in _C: _C[key] = [mx.zeros(s, d) for s, d in zip(*key)]
        return _C[key]
    return f
mx.fast.cuda_kernel = _fake_cuda_kernel
import veloxquant
from veloxquant import gpu
from veloxquant.core import parse_method
from veloxquant.attention import dispatch
from mlx_lm.models.cache import KVCache
from mlx_lm.models.base import scaled_dot_product_attention
import veloxquant.gpu_decode as gd
H, Hq, D, C = 8, 32, 128, 8192
q = mx.random.normal((1, Hq, 1, D)).astype(mx.float16); k1 = mx.random.normal((1, H, 1, D)).astype(mx.float16); mx.eval(q, k1)
fill = lambda: (mx.random.normal((1, H, C, D)).astype(mx.float16), mx.random.normal((1, H, C, D)).astype(mx.float16))
spec = sys.argv[1] if len(sys.argv) > 1 else "affine:key_bits=4,value_bits=4"
c = parse_method(spec).make_cache(); c.update_and_fetch(*fill()); c._flush(); mx.eval(c.state)
st = KVCache(); st.update_and_fetch(*fill()); mx.eval(st.keys, st.values)
for _ in range(200):
    kk, vv = c.update_and_fetch(k1, k1); mx.eval(dispatch(q, kk, vv, c, D ** -0.5, None))
# time pieces
T = {k: [] for k in ["uaf", "dispatch", "stock_uaf", "stock_sdpa"]}
outs = []
for r in range(1000):
    t0 = time.perf_counter(); kk, vv = c.update_and_fetch(k1, k1); t1 = time.perf_counter()
    o = dispatch(q, kk, vv, c, D ** -0.5, None); t2 = time.perf_counter()
    T["uaf"].append(t1 - t0); T["dispatch"].append(t2 - t1)
    t0 = time.perf_counter(); a, b = st.update_and_fetch(k1, k1); st.offset -= 1; t1 = time.perf_counter()
    o2 = scaled_dot_product_attention(q, a, b, st, D ** -0.5, None); t2 = time.perf_counter()
    T["stock_uaf"].append(t1 - t0); T["stock_sdpa"].append(t2 - t1)
    outs += [o, o2]
    if r % 16 == 15: mx.eval(outs, c.state); outs = []
names = {"uaf": spec + ": update_and_fetch", "dispatch": spec + ": attention call", "stock_uaf": "stock: update_and_fetch",
         "stock_sdpa": "stock: attention call (SDPA)"}
for k, v in T.items():
    v = sorted(v); print(f"{names[k]:60s} {v[len(v)//2]*1e6:6.1f} µs")
