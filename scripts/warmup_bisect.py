"""Why is turboquant's B = 1 decode slower after `benchmark_generate`'s shared warm-up? (H200, session 12: 155.8 tok/s in a
fresh process through `generate_step`, 0.99x stock; ~96 tok/s, 0.61x, after a 4,160-token warm-up run in the same
process.) One process, `generate_step` at `context` tokens, decode tok/s over 64 tokens after 16:
  1. fresh; 2. a second run with no warm-up between; 3. after warm-up runs (4,160-token prompt, 2 decode tokens, as
  `benchmark_generate` makes) of stock only, of the spec only, and of stock, affine and the spec;
  4. again, after clearing veloxquant's module-level caches one group at a time (compiled decode_as, rotation copies,
     length views, compiled decode/tile functions), to see which state carries the slowdown;
each row with the attention path of the timed steps (fused kernel, coded/decoded tiles, compiled, blockwise), the
host synchronisations inside them (`mx.eval` calls, safety-net probes), the layer-0 cache layout and `gpu.FAILED`.

    python scripts/warmup_bisect.py OUT.json --context 32768
    MLX_CUDA_GRAPH_CACHE_SIZE=4000 python scripts/warmup_bisect.py OUT.json --context 32768 --quick   (MLX's CUDA graph cache)
"""
import argparse, collections, json, time, warnings
import mlx.core as mx
import veloxquant  # noqa: F401
import veloxquant.gpu as gpu, veloxquant.gpu_decode as gd, veloxquant.attention as att, veloxquant.tiles as tiles
import veloxquant.cache as cache_mod
import veloxquant.methods.turboquant as tq
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant import bench
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--spec", default="turboquant:key_bits=3,value_bits=3")
ap.add_argument("--quick", action="store_true", help="only fresh, the shared warm-up, then the spec and stock again")
ap.add_argument("--alternate", type=int, default=0, help="instead: stock and the spec alternately, this many runs each")
a = ap.parse_args()
warnings.simplefilter("always")
CNT = collections.Counter()
def counted(name, f):
    def g(*args, **kw): CNT[name] += 1; return f(*args, **kw)
    return g
gd.DecodeStep.__call__ = counted("fused DecodeStep", gd.DecodeStep.__call__)
cache_mod.VQCache._attend_tiles = counted("tiles (coded or decoded)", cache_mod.VQCache._attend_tiles)
cache_mod.compiled_decode_attention = counted("compiled decode", cache_mod.compiled_decode_attention)
cache_mod.blockwise_attention = counted("blockwise", cache_mod.blockwise_attention)
cache_mod.VQCache._window_alloc = counted("window buffer alloc", cache_mod.VQCache._window_alloc)
cache_mod.VQCache._encode_append = counted("encode_append", cache_mod.VQCache._encode_append)
mx.eval = counted("mx.eval", mx.eval)
_orig_call = gpu.GuardedKernel.__call__
def guarded(self, **kw):
    if gpu._shape_class(self.name, kw) not in gpu._VERIFIED: CNT[f"probe {self.name}"] += 1
    return _orig_call(self, **kw)
gpu.GuardedKernel.__call__ = guarded

model, prompts, label = bench._generate_model(None, 32)
import os
res = dict(model=label, mlx=mx.__version__, context=a.context, spec=a.spec, rows=[],
           env={k: v for k, v in os.environ.items() if k.startswith("MLX_")})
def run(tag, spec=None):
    spec = spec or a.spec
    mx.clear_cache()
    caches = make_prompt_cache(model) if spec == bench.STOCK else KVCacheBuilder.for_model(model, parse_method(spec))
    gen = generate_step(mx.array(prompts(a.context, 1)[0]), model, max_tokens=84, prompt_cache=caches, prefill_step_size=2048)
    for _ in range(16): next(gen)
    CNT.clear(); t0 = time.perf_counter(); dt = []
    for _ in range(64):
        t1 = time.perf_counter(); next(gen); dt.append(time.perf_counter() - t1)
    el = time.perf_counter() - t0
    c = caches[0]
    lay = {} if spec == bench.STOCK else dict(codes=c.k_store.length, cap=int(c.k_store.arrays["c0"].shape[2]) if "c0" in c.k_store.arrays else None,
               exact=c._xkn, xbuf=None if c._xk is None else list(c._xk.shape), sinks=c.n_sink, offset=c.offset)
    dt.sort()
    r = dict(tag=tag, spec=spec, tok_s=64 / el, median_ms=1e3 * dt[32], p10_ms=1e3 * dt[6], p90_ms=1e3 * dt[57],
             calls=dict(CNT), layout=lay, failed=dict(gpu.FAILED), active_gb=mx.get_active_memory() / 1e9)
    res["rows"].append(r); print(json.dumps(r), flush=True); del gen, caches
    json.dump(res, open(a.out, "w"), indent=1)
def warm(specs=(bench.STOCK, "affine:key_bits=4,value_bits=4", None)):
    for s in specs: bench._run_one(model, s or a.spec, prompts(4160, 1), 2, 0, 2048)
if a.alternate:
    for i in range(a.alternate): run(f"stock, run {i + 1}", bench.STOCK); run(f"run {i + 1}")
    raise SystemExit
run("stock, fresh", bench.STOCK)
run("fresh")
if a.quick:
    warm(); run("after the shared warm-up (stock, affine, spec)"); run("stock, after the shared warm-up", bench.STOCK); raise SystemExit
run("second run, no warm-up")
warm((bench.STOCK,)); run("after a stock warm-up")
warm((None,)); run("after a warm-up of the spec")
warm(); run("after the shared warm-up (stock, affine, spec)")
run("stock, after the shared warm-up", bench.STOCK)
for name, clear in (("tq._DECODE_AS", tq._DECODE_AS.clear), ("gpu_decode._ROT_T", gd._ROT_T.clear), ("gpu._NREFS", gpu._NREFS.clear),
                    ("attention._COMPILED + tiles._FNS", lambda: (att._COMPILED.clear(), tiles._FNS.clear())),
                    ("tq._F32_CACHE", tq._F32_CACHE.clear)):
    warm(); clear(); run(f"after the shared warm-up, {name} cleared")
