"""Host (Python) time per B = 1 decode step on a GPU, by function: cProfile over `steps` synchronous decode steps of the
random-weight Llama-3.1-8B-shaped model per cache kind (caches filled with random K/V), the top functions by own time,
and the split of a step into graph building and evaluation (medians).

    python scripts/profile_host.py OUT.txt --context 32768 --specs "stock;turboquant:key_bits=3,value_bits=3"
"""
import argparse, cProfile, io, pstats, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant.bench import STOCK, _generate_model
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser()
ap.add_argument("out"); ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--specs", default="stock;turboquant:key_bits=3,value_bits=3;affine:key_bits=4,value_bits=4")
ap.add_argument("--steps", type=int, default=48); ap.add_argument("--top", type=int, default=30)
a = ap.parse_args()
model, _, label = _generate_model(None, 32)
out = io.StringIO()
for spec in a.specs.split(";"):
    caches = make_prompt_cache(model) if spec == STOCK else KVCacheBuilder.for_model(model, parse_method(spec))
    mx.random.seed(1)
    for c in caches:
        c.update_and_fetch(mx.random.normal((1, 8, a.context, 128)).astype(mx.float16),
                           mx.random.normal((1, 8, a.context, 128)).astype(mx.float16))
        if hasattr(c, "_flush"): c._flush()
        mx.eval(c.state)
    y = mx.array([[1]])
    for _ in range(8): mx.eval(model(y, cache=caches))
    build, ev = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter(); lg = model(y, cache=caches); t1 = time.perf_counter(); mx.eval(lg); t2 = time.perf_counter()
        build.append(t1 - t0); ev.append(t2 - t1)
    build.sort(); ev.sort()
    line = f"{spec}: build {build[len(build)//2]*1e3:.3f} ms, eval (sync) {ev[len(ev)//2]*1e3:.3f} ms per step"
    print(line, flush=True); out.write(line + "\n")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(a.steps): lg = model(y, cache=caches); mx.eval(lg)
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
    out.write(f"## {spec}\n" + s.getvalue() + "\n")
    del caches; mx.clear_cache()
open(a.out, "w").write(out.getvalue())
