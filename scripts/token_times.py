"""Per-token decode intervals of `benchmark_generate`'s B = 1 protocol (shared warm-up of 2 tokens from a 4,160-token
prompt per spec, then prefill of `context` tokens in 2,048-token chunks and `decode` tokens through `generate_step`),
for stock mlx-lm and turboquant 3/3 on the random-weight Llama-3.1-8B-shaped model: where in the decode the time goes.

    python scripts/token_times.py OUT.json --context 32768 --decode 264
"""
import argparse, json, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant import bench
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--decode", type=int, default=264); ap.add_argument("--specs", default="stock;turboquant:key_bits=3,value_bits=3")
a = ap.parse_args()
model, prompts, label = bench._generate_model(None, 32)
specs = a.specs.split(";"); res = dict(model=label, mlx=mx.__version__, context=a.context, runs={})
for s in specs: bench._run_one(model, s, prompts(4160, 1), 2, 0, 2048)  # the shared warm-up
for s in specs:
    mx.clear_cache(); mx.reset_peak_memory()
    caches = make_prompt_cache(model) if s == bench.STOCK else KVCacheBuilder.for_model(model, parse_method(s))
    t = [time.perf_counter()]
    for _ in zip(range(a.decode), generate_step(mx.array(prompts(a.context, 1)[0]), model, max_tokens=a.decode, prompt_cache=caches, prefill_step_size=2048)):
        t.append(time.perf_counter())
    d = [(t[i + 1] - t[i]) * 1e3 for i in range(1, len(t) - 1)]
    res["runs"][s] = dict(prefill_s=t[1] - t[0], interval_ms=d)
    blocks = [round(sum(d[i:i + 32]) / len(d[i:i + 32]), 2) for i in range(0, len(d), 32)]
    print(s, "prefill s", round(t[1] - t[0], 2), "mean ms per 32-token block:", blocks, "max", round(max(d), 1), "at", d.index(max(d)), flush=True)
    del caches
json.dump(res, open(a.out, "w"), indent=1)
