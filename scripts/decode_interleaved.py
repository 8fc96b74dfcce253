"""Decode speed of stock mlx-lm vs methods with the steps interleaved (fair under a shared CPU's changing load, unlike
`benchmark_generate`, which runs the methods one after another): one 4,095-token prefill (Wikipedia prose, the default
model) through stock mlx-lm's KVCache; each method's caches filled from those keys/values (one update per layer, as a
prefill leaves them); then decode steps (greedy) taken in turn, in a new random order every round, each evaluated on its own;
8 untimed, then ms per token (median, first quartile, min) and ratios to stock. A spec ending in "|old" runs with
`cpu_step = False` (the one-pass path before the compiled CPU step), one ending in "|mlx" with `cpu_kernel = False` (the
compiled MLX step instead of the native kernel of `veloxquant.cpu`).

    python scripts/decode_interleaved.py "affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3" 40 --out FILE
"""
import sys, time, json, mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from veloxquant.models import load_model, eval_tokens
from veloxquant import KVCacheBuilder
from veloxquant.core import parse_method
import subprocess
specs = sys.argv[1].split(";"); steps = int(sys.argv[2]); warm = 8
outp = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
model, tok = load_model(None)
toks = eval_tokens(tok, 4096)
stock = make_prompt_cache(model)
for s in range(0, 4095, 2048): mx.eval(model(mx.array(toks[s:min(s + 2048, 4095)])[None], cache=stock)); mx.eval([c.state for c in stock])
runs = {"stock": stock}
for spec in specs:
    cs = KVCacheBuilder.for_model(model, parse_method(spec.split("|")[0]))
    for c, st in zip(cs, stock):
        if spec.endswith("|old"): c.cpu_step = False
        if spec.endswith("|mlx"): c.cpu_kernel = False
        k, v = st.keys, st.values; c.update_and_fetch(k[:, :, :st.offset], v[:, :, :st.offset]); c._flush()
    mx.eval([c.state for c in cs]); runs[spec] = cs
y = {n: mx.array(toks[4095:4096])[None] for n in runs}; ts = {n: [] for n in runs}
import random
rng = random.Random(0)
for i in range(warm + steps):
    order = list(runs.items()); rng.shuffle(order)  # a new order every round: bursts of load hit every method alike
    for n, cs in order:
        t = time.perf_counter(); lg = model(y[n], cache=cs); mx.eval(lg); dt = time.perf_counter() - t
        y[n] = mx.argmax(lg[:, -1:], -1); ts[n].append(dt)
out = {}
for n, t in ts.items():
    t = sorted(t[warm:]); out[n] = dict(median_ms=1e3 * t[len(t) // 2], q1_ms=1e3 * t[len(t) // 4], min_ms=1e3 * t[0])
for n in out: out[n]["decode_ratio_median"] = out["stock"]["median_ms"] / out[n]["median_ms"]; out[n]["decode_ratio_min"] = out["stock"]["min_ms"] / out[n]["min_ms"]
out = dict(results=out, steps=steps, warmup=warm, context=4095, uptime_before=up0,
           uptime_after=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), mlx=mx.__version__,
           numba=getattr(sys.modules.get("numba"), "__version__", None))
print(json.dumps(out, indent=1))
if outp: json.dump(out, open(outp, "w"), indent=1)
