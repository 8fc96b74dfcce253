"""GPU timing of the product-VQ kernels (`veloxquant.vq`) through the cache and the dispatcher: one layer (32 query / 8
KV heads, head_dim 128, float16) of `vecinfer` at 1 bit per key and value element, built by the method registry from a
calibration artifact made here on random activations (`vecinfer_calibration`, 3 k-means iterations: the codebooks'
quality does not change the timing). Decode: `veloxquant.bench.benchmark_layer` (update_and_fetch + mlx-lm's
scaled_dot_product_attention, median of 16 steps), stock mlx-lm KVCache + fp16 `mx.fast.scaled_dot_product_attention`
beside it, and vecinfer three ways: `kernel` (the default on GPU back-ends: the table once per step and the decode
kernel), `tiles` (kernels off: the generic decode over decoded fp16 tiles, `veloxquant.tiles`), `reference` (kernels
and tiles off: the blockwise MLX reference path). Encode: the cache's compaction of S tokens (`VQCache._compact`:
transform, nearest centroid, store) with the fused kernel and with the reference `nearest`, median of 3.
Usage: python scripts/bench_vq.py OUT.json [seq_lens=8192,32768,131072] [batches=1,8]"""
import json, os, platform, sys, tempfile, time
import numpy as np
import mlx.core as mx
import veloxquant as vq
import veloxquant.vq as vqm
import veloxquant.calibrate as calibrate
from veloxquant.bench import benchmark_layer, _cache_arrays
from veloxquant.cache import VQCache
from veloxquant.core import parse_method
from veloxquant.quant import save_artifact
from veloxquant.methods.vecinfer import vecinfer_calibration

out = sys.argv[1]
seq = tuple(int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8192,32768,131072").split(","))
batches = tuple(int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,8").split(","))
Hq, Hkv, D = 32, 8, 128

def artifact(kb=1, vb=1, iters=3):
    path = os.path.join(tempfile.mkdtemp(), "vecinfer_bench.safetensors")
    spec = f"vecinfer:key_bits={kb},value_bits={vb},iters={iters},path={path},layer=0"
    cfg = parse_method(spec)
    rng = np.random.default_rng(0); N = 4096
    scale = np.linspace(3, 0.5, D).astype(np.float32)
    s = dict(keys=rng.standard_normal((Hkv, N, D)).astype(np.float32) * scale, values=rng.standard_normal((Hkv, N, D)).astype(np.float32),
             queries=rng.standard_normal((Hq, N, D)).astype(np.float32))
    t = {k: np.ascontiguousarray(v) for k, v in vecinfer_calibration([s], cfg.options).items()}
    meta = dict(method="vecinfer", settings=json.dumps(calibrate.settings_of("vecinfer", cfg.options), sort_keys=True), fingerprint="random",
                head_dims=json.dumps([D, D]), n_layers=1, n_kv_heads=Hkv, tokens=N, seconds=0)
    save_artifact(t, path, calibrate.CALIB_FORMAT, meta)
    return spec

MODES = {"kernel": (None, None), "tiles": (False, None), "reference": (False, False)}  # (vq.USE_KERNELS, VQCache.tiled_decode)
def mode(m): vqm.USE_KERNELS, VQCache.tiled_decode = MODES[m]

meta = dict(machine=platform.node(), mlx=mx.__version__, device=str(mx.default_device()), backend=vq.gpu.backend(),
            layer=f"one layer: {Hq} query / {Hkv} KV heads, head_dim {D}, float16", steps=16)
try:
    import mlx_lm; meta["mlx_lm"] = mlx_lm.__version__
except Exception: pass
rows = []
def save(): json.dump(dict(meta=meta, rows=rows), open(out, "w"), indent=1)
spec = artifact()
meta["spec"] = spec.split(",path=")[0]

def encode_us(S, B, m, reps=3):
    mode(m); ts = []
    for _ in range(reps):
        c = parse_method(spec).make_cache(); mx.random.seed(0)
        k, v = (mx.random.normal((B, Hkv, S, D)).astype(mx.float16) for _ in "kv")
        mx.eval(k, v)
        c.update_and_fetch(k, v); c._flush(); mx.eval(*_cache_arrays(c))
        t0 = time.perf_counter(); c._compact(); mx.eval(*_cache_arrays(c)); ts.append(time.perf_counter() - t0)
        n = c.k_store.length; del c, k, v
    ts.sort(); return 1e6 * ts[len(ts) // 2], n

def decode(S, B, m, stock):
    mode(m); t0 = time.time()
    try: r = benchmark_layer((["stock"] if stock is None else []) + [spec], seq_lens=(S,), batches=(B,), steps=16, progress=False, prefill_attention=False)
    except Exception as e:
        print(f"S={S} B={B} {m}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True); return stock
    if stock is None: stock = r[0]; rows.append(dict(stock, kind="decode", mode="stock fp16 SDPA")); r = r[1:]
    x = dict(r[0], kind="decode", mode=m, method=meta["spec"], ratio=stock["us"] / r[0]["us"], wall_s=round(time.time() - t0, 1))
    rows.append(x); save()
    print(f"decode S={S} B={B} {m:<9} {x['us']:9.0f} µs  stock {stock['us']:7.0f} µs  ×stock {x['ratio']:.3f}  KV {x['kv_bytes']/1e6:.0f} MB (stock {stock['kv_bytes']/1e6:.0f})", flush=True)
    return stock

def encode(S, B, m):
    try: us, n = encode_us(S, B, m)
    except Exception as e:
        print(f"encode S={S} B={B} {m}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True); return
    rows.append(dict(kind="encode", mode=m, method=meta["spec"], S=S, B=B, tokens=n, us=us)); save()
    print(f"encode S={S} B={B} {m:<9} {us:9.0f} µs for {n} tokens", flush=True)

for S in seq:      # the kernel rows first at every size (a run cut short keeps them), then the slower paths
    for B in batches:
        stock = decode(S, B, "kernel", None)
        encode(S, B, "kernel"); encode(S, B, "reference")
        decode(S, B, "tiles", stock); decode(S, B, "reference", stock)
mode("kernel"); save()
