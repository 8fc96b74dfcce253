"""Where a decode step over decoded tiles (`veloxquant.tiles`) spends its time, on a GPU: one layer (32 query / 8 KV
heads, head_dim 128, float16) filled to S tokens by `update_and_fetch`, then per method and batch size (median µs):
- `step`: one decode step evaluated on its own, as `bench.benchmark_layer` times it (update + attention + evaluation);
- `build`: the host time to build that step's graph (no evaluation), `walk`: `bench._cache_arrays` over the cache;
- `attn_pipelined`: 20 attention calls (no update) built, then evaluated together: per call (device time when the host keeps up);
- `tiles_pipelined`: the codecs' tile decoders alone over every window, 20 times, evaluated together: per step;
- `kernel_pipelined`: the tile kernel alone over already decoded tiles, 20 times: per step;
stock mlx-lm's KVCache + SDPA beside each method. Usage: python scripts/profile_tiles.py OUT.json [S] [batches] [methods;...]"""
import json, platform, sys, time
import mlx.core as mx
import mlx_lm.models.base as base
import veloxquant.tiles as tiles
from veloxquant.attention import decode_plan
from veloxquant.bench import _layer_cache, _cache_arrays, STOCK

out = sys.argv[1]; S = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
batches = tuple(int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,8").split(","))
methods = (sys.argv[4] if len(sys.argv) > 4 else "q4_0;q8_0;kivi;gear;polar;turboquant_rvq").split(";")
H, Hkv, D, dt = 32, 8, 128, mx.float16
md = lambda xs: 1e6 * sorted(xs)[len(xs) // 2]

def fill(spec, B):
    mx.random.seed(0); cache = _layer_cache(spec)
    for s0 in range(0, S, 2048):
        k, v = (mx.random.normal((B, Hkv, 2048, D)).astype(dt) for _ in range(2))
        k, v = cache.update_and_fetch(k, v); mx.eval(k, v, *_cache_arrays(cache))
    return cache

def profile(spec, B):
    cache = fill(spec, B); r = dict(method=spec, S=S, B=B)
    qs = [mx.random.normal((B, H, 1, D)).astype(dt) for _ in range(20)]
    kv1 = [(mx.random.normal((B, Hkv, 1, D)).astype(dt), mx.random.normal((B, Hkv, 1, D)).astype(dt)) for _ in range(40)]
    mx.eval(qs, kv1)
    st, bu, wa = [], [], []
    for i in range(19):
        k1, v1 = kv1[i]
        t0 = time.perf_counter()
        k, v = cache.update_and_fetch(k1, v1)
        o = base.scaled_dot_product_attention(qs[i % 20], k, v, cache=cache, scale=D ** -0.5, mask=None)
        t1 = time.perf_counter(); arrs = _cache_arrays(cache); t2 = time.perf_counter()
        mx.eval(o, *arrs); t3 = time.perf_counter()
        if i >= 3: st.append(t3 - t0); bu.append(t1 - t0); wa.append(t2 - t1)
    r.update(step_us=md(st), build_us=md(bu), walk_us=md(wa))
    # attention alone, 20 calls evaluated together (k, v of the last update: the cache's own view)
    k, v = cache.update_and_fetch(*kv1[39]); mx.eval(k, v, *_cache_arrays(cache))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        os_ = [base.scaled_dot_product_attention(q, k, v, cache=cache, scale=D ** -0.5, mask=None) for q in qs]
        mx.eval(os_); ts.append((time.perf_counter() - t0) / 20)
    r["attn_pipelined_us"] = md(ts)
    if spec != STOCK and hasattr(cache, "k_store"):
        kc, vc = cache.k_codec, cache.v_codec
        bs = cache.block_size or tiles.window_tokens(B, Hkv, D); g = cache._group(); bs = max(g, bs - bs % g)
        plan = decode_plan(cache.k_store.length, bs)
        wins = [(cache.k_store.slice(s, s + P), cache.v_store.slice(s, s + P), lo) for s, P, lo in plan]
        r["windows"] = [(s, P, lo) for s, P, lo in plan]
        fns = tiles._TileFns(kc, vc, mx.float16, tiles.COMPILE_TILES and kc.compilable and vc.compilable)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            outs = [fns.tile(kb, vb) for _ in range(20) for kb, vb, lo in wins]
            mx.eval(outs); ts.append((time.perf_counter() - t0) / 20)
        r["tiles_pipelined_us"] = md(ts)
        tls = [fns.tile(kb, vb) for kb, vb, lo in wins]; qt = fns.prep(qs[0], Hkv, D ** -0.5 * 1.4426950408889634); mx.eval(tls, qt)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            outs = [tiles.tile_partials(qt, kt, vt, lo, H // Hkv) for _ in range(20) for (kt, vt), (_, _, lo) in zip(tls, wins)]
            mx.eval(outs); ts.append((time.perf_counter() - t0) / 20)
        r["kernel_pipelined_us"] = md(ts)
        ts = []
        for _ in range(9):   # host time of the tile decoders' and kernels' graph alone
            t0 = time.perf_counter()
            outs = [tiles.tile_partials(qt, *fns.tile(kb, vb), lo, H // Hkv) for kb, vb, lo in wins]
            ts.append(time.perf_counter() - t0); mx.eval(outs)
        r["tiles_build_us"] = md(ts)
    r["kv_bytes"] = cache.nbytes if hasattr(cache, "nbytes") else None
    del cache; mx.clear_cache()
    return r

rows = []
meta = dict(machine=platform.node(), mlx=mx.__version__, device=str(mx.default_device()), S=S, model="one layer: 32 query / 8 KV heads, head_dim 128, float16")
for B in batches:
    for spec in methods:
        for m in (STOCK, spec):
            try: r = profile(m, B)
            except Exception as e: print(f"{m} B={B}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True); continue
            rows.append(r); json.dump(dict(meta=meta, rows=rows), open(out, "w"), indent=1)
            print(" ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "windows"), flush=True)
