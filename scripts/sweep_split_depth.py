"""The tensor-core decode kernels' threadgroup target (gpu.MMA_TARGET_GROUPS; the chunk size follows from it) swept
through one layer's decode step queued as a model's forward (bench.benchmark_layer with `layers` caches per step,
mx.async_eval per step, one wait: µs per layer), affine 4/4 and turboquant 3/3 beside stock mlx-lm's KVCache.

  python scripts/sweep_split_depth.py OUT.json [--targets 264,528,1056,2112] [--S 32768] [--B 1] [--layers 32]"""
import argparse, json
import mlx.core as mx
import veloxquant.gpu as gpu
import veloxquant.methods.affine as affine
import veloxquant.methods.turboquant as turboquant
from veloxquant import bench

p = argparse.ArgumentParser(); p.add_argument("out"); p.add_argument("--targets", default="264,528,1056,2112")
p.add_argument("--S", type=int, default=32768); p.add_argument("--B", type=int, default=1); p.add_argument("--layers", type=int, default=32)
a = p.parse_args()
kw = dict(seq_lens=(a.S,), batches=(a.B,), progress=False, prefill_attention=False, layers=a.layers)
rows = [dict(r, target=None) for r in bench.benchmark_layer(methods=(bench.STOCK,), **kw)]
print(rows[-1], flush=True)
for t in (int(x) for x in a.targets.split(",")):
    gpu.MMA_TARGET_GROUPS = affine.MMA_TARGET_GROUPS = turboquant.MMA_TARGET_GROUPS = t
    for r in bench.benchmark_layer(methods=("affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3"), **kw):
        r = dict(r, target=t, ratio=rows[0]["us"] / r["us"]); rows.append(r)
        print(f"target {t} {r['method'][:24]} {r['us']:.1f} µs/layer  x{r['ratio']:.2f} vs stock {rows[0]['us']:.1f}", flush=True)
    json.dump(dict(device=str(mx.default_device()), mlx=mx.__version__, rows=rows), open(a.out, "w"), indent=1)
