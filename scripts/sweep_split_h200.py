"""Decode attention of one layer through the cache (bench.benchmark_layer: update_and_fetch + mlx-lm's attention, each
step evaluated on its own) at S = 32k, B = 1 and 8, for affine 4/4 and turboquant 3/3 with the tensor-core decode
kernels aiming at several threadgroup counts per dispatch (gpu.MMA_TARGET_GROUPS: the chunk size, now a runtime input,
follows from it), beside stock mlx-lm's KVCache and mx.fast.scaled_dot_product_attention alone over fp16 K/V.

  python scripts/sweep_split_h200.py OUT.json [--targets 264,528,1056,2112,4224]"""
import argparse, json, time, platform
from importlib.metadata import version
import mlx.core as mx
import veloxquant.gpu as gpu
import veloxquant.methods.affine as affine
import veloxquant.methods.turboquant as turboquant
from veloxquant import bench

p = argparse.ArgumentParser(); p.add_argument("out"); p.add_argument("--targets", default="264,528,1056,2112,4224")
p.add_argument("--S", type=int, default=32768)
a = p.parse_args()
S, rows = a.S, []
for B in (1, 8):  # fp16 SDPA alone, the reference: median of 12 evaluated calls
    q = mx.random.normal((B, 32, 1, 128)).astype(mx.float16)
    k, v = (mx.random.normal((B, 8, S, 128)).astype(mx.float16) for _ in range(2)); mx.eval(q, k, v)
    ts = []
    for i in range(15):
        t0 = time.perf_counter(); mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5)); ts.append(time.perf_counter() - t0)
    ts = sorted(ts[3:]); rows.append(dict(method="mx.fast.sdpa fp16", S=S, B=B, us=1e6 * ts[len(ts) // 2], target=None))
    del k, v
rows += [dict(r, target=None) for r in bench.benchmark_layer(methods=(bench.STOCK,), seq_lens=(S,), batches=(1, 8), progress=False, prefill_attention=False)]
for t in (int(x) for x in a.targets.split(",")):
    gpu.MMA_TARGET_GROUPS = affine.MMA_TARGET_GROUPS = turboquant.MMA_TARGET_GROUPS = t
    for r in bench.benchmark_layer(methods=("affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3"),
                                   seq_lens=(S,), batches=(1, 8), progress=False, prefill_attention=False):
        r["target"] = t; rows.append(r)
    print("target", t, "done", flush=True)
sd = {r["B"]: r["us"] for r in rows if r["method"] == "mx.fast.sdpa fp16"}
st = {r["B"]: r["us"] for r in rows if r["method"] == bench.STOCK}
for r in rows: r["vs_sdpa"], r["vs_stock"] = sd[r["B"]] / r["us"], st[r["B"]] / r["us"]
env = dict(device=str(mx.default_device()), mlx=version("mlx"), mlx_lm=version("mlx-lm"), host=platform.node())
json.dump([{**r, **env} for r in rows], open(a.out, "w"), indent=1, default=float)
print("| method | target groups | B | µs per layer step | × fp16 SDPA | × stock cache |"); print("|---|---|---|---|---|---|")
for r in rows: print(f"| {r['method']} | {r['target'] or '–'} | {r['B']} | {r['us']:.0f} | {r['vs_sdpa']:.2f} | {r['vs_stock']:.2f} |")
