"""Host cost of one custom-kernel launch on a GPU back-end, split into the Python call that builds the graph node
(`mx.fast.cuda_kernel(...)(...)`: MLX writes the kernel's source with the template per call) and the enqueue
(`mx.async_eval`: the primitive's launch), for turboquant's decode body and a tiny body, beside fp16 SDPA and an add;
the same kernel call replayed through `mx.compile`; then one B = 1 decode layer (update_and_fetch + mlx-lm's attention,
8k tokens) of stock mlx-lm's KVCache, affine 4/4 and turboquant 3/3, the same split. µs per call, medians of `--reps`.

    python scripts/launch_host_cost.py OUT.json
"""
import argparse, json, time
import mlx.core as mx
import veloxquant
from veloxquant import gpu
from veloxquant.methods import turboquant as tq

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--reps", type=int, default=400)
a = ap.parse_args()
res = dict(device=str(mx.default_device()), mlx=mx.__version__, us={})

def med(xs): xs = sorted(xs); return xs[len(xs) // 2] * 1e6
def split(fn, name, reps=a.reps):
    try: mx.eval(fn())
    except Exception as ex:  # e.g. a custom kernel under mx.compile: recorded, the other rows still run
        res["us"][name] = dict(error=f"{type(ex).__name__}: {ex}"[:300]); print(name, "failed:", res["us"][name]["error"], flush=True)
        json.dump(res, open(a.out, "w"), indent=1); return
    b, e = [], []
    for _ in range(reps):
        t0 = time.perf_counter(); o = fn(); t1 = time.perf_counter(); mx.async_eval(o); t2 = time.perf_counter()
        b.append(t1 - t0); e.append(t2 - t1); mx.eval(o)
    res["us"][name] = dict(build=med(b), enqueue=med(e)); print(f"{name:40s} build {med(b):7.1f} µs  enqueue {med(e):7.1f} µs", flush=True)
    json.dump(res, open(a.out, "w"), indent=1)

n, S = 4096, 8192
q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16); K = mx.random.normal((1, 8, S, 128)).astype(mx.float16)
split(lambda: mx.fast.scaled_dot_product_attention(q, K, K, scale=0.088), "fp16 SDPA 8k")
x = mx.zeros((4, 4)); split(lambda: x + 1, "add")
ins = [mx.zeros((32, 128), mx.float16), mx.zeros((1, 8, n, 12), mx.uint32), mx.zeros((1, 8, n, 1), mx.float16), mx.zeros((1, 8, n, 12), mx.uint32),
       mx.zeros((1, 8, n, 1), mx.float16), mx.zeros((64,), mx.uint32), mx.zeros((64,), mx.uint32), mx.eye(128), mx.zeros((n,), mx.uint8),
       mx.zeros((512,), mx.uint8), mx.zeros((1, 3), mx.int32)]
mx.eval(ins)
tmpl = [("D", 128), ("KB", 3), ("VB", 3), ("REP", 4), ("NW", 4), ("U", 2), ("EMU", 0), ("LC", 1), ("HAD", 0), ("SCALE", gpu._float_bits(0.088)), ("PR", 0)]
kw = dict(template=tmpl, grid=(128 * 8, 8, 1), threadgroup=(128, 1, 1), output_shapes=[(32, 8), (32, 8), (32, 8, 128)], output_dtypes=[mx.float32] * 3)
big = mx.fast.cuda_kernel(name="vq_tq_probe", input_names=list(tq.TQ_DECODE_INPUTS), output_names=list(gpu.DECODE_PARTIAL_OUTPUTS),
                          source=gpu.PROLOGUE_CUDA + tq.TQ_MMA_DECODE_BODY, header=gpu.COMPAT_CUDA)
res["source_chars"] = len(gpu.PROLOGUE_CUDA + tq.TQ_MMA_DECODE_BODY) + len(gpu.COMPAT_CUDA)
split(lambda: big(inputs=ins, **kw)[2], "tq decode kernel (direct call)")
tiny = mx.fast.cuda_kernel(name="vq_tiny_probe", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
t1 = mx.zeros((1,)); split(lambda: tiny(inputs=[t1], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0], "tiny kernel")
cb = mx.compile(lambda *i: big(inputs=list(i), **kw)[2])
split(lambda: cb(*ins), "tq decode kernel via mx.compile")
ct = mx.compile(lambda a_: tiny(inputs=[a_], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
split(lambda: ct(t1), "tiny kernel via mx.compile")
two = mx.compile(lambda a_: tiny(inputs=[tiny(inputs=[a_], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0]],
                                 grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
split(lambda: two(t1), "two tiny kernels via mx.compile")

import mlx_lm.models.base as mlx_lm_base  # its attention looked up at each call: veloxquant's dispatcher replaces it there
from mlx_lm.models.cache import KVCache
from veloxquant.core import parse_method
k1 = mx.random.normal((1, 8, 1, 128)).astype(mx.float16); mx.eval(k1)
for spec in ("stock", "affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3"):
    c = KVCache() if spec == "stock" else parse_method(spec).make_cache()
    c.update_and_fetch(K, K); mx.eval(K)
    if hasattr(c, "_flush"): c._flush()
    def layer(c=c):
        kk, vv = c.update_and_fetch(k1, k1)
        return mlx_lm_base.scaled_dot_product_attention(q, kk, vv, cache=c, scale=0.088, mask=None)
    for _ in range(40): mx.eval(layer())
    split(layer, f"decode layer {spec.split(':')[0]}", reps=min(a.reps, 300))
