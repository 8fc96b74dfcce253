"""Why is turboquant's B = 1 decode slower after `benchmark_generate`'s shared warm-up? (H200, session 12: 155.8 tok/s in a
fresh process through `generate_step`, 0.99x stock; ~96 tok/s, 0.61x, after a 4,160-token warm-up run in the same
process.) One process, `generate_step` at `context` tokens, decode tok/s over 64 tokens after 16:
  1. fresh;  2. after a warm-up run (4,160-token prompt, 2 decode tokens) as `benchmark_generate` makes;
  3. again, after clearing veloxquant's module-level caches one group at a time (compiled decode_as, rotation copies,
     length views, compiled decode/tile functions), to see which state carries the slowdown;
and `gpu.FAILED` (kernels disabled by the safety net) after each.

    python scripts/warmup_bisect.py OUT.json --context 32768
"""
import argparse, json, time, warnings
import mlx.core as mx
import veloxquant  # noqa: F401
import veloxquant.gpu as gpu, veloxquant.gpu_decode as gd, veloxquant.attention as att, veloxquant.tiles as tiles
import veloxquant.methods.turboquant as tq
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant import bench
from mlx_lm.generate import generate_step

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--spec", default="turboquant:key_bits=3,value_bits=3")
a = ap.parse_args()
warnings.simplefilter("always")
model, prompts, label = bench._generate_model(None, 32)
res = dict(model=label, mlx=mx.__version__, context=a.context, spec=a.spec, rows=[])
def run(tag):
    mx.clear_cache()
    caches = KVCacheBuilder.for_model(model, parse_method(a.spec))
    gen = generate_step(mx.array(prompts(a.context, 1)[0]), model, max_tokens=84, prompt_cache=caches, prefill_step_size=2048)
    for _ in range(16): next(gen)
    t0 = time.perf_counter()
    for _ in range(64): next(gen)
    r = dict(tag=tag, tok_s=64 / (time.perf_counter() - t0), failed=dict(gpu.FAILED),
             paths=type(caches[0]._fused()).__name__ if caches[0]._fused() else None)
    res["rows"].append(r); print(r, flush=True); del gen, caches
def warm(): bench._run_one(model, a.spec, prompts(4160, 1), 2, 0, 2048)
run("fresh")
warm(); run("after warm-up")
for name, clear in (("tq._DECODE_AS", tq._DECODE_AS.clear), ("gpu_decode._ROT_T", gd._ROT_T.clear), ("gpu._NREFS", gpu._NREFS.clear),
                    ("attention._COMPILED + tiles._FNS", lambda: (att._COMPILED.clear(), tiles._FNS.clear())),
                    ("tq._F32_CACHE", tq._F32_CACHE.clear)):
    warm(); clear(); run(f"after warm-up, {name} cleared")
json.dump(res, open(a.out, "w"), indent=1)
