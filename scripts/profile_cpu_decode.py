"""Where a CPU decode step spends its time: one layer of the default model's shape (9 query / 3 KV heads, head_dim 64,
float32, B = 1) filled with S random tokens, then the pieces of the reference decode path timed one by one
(median of `--steps` evaluations each) next to stock mlx-lm's SDPA over float32 K/V and the whole step through the cache,
with the CPU levers switched off and on (`--variants`); then every variant's whole step and stock's SDPA again,
interleaved in a new random order each round (3·steps rounds: the numbers to compare on a shared CPU).

    python scripts/profile_cpu_decode.py --S 4096 --methods "affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3"
"""
import argparse, json, time
import mlx.core as mx
import mlx_lm.models.base as base
from veloxquant.core import parse_method
from veloxquant.bench import _cache_arrays

def med(fn, steps):
    for _ in range(2): mx.eval(fn())
    ts = []
    for _ in range(steps):
        t = time.perf_counter(); mx.eval(fn()); ts.append(time.perf_counter() - t)
    ts.sort(); return 1e6 * ts[len(ts) // 2]

_SAVED = {}
def _switch(variant):
    "Switch the CPU levers: the code planes (affine `_planes`, turboquant `_cpu_planes`), the one-pass decode softmax, the compiled step."
    import veloxquant.attention as att
    from veloxquant.cache import VQCache
    VQCache.cpu_step = None if variant == "compiled" else False
    from veloxquant.methods.affine import AffineCodec
    from veloxquant.methods.turboquant import TurboQuantCodec
    for cls, name in ((AffineCodec, "_planes"), (TurboQuantCodec, "_cpu_planes")):
        _SAVED.setdefault((cls, name), cls.__dict__[name])
        setattr(cls, name, _SAVED[(cls, name)] if variant != "reference" else (lambda self, blk: None))
    att.DECODE_ONE_PASS = variant in ("planes+one-pass", "compiled")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=4096); ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--methods", default="affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="reference,planes,planes+one-pass,compiled",
                    help="comma-separated: reference (no planes, online softmax), planes, planes+one-pass, compiled "
                         "(the defaults: the whole step through `VQCache._cpu_step`, one compiled function)")
    a = ap.parse_args()
    Hq, Hkv, D, S, dt = 9, 3, 64, a.S, mx.float32
    mx.random.seed(0)
    q = mx.random.normal((1, Hq, 1, D)); k = mx.random.normal((1, Hkv, S, D)); v = mx.random.normal((1, Hkv, S, D))
    mx.eval(q, k, v)
    sdpa = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5)
    rows = [dict(method="stock", piece="mx.fast.sdpa fp32 K/V", us=med(sdpa, a.steps))]
    whole = {("stock", ""): lambda: [sdpa()]}  # every variant's whole step, timed again interleaved at the end
    for spec, variant in [(s, v) for s in a.methods.split(";") for v in a.variants.split(",")]:
        _switch(variant)
        cache = parse_method(spec).make_cache()
        for s0 in range(0, S - 1, 2048):
            T = min(2048, S - 1 - s0)
            cache.update_and_fetch(k[:, :, s0:s0 + T], v[:, :, s0:s0 + T]); cache._flush() if cache.pending is not None else None
        cache._compact()  # the blocks that left the window become codes (as the next update would)
        mx.eval(*_cache_arrays(cache))
        n = cache.k_store.length
        kb, vb = cache.k_store.slice(0, n), cache.v_store.slice(0, n)
        qq = (q * D ** -0.5).reshape(1, Hkv, Hq // Hkv, 1, D)
        p = mx.softmax(cache.k_codec.scores(qq, kb), axis=-1); mx.eval(p)
        kc, vc = cache.k_codec, cache.v_codec
        def step(cache=cache):
            k1, v1 = cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
            out = base.scaled_dot_product_attention(q, k1, v1, cache=cache, scale=D ** -0.5, mask=None)
            cache.trim(1)
            return [out, *_cache_arrays(cache)]
        pieces = {"whole step (update_and_fetch + attend + trim)": step,
                  "k scores over codes": lambda: kc.scores(qq, kb), "v mix over codes": lambda: vc.mix(p, vb),
                  "k decode (whole history)": lambda: kc.decode(kb), "v decode (whole history)": lambda: vc.decode(vb)}
        if hasattr(kc, "rotated_unit"):
            from veloxquant.quant import unpack_bits
            pieces["k unpack_bits"] = lambda: unpack_bits(kb["c0"], kc.groups[0][2], D)
            pieces["k rotated_unit (unpack + gather)"] = lambda: kc.rotated_unit(kb)
        whole[(spec, variant)] = (lambda variant=variant, step=step: (_switch(variant), step())[1])
        for name, fn in pieces.items():
            if hasattr(kc, "_qkey"): kc._qkey = kc._qpkey = None
            rows.append(dict(method=spec, variant=variant, piece=name, us=med(fn, a.steps)))
        rows.append(dict(method=spec, variant=variant, piece="codes in history", us=float(n)))
    ts = {key: [] for key in whole}  # interleaved rounds, a new random order each: a shared CPU's load bursts hit all alike
    import random
    rng = random.Random(0)
    for i in range(3 * a.steps + 2):
        order = list(whole.items()); rng.shuffle(order)
        for key, fn in order:
            t = time.perf_counter(); mx.eval(fn()); dt = time.perf_counter() - t
            if i >= 2: ts[key].append(dt)
    for (spec, variant), t in ts.items():
        t.sort()
        for stat, val in (("median", t[len(t) // 2]), ("min", t[0])):
            rows.append(dict(method=spec, variant=variant, piece=f"whole step, interleaved ({stat} of {len(t)})" if spec != "stock" else f"mx.fast.sdpa, interleaved ({stat} of {len(t)})", us=1e6 * val))
    _switch("compiled")
    for r in rows: print(f"{r['method'][:36]:36s} {r.get('variant', ''):16s} {r['piece']:48s} {r['us']:10.0f}")
    if a.out: json.dump(rows, open(a.out, "w"), indent=1)

if __name__ == "__main__": main()
