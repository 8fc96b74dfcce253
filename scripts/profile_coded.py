"""Where a decode step over codes (`veloxquant.tiles.coded_decode`) spends its time, one layer (32 query / 8 KV heads,
head_dim 128, float16), S tokens, per method and batch size: `kernel_us` the coded partials kernel alone and
`floor_us` the same template over float16 tiles (`tile_partials`: the kernel without any decode), `attn_us` the whole
attention (query map, kernel, merge), all pipelined (N launches, one evaluation); `host_us` building that graph;
`sdpa_us` mlx's fused SDPA over fp16 K/V of the same length, pipelined.
With --sweep: also `kernel_us` at B = 8 for launch shapes (CODED_TOKENS U, CODED_WARPS NW, CODED_TARGET_GROUPS).
Usage: python scripts/profile_coded.py OUT.json [S] [batches] [methods;...] [--sweep]"""
import json, platform, sys, time
import mlx.core as mx
import veloxquant as vq  # noqa: F401
import veloxquant.tiles as tiles
from veloxquant.core import parse_method

SWEEP = "--sweep" in sys.argv; sys.argv = [a for a in sys.argv if a != "--sweep"]
SHAPES = [(4, 4, 1056), (2, 4, 1056), (8, 4, 1056), (4, 8, 1056), (4, 4, 2112), (4, 4, 528), (2, 8, 2112)]
out = sys.argv[1]; S = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,8").split(",")]
methods = (sys.argv[4] if len(sys.argv) > 4 else "kivi;polar;gear;turboquant_rvq;qjl;rabitq").split(";")
Hq, Hkv, D, N = 32, 8, 128, 20
rows = []
meta = dict(machine=platform.node(), mlx=mx.__version__, device=str(mx.default_device()), S=S)

def piped(fn):
    mx.eval(fn()); t = time.perf_counter(); outs = [fn() for _ in range(N)]; mx.eval(outs); return 1e6 * (time.perf_counter() - t) / N

for B in batches:
    q = (mx.random.normal((B, Hq, 1, D)) * 0.5).astype(mx.float16)
    K, V = (mx.random.normal((B, Hkv, S, D)).astype(mx.float16) for _ in "kv"); mx.eval(q, K, V)
    sdpa = piped(lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=D ** -0.5))
    floor = piped(lambda: tiles.tile_partials((q.astype(mx.float32).reshape(B * Hq, D)), K, V, 0, Hq // Hkv))
    del K, V
    for m in methods:
        mx.random.seed(0)
        c = parse_method(m).make_cache()
        for s0 in range(0, S, 2048):
            k, v = (mx.random.normal((B, Hkv, 2048, D)).astype(mx.float16) for _ in "kv")
            c.update_and_fetch(k, v); mx.eval(c.k_store.arrays, c.v_store.arrays)
        k1, v1 = (mx.random.normal((B, Hkv, 1, D)).astype(mx.float16) for _ in "kv")
        c.update_and_fetch(k1, v1); c.pending = None if c._in_window else c.pending
        kc, vc = c.k_codec, c.v_codec
        rk, rv = tiles._reader(kc), tiles._reader(vc)
        n = c.k_store.length; ka, va = c.k_store.arrays, c.v_store.arrays
        ek, ev = (c._xk, c._xv) if c._xbuf else (c.k_exact, c.v_exact)
        ne = c._xkn if c._xbuf else None
        if ek is None: ek = ev = mx.zeros((B, Hkv, 0, D), mx.float16)  # no exact tokens (window 0, whole groups)
        fns = tiles._tile_fns(kc, vc, None, mx.float16)
        qt = fns.prep(q, Hkv, D ** -0.5 * tiles._LOG2E); mx.eval(qt)
        kern = piped(lambda: tiles.coded_partials(qt, rk, rv, ka, va, n, Hq // Hkv))
        attn = lambda: tiles.coded_decode(kc, vc, q, ka, va, n, ek, ev, D ** -0.5, None, ne)
        at = piped(attn)
        t = time.perf_counter()
        for _ in range(N): attn()
        host = 1e6 * (time.perf_counter() - t) / N
        r = dict(method=m, B=B, S=S, n=n, kernel_us=kern, floor_us=floor, attn_us=at, host_us=host, sdpa_us=sdpa,
                 code_bytes=sum(a.nbytes for a in ka.values()) + sum(a.nbytes for a in va.values()))
        if SWEEP and B == 8:
            r["sweep"] = []
            for U, NW, G in SHAPES:
                tiles.CODED_TOKENS, tiles.CODED_WARPS, tiles.CODED_TARGET_GROUPS = U, NW, G
                try: us = piped(lambda: tiles.coded_partials(qt, rk, rv, ka, va, n, Hq // Hkv))
                except Exception as e: us = None; print("sweep", U, NW, G, "failed", str(e)[:200])
                r["sweep"].append(dict(U=U, NW=NW, groups=G, kernel_us=us))
                print(f"   U={U} NW={NW} groups={G}: {us if us is None else round(us)} µs", flush=True)
            tiles.CODED_TOKENS, tiles.CODED_WARPS, tiles.CODED_TARGET_GROUPS = 4, 4, 1056
        rows.append(r); json.dump(dict(meta=meta, rows=rows), open(out, "w"), indent=1)
        print(f"B={B} {m:<16} kernel {kern:7.0f} µs (template over fp16 {floor:6.0f})  attention {at:7.0f}  host {host:5.0f}  sdpa {sdpa:5.0f}", flush=True)
        del c
