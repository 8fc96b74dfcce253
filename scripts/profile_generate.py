"""Where a B = 1 decode step's host time goes inside `mlx_lm.generate.generate_step` after a real prefill (random-weight
Llama-3.1-8B-shaped model, 2,048-token prefill chunks): tok/s over `steps` tokens after 16 untimed ones, then cProfile
over as many more (top functions by own time), for stock mlx-lm and each spec.

    python scripts/profile_generate.py OUT.txt --context 32768 --specs "stock;turboquant:key_bits=3,value_bits=3"
"""
import argparse, cProfile, io, pstats, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant import bench
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--specs", default="stock;turboquant:key_bits=3,value_bits=3"); ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--top", type=int, default=25)
a = ap.parse_args()
model, prompts, label = bench._generate_model(None, 32)
out = io.StringIO(); out.write(f"{label}, mlx {mx.__version__}, context {a.context}\n")
prompt = mx.array(prompts(a.context, 1)[0])
for spec in a.specs.split(";"):
    mx.clear_cache()
    caches = make_prompt_cache(model) if spec == bench.STOCK else KVCacheBuilder.for_model(model, parse_method(spec))
    gen = generate_step(prompt, model, max_tokens=16 + 2 * a.steps + 4, prompt_cache=caches, prefill_step_size=2048)
    for _ in range(16): next(gen)
    t0 = time.perf_counter()
    for _ in range(a.steps): next(gen)
    tps = a.steps / (time.perf_counter() - t0)
    pr = cProfile.Profile(); pr.enable(); t0 = time.perf_counter()
    for _ in range(a.steps): next(gen)
    t1 = time.perf_counter(); pr.disable()
    line = f"{spec}: {tps:.1f} tok/s; under cProfile {a.steps / (t1 - t0):.1f} tok/s"
    print(line, flush=True)
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
    out.write(f"## {line}\n" + s.getvalue() + "\n")
    del gen, caches
open(a.out, "w").write(out.getvalue())
