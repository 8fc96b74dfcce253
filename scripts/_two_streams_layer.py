import sys, time
import mlx.core as mx, mlx_lm.models.base as base
from veloxquant.core import parse_method
from veloxquant.bench import _cache_arrays
Hq, Hkv, D, S = 9, 3, 64, int(sys.argv[2]) if len(sys.argv) > 2 else 4096
mx.random.seed(0)
q = mx.random.normal((1, Hq, 1, D)); k = mx.random.normal((1, Hkv, S, D)); v = mx.random.normal((1, Hkv, S, D)); mx.eval(q,k,v)
def mk(spec, two):
    c = parse_method(spec).make_cache(); c.two = two
    for s0 in range(0, S - 1, 2048):
        T = min(2048, S - 1 - s0); c.update_and_fetch(k[:, :, s0:s0 + T], v[:, :, s0:s0 + T]); c._flush() if c.pending is not None else None
    c._compact(); mx.eval(*_cache_arrays(c)); return c
def step(c):
    k1, v1 = c.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    out = base.scaled_dot_product_attention(q, k1, v1, cache=c, scale=D ** -0.5, mask=None)
    c.trim(1); return [out, *_cache_arrays(c)]
import random
for spec in sys.argv[1].split(";"):
    a, b = mk(spec, False), mk(spec, True)
    oa, ob = step(a)[0], step(b)[0]; mx.eval(oa, ob); print(spec, "max diff", mx.abs(oa - ob).max().item())
    ts = {0: [], 1: []}; sd = []
    for i in range(60):
        for key, c in random.sample([(0, a), (1, b)], 2):
            t = time.perf_counter(); mx.eval(step(c)); ts[key].append(time.perf_counter() - t)
        t = time.perf_counter(); mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)); sd.append(time.perf_counter()-t)
    for key in ts: x = sorted(ts[key][5:]); print("  two" if key else "  one", f"{1e6*x[len(x)//2]:.0f} us")
    x = sorted(sd[5:]); print("  sdpa", f"{1e6*x[len(x)//2]:.0f} us")
