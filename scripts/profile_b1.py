"""B = 1 decode on a GPU through `generate_step`-style pipelining: tok/s of stock mlx-lm and each method on the
random-weight Llama-3.1-8B-shaped model (32 layers), caches filled directly with random K/V (no prefill), so that the
per-token cost of the cache path shows alone. Optional ncu mode (`--ncu`): a few decode steps only, for a kernel
profile under `ncu --metrics gpu__time_duration.sum`.

    python scripts/profile_b1.py OUT.json --contexts 8192,32768 --specs "stock;affine:key_bits=4,value_bits=4"

A spec ending in `@replay` builds its caches with `gpu.REPLAY_DECODE` on (each decode step's two launches replayed through
`mx.compile`), e.g. --specs "stock;affine:key_bits=4,value_bits=4;affine:key_bits=4,value_bits=4@replay": the A/B in one run;
`@cold`: their decode steps without the prepared launches (`DecodeStep.prepared` off: every step through the general path);
`@bake`: prepared launches of kernels with their templates written into the source (`DecodeStep.bake`).
"""
import argparse, json, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.gpu_decode import DecodeStep
from veloxquant.builder import KVCacheBuilder
from veloxquant.bench import STOCK, _generate_model
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser()
ap.add_argument("out"); ap.add_argument("--contexts", default="8192,32768")
ap.add_argument("--specs", default="stock;affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3")
ap.add_argument("--steps", type=int, default=128); ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--no-build", action="store_true", help="skip the graph-building timing after the rounds (it fills the caches again)")
ap.add_argument("--merge-warps", type=int, default=0, help="override gpu.MERGE_WARPS (0: the default)")
ap.add_argument("--prefill", type=int, default=0, help="fill the caches by a real prefill of random tokens in chunks of this many tokens (0: random K/V in one update)")
a = ap.parse_args()
import veloxquant.gpu as gpu
if a.merge_warps: gpu.MERGE_WARPS = a.merge_warps
model, _, label = _generate_model(None, a.layers)
H, D = 8, 128

def fill(caches, ctx):
    mx.random.seed(1)
    if a.prefill:  # as generate_step does: the prompt in chunks through the model (the compressed layout a user's decode sees)
        from veloxquant.bench import _cache_arrays
        toks = mx.random.randint(0, model.args.vocab_size, (1, ctx))
        for s in range(0, ctx, a.prefill):
            model(toks[:, s:s + a.prefill], cache=caches); mx.eval([_cache_arrays(c) for c in caches])
        return
    for c in caches:
        kk = mx.random.normal((1, H, ctx, D)).astype(mx.float16); vv = mx.random.normal((1, H, ctx, D)).astype(mx.float16)
        c.update_and_fetch(kk, vv)
        if hasattr(c, "_flush"): c._flush()
        mx.eval(c.state)

SPLIT = {}
def pipelined(caches, steps):
    """Seconds per token of `steps` + 1 tokens queued as `generate_step` does; SPLIT['host'] / SPLIT['wait']: the seconds per
    token spent building and queueing the next token's graph (model call + `mx.async_eval`) and waiting for the previous
    token (`.item()`); SPLIT['build'] / SPLIT['queue']: the host part split into the model call and `mx.async_eval`.
    A GPU-bound loop shows wait ≈ GPU time − host time > 0; wait ≈ 0 is necessary for a host-bound loop but does not
    prove it: `mx.async_eval` itself blocks while too much work is in flight (then `queue` holds GPU time)."""
    y = mx.array([[1]]); tb = tq = tw = 0.0
    t0 = time.perf_counter()
    tok = mx.argmax(model(y, cache=caches)[:, -1], axis=-1); mx.async_eval(tok)
    for _ in range(steps):
        t1 = time.perf_counter()
        nxt = mx.argmax(model(tok[None], cache=caches)[:, -1], axis=-1)
        t2 = time.perf_counter(); mx.async_eval(nxt)
        t3 = time.perf_counter(); tok.item(); tw += time.perf_counter() - t3; tb += t2 - t1; tq += t3 - t2; tok = nxt
    tok.item()
    SPLIT.update(host=(tb + tq) / steps, build=tb / steps, queue=tq / steps, wait=tw / steps)
    return (time.perf_counter() - t0) / (steps + 1)

PATHS = {}
def _count(mod, name):  # which attention path each decode step takes (counted per call)
    f = getattr(mod, name)
    def g(*args, **kw): PATHS[name] = PATHS.get(name, 0) + 1; return f(*args, **kw)
    setattr(mod, name, g)
import veloxquant.cache as _vc
for _n in ("blockwise_attention", "compiled_decode_attention", "query_blocked_sdpa"): _count(_vc, _n)
_count(_vc.tiles, "tiled_decode"); _count(_vc.VQCache, "_fused")
def make(spec):
    "The caches of `spec` (stock, a method spec, or one ending in @replay, @cold or @bake), their decode steps prepared by 8 steps."
    method, _, opt = spec.partition("@")
    if opt not in ("", "replay", "cold", "bake"): raise SystemExit(f"unknown spec option @{opt} (allowed: @replay, @cold, @bake)")
    gpu.REPLAY_DECODE = opt == "replay"  # read when a cache prepares its decode step (the warm-up steps)
    DecodeStep.prepared, DecodeStep.bake = opt != "cold", opt == "bake"
    try:
        caches = make_prompt_cache(model) if method == STOCK else KVCacheBuilder.for_model(model, parse_method(method))
        fill(caches, ctx); PATHS.clear(); pipelined(caches, 8)
    finally:
        gpu.REPLAY_DECODE, DecodeStep.prepared, DecodeStep.bake = False, True, False
    return caches

def describe(c):
    if not hasattr(c, "k_store"): return dict(kind=type(c).__name__, offset=getattr(c, "offset", None))
    cap = {k: tuple(v.shape) for k, v in c.k_store.arrays.items()}
    return dict(kind=type(c).__name__, offset=c.offset, store=c.k_store.length, cap=cap, xkn=c._xkn, xbuf=c._xbuf,
                xk=None if c._xk is None else tuple(c._xk.shape), sink=c.k_sink is not None, pending=c.pending is not None)

res = dict(model=label, device=str(mx.default_device()), mlx=mx.__version__, rows=[])
for ctx in [int(x) for x in a.contexts.split(",")]:
    made = {}
    for spec in a.specs.split(";"):
        mx.clear_cache()
        caches = made[spec] = make(spec)
        res.setdefault("layout", {})[f"{ctx} {spec}"] = dict(describe(caches[0]), paths_8_steps=dict(PATHS))
        print("layout", ctx, spec, res["layout"][f"{ctx} {spec}"], flush=True)
    for r in range(a.rounds):  # interleaved rounds: the ratios side by side
        for spec, caches in made.items():
            s = pipelined(caches, a.steps)
            res["rows"].append(dict(ctx=ctx, spec=spec, round=r, ms=s * 1e3, tok_s=1 / s, host_ms=SPLIT["host"] * 1e3, build_ms=SPLIT["build"] * 1e3, queue_ms=SPLIT["queue"] * 1e3, wait_ms=SPLIT["wait"] * 1e3))
            print(json.dumps(res["rows"][-1]), flush=True)
    del made
json.dump(res, open(a.out, "w"), indent=1)

if a.steps <= 4 or a.no_build:  # ncu mode (and --no-build) ends here
    raise SystemExit
# host graph building per token (no evaluation): what bounds a pipelined step when the device is faster
for ctx in [int(x) for x in a.contexts.split(",")][:1]:
    for spec in a.specs.split(";"):
        caches = make(spec)
        y = mx.array([[1]]); bs = []
        for _ in range(24):
            t0 = time.perf_counter(); lg = model(y, cache=caches); bs.append(time.perf_counter() - t0); mx.eval(lg)
        bs.sort(); res.setdefault("build_ms", {})[f"{ctx} {spec}"] = bs[12] * 1e3
        print("build ms", ctx, spec, round(bs[12] * 1e3, 3), flush=True)
        del caches
json.dump(res, open(a.out, "w"), indent=1)
