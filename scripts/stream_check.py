"""Does the stream matter? B = 1 decode tok/s at one context of stock mlx-lm and turboquant 3/3 (random-weight
Llama-3.1-8B-shaped model, caches filled with random K/V): pipelined steps on the default stream, then the same inside
`mx.stream(new stream)` (as `mlx_lm.generate.generate_step` runs on its own `generation_stream`), interleaved rounds;
then `benchmark_generate` at the same context (real prefill, `generate_step`).

    python scripts/stream_check.py OUT.json --context 32768
"""
import argparse, json, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant import bench
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--steps", type=int, default=128); ap.add_argument("--rounds", type=int, default=3)
a = ap.parse_args()
model, _, label = bench._generate_model(None, 32)
TQ = "turboquant:key_bits=3,value_bits=3"
res = dict(model=label, mlx=mx.__version__, context=a.context, rows=[])
def fill(caches):
    mx.random.seed(1)
    for c in caches:
        c.update_and_fetch(mx.random.normal((1, 8, a.context, 128)).astype(mx.float16), mx.random.normal((1, 8, a.context, 128)).astype(mx.float16))
        if hasattr(c, "_flush"): c._flush()
        mx.eval(c.state)
def pipelined(caches, steps):
    y = mx.array([[1]]); t0 = time.perf_counter()
    tok = mx.argmax(model(y, cache=caches)[:, -1], axis=-1); mx.async_eval(tok)
    for _ in range(steps):
        nxt = mx.argmax(model(tok[None], cache=caches)[:, -1], axis=-1); mx.async_eval(nxt); tok.item(); tok = nxt
    tok.item(); return (steps + 1) / (time.perf_counter() - t0)
made = {}
for spec in (bench.STOCK, TQ):
    made[spec] = make_prompt_cache(model) if spec == bench.STOCK else KVCacheBuilder.for_model(model, parse_method(spec))
    fill(made[spec]); pipelined(made[spec], 8)
gs = mx.new_stream(mx.gpu)
for r in range(a.rounds):
    for where in ("default stream", "new stream"):
        for spec, caches in made.items():
            if where == "new stream":
                with mx.stream(gs): t = pipelined(caches, a.steps)
            else: t = pipelined(caches, a.steps)
            res["rows"].append(dict(round=r, stream=where, spec=spec, tok_s=t)); print(res["rows"][-1], flush=True)
del made; mx.clear_cache()
g = bench.benchmark_generate(methods=(bench.STOCK, TQ), contexts=(a.context,), decode_tokens=128, progress=False)
res["generate"] = g; bench.print_generate(g)
json.dump(res, open(a.out, "w"), indent=1, default=float)
