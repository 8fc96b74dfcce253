"""Where the process peak of `benchmark_generate`'s B = 1 run is reached: `generate_step` over a `context`-token prompt
(2,048-token prefill chunks) and a few decode tokens, with `mx.eval` / `mx.async_eval` wrapped so that the peak of
active memory is read (and reset) at each evaluation: one row per prefill chunk, the last prompt step and decode steps,
for stock mlx-lm and each spec, with the active memory after it (weights included, GB).

    python scripts/peak_trace.py OUT.json --context 8192 [--score-budget BYTES] [--specs "stock;affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3"]
"""
import argparse, json
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant import bench
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=8192)
ap.add_argument("--specs", default="stock;affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3")
ap.add_argument("--decode", type=int, default=4)
ap.add_argument("--prefill-sync", action="store_true", help="VQCache.prefill_sync = True (one evaluation per layer and prefill chunk)")
ap.add_argument("--score-budget", type=int, default=None, help="veloxquant.attention.PREFILL_SCORE_BUDGET['gpu'] in bytes (default: as shipped)")
a = ap.parse_args()
if a.prefill_sync:
    from veloxquant.cache import VQCache; VQCache.prefill_sync = True
if a.score_budget is not None:
    import veloxquant.attention as _att; _att.PREFILL_SCORE_BUDGET["gpu"] = a.score_budget
model, prompts, label = bench._generate_model(None, 32)
TRACE = []
def traced(name, f):
    def g(*args, **kw):
        out = f(*args, **kw)
        if name == "eval": TRACE.append((name, mx.get_peak_memory() / 1e9, mx.get_active_memory() / 1e9)); mx.reset_peak_memory()
        else: TRACE.append((name, None, None))
        return out
    return g
_eval, _async = mx.eval, mx.async_eval
res = dict(model=label, mlx=mx.__version__, context=a.context, score_budget=a.score_budget, prefill_sync=a.prefill_sync, runs={})
for spec in a.specs.split(";"):
    bench._run_one(model, spec, prompts(min(a.context, 4160), 1), 2, 0, 2048)  # warm-up as benchmark_generate
    mx.clear_cache(); mx.reset_peak_memory(); TRACE.clear()
    mx.eval, mx.async_eval = traced("eval", _eval), traced("async_eval", _async)
    caches = make_prompt_cache(model) if spec == bench.STOCK else KVCacheBuilder.for_model(model, parse_method(spec))
    peaks = []; import time; t0 = time.perf_counter()
    for i, _ in zip(range(a.decode), generate_step(mx.array(prompts(a.context, 1)[0]), model, max_tokens=a.decode,
                                                    prompt_cache=caches, prefill_step_size=2048)):
        _eval(_)
        if i == 0: prefill_s = time.perf_counter() - t0
        peaks.append(dict(token=i, peak_since_gb=mx.get_peak_memory() / 1e9, active_gb=mx.get_active_memory() / 1e9)); mx.reset_peak_memory()
    mx.eval, mx.async_eval = _eval, _async
    evals = [dict(call=n, peak_gb=p, active_gb=ac) for n, p, ac in TRACE]
    kv = bench._kv_bytes(caches) / 1e9
    res["runs"][spec] = dict(evals=evals, tokens=peaks, kv_gb=kv, prefill_s=prefill_s)
    ev = [(i, round(e["peak_gb"], 3), round(e["active_gb"], 3)) for i, e in enumerate(evals) if e["peak_gb"]]
    top = max(ev, key=lambda x: x[1]) if ev else None
    print(spec, "prefill s", round(prefill_s, 3), "kv GB", round(kv, 3), f"{len(evals)} evals; highest (index, peak, active after):", top, "first 6:", ev[:6],
          "tokens (peak since previous, active):", [(round(t["peak_since_gb"], 3), round(t["active_gb"], 3)) for t in peaks], flush=True)
    del caches
json.dump(res, open(a.out, "w"), indent=1)
