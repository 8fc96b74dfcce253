"""Host cost (graph building, no evaluation) of the pieces of one B = 1 decode step through a turboquant / affine cache
on a GPU, in µs per call (medians of `reps` calls): the whole layer (update_and_fetch + dispatch), the two custom-kernel
calls alone, the window write, and stock mlx-lm's KVCache + SDPA for reference. Also the same two kernel calls replayed
through `mx.compile` at fixed shapes.

    python scripts/host_costs.py OUT.json --context 32768
"""
import argparse, json, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.attention import dispatch
from mlx_lm.models.cache import KVCache

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=32768)
ap.add_argument("--reps", type=int, default=300)
a = ap.parse_args()
H, Hq, D, C = 8, 32, 128, a.context
res = dict(device=str(mx.default_device()), mlx=mx.__version__, context=C, us={})

def med(fn, reps=a.reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    ts.sort(); return ts[len(ts) // 2] * 1e6

q = mx.random.normal((1, Hq, 1, D)).astype(mx.float16); k1 = mx.random.normal((1, H, 1, D)).astype(mx.float16)
mx.eval(q, k1)
st = KVCache(); st.update_and_fetch(mx.random.normal((1, H, C, D)).astype(mx.float16), mx.random.normal((1, H, C, D)).astype(mx.float16)); mx.eval(st.keys)
def stock_layer():
    kk, vv = st.update_and_fetch(k1, k1); st.offset -= 1  # stay at one length
    return dispatch(q, kk, vv, st, D ** -0.5, None)
res["us"]["stock layer (KVCache.update_and_fetch + SDPA)"] = med(stock_layer)
res["us"]["mx op (q * 2)"] = med(lambda: q * 2)
for spec in ("turboquant:key_bits=3,value_bits=3", "affine:key_bits=4,value_bits=4"):
    c = parse_method(spec).make_cache()
    c.update_and_fetch(mx.random.normal((1, H, C, D)).astype(mx.float16), mx.random.normal((1, H, C, D)).astype(mx.float16))
    c._flush(); mx.eval(c.state)
    for _ in range(3): kk, vv = c.update_and_fetch(k1, k1); mx.eval(dispatch(q, kk, vv, c, D ** -0.5, None))
    def layer():
        kk, vv = c.update_and_fetch(k1, k1); c.offset -= 1; c._xkn -= 1; c._xvn -= 1
        return dispatch(q, kk, vv, c, D ** -0.5, None)
    name = spec.split(":")[0]
    res["us"][f"{name} layer (update_and_fetch + dispatch)"] = med(layer)
    res["us"][f"{name} update_and_fetch"] = med(lambda: (c.update_and_fetch(k1, k1), setattr(c, "offset", c.offset - 1), setattr(c, "_xkn", c._xkn - 1), setattr(c, "_xvn", c._xvn - 1)))
    c.update_and_fetch(k1, k1); mx.eval(c._xk)
    fn = c._fused()
    args = (q, c.k_store.arrays, c.v_store.arrays, c.k_store.length, c._xk, c._xv, D ** -0.5, None)
    res["us"][f"{name} fused decode call"] = med(lambda: fn(*args, n_exact=c._xkn))
    # the pieces inside: the DecodeStep call with its inputs
    import veloxquant.gpu_decode as gd
    orig = gd._merge_partials; box = {}
    def spy(*aa, **kw): box["a"], box["kw"] = aa, kw; return orig(*aa, **kw)
    gd._merge_partials = spy; fn(*args, n_exact=c._xkn); gd._merge_partials = orig
    res["us"][f"{name} merge call alone"] = med(lambda: orig(*box["a"], **box["kw"]))
    res["us"][f"{name} window write"] = med(lambda: (c._window_write(k1, k1), setattr(c, "_xkn", c._xkn - 1), setattr(c, "_xvn", c._xvn - 1)))
    cf = mx.compile(lambda *xs: fn(xs[0], c.k_store.arrays, c.v_store.arrays, c.k_store.length, xs[1], xs[2], D ** -0.5, None, n_exact=c._xkn))
    try:
        mx.eval(cf(q, c._xk, c._xv))
        res["us"][f"{name} fused decode call through mx.compile (replay)"] = med(lambda: cf(q, c._xk, c._xv))
    except Exception as e: res["us"][f"{name} compile"] = repr(e)[:200]
    mx.eval(c.state)
for k, v in res["us"].items(): print(f"{v if isinstance(v, str) else round(v, 1)!s:>8}  {k}")
json.dump(res, open(a.out, "w"), indent=1)
