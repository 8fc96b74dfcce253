"""End-to-end batch decode on a GPU: stock mlx-lm vs affine 4/4 and turboquant 3/3 (defaults) through `BatchGenerator`,
with the compressed batch cache's fused per-row decode (`VQBatchCache._attend_rows`) and, for comparison, with it off
(the blockwise reference with the padding mask, as before). Random Llama-3.1-8B-shaped model (fp16, 32 layers), B
prompts of equal length, 64 timed decode tokens after 8 untimed; prefill in steps of `--step` tokens (2,048 runs stock
out of memory at B = 8, 32k: its prefill scores with an array mask are not fused).

  python scripts/bench_batch.py OUT.json [--contexts 8192,32768] [--batch 8] [--step 512] [--reference-contexts 32768] [--warm-each 0] [--methods "stock;affine:key_bits=4,value_bits=4"]"""
import argparse, json, platform
from importlib.metadata import version
import mlx.core as mx
from veloxquant import bench
from veloxquant.batch import VQBatchCache

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("--contexts", default="8192,32768"); p.add_argument("--batch", type=int, default=8)
p.add_argument("--step", type=int, default=512); p.add_argument("--reference-contexts", default="32768")
p.add_argument("--methods", default="", help="method specs separated by ';' (default: stock, affine 4/4, turboquant 3/3); one spec per process keeps a failure (out of memory) from hiding the others")
p.add_argument("--warm-each", type=int, default=0, help="1: an untimed run of each shape before its timed run (twice the time and, at B = 8, 32k, more memory)")
a = p.parse_args()
methods = tuple(a.methods.split(";")) if a.methods else (bench.STOCK, "affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3")
ctxs = tuple(int(x) for x in a.contexts.split(","))
try:
    rows = bench.benchmark_generate(methods, contexts=ctxs, batches=(a.batch,), prefill_step_size=a.step, progress=False,
                                  warm_each=bool(a.warm_each))
except RuntimeError as e:  # out of memory: say how much MLX held (active, buffer cache, peak) before failing
    g = lambda f: f() / 1e9
    raise SystemExit(f"{methods}: {e}; MLX active {g(mx.get_active_memory):.1f} GB, cache {g(mx.get_cache_memory):.1f} GB, "
                     f"peak {g(mx.get_peak_memory):.1f} GB")
for r in rows: r["batch_decode"] = "fused per-row"
ref = tuple(int(x) for x in a.reference_contexts.split(",") if x)
if ref:
    VQBatchCache._attend_rows = lambda self, *args: None  # the reference path (blockwise, padding mask) for every step
    rr = bench.benchmark_generate(methods, contexts=ref, batches=(a.batch,), prefill_step_size=a.step, progress=False,
                                  warm_each=bool(a.warm_each))
    for r in rr: r["batch_decode"] = "blockwise reference"
    rows += rr
env = dict(device=str(mx.default_device()), mlx=version("mlx"), mlx_lm=version("mlx-lm"), host=platform.node())
json.dump([{**r, **env} for r in rows], open(a.out, "w"), indent=1, default=float)
for r in rows:
    print(f"{r['batch_decode']:20s} {r['method']:34s} ctx {r['context']:6d} B {r['batch']}: decode {r['decode_tps']:8.1f} tok/s "
          f"({r.get('decode_ratio', float('nan')):.2f}x)  prefill {r['prefill_tps']:8.0f} ({r.get('prefill_ratio', float('nan')):.2f}x)  "
          f"peak {r['peak_memory_gb']:.1f} GB (target {r.get('peak_target_gb', float('nan')):.1f})  KV {r['kv_bytes'] / 1e9:.2f} GB", flush=True)
