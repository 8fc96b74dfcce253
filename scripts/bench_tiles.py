"""GPU timing of the decode over decoded tiles (`veloxquant.tiles`, on by default on GPU back-ends): one layer's decode
step through the cache (`veloxquant.bench.benchmark_layer`: 32 query / 8 KV heads, head_dim 128, float16), stock
mlx-lm KVCache + fused SDPA measured beside each method in the same call (`ratio` = stock µs / method µs).
Usage: python scripts/bench_tiles.py OUT.json [seq_len] [batches] [--reference] [--uncompiled] [--tiles] [--replay] [--methods=a;b]
(--replay: also each method with `gpu.REPLAY_DECODE`, the decode step replayed through `mx.compile`, right after it);
(--tiles: also each method with `VQCache.coded_decode = False`, the decode over decoded tiles without the codecs'
decoders inside the kernel; --reference: also each method with `VQCache.tiled_decode = False`, the reference path, for the first batch size;
--uncompiled: also with `tiles.COMPILE_TILES = False`, the tile decoders run op by op)."""
import json, platform, sys
import mlx.core as mx
import veloxquant as vq
import veloxquant.tiles as tiles
import veloxquant.gpu as gpu
from veloxquant.bench import benchmark_layer
from veloxquant.cache import VQCache

METHODS = ["q4_0", "q8_0", "q4_0:hadamard=true", "qjl", "polar", "turboquant_rvq", "rabitq", "kivi", "gear",
           "affine:key_bits=4,value_bits=4,use_kernels=false", "turboquant:key_bits=3,value_bits=3,use_kernels=false"]
import os
if os.environ.get("CODED_SHAPE"):  # "U,NW,groups": the coded kernel's launch (tiles.CODED_TOKENS, CODED_WARPS, CODED_TARGET_GROUPS)
    tiles.CODED_TOKENS, tiles.CODED_WARPS, tiles.CODED_TARGET_GROUPS = (int(x) for x in os.environ["CODED_SHAPE"].split(","))
args = [a for a in sys.argv[1:] if not a.startswith("--")]
METHODS = next((a.split("=", 1)[1].split(";") for a in sys.argv[1:] if a.startswith("--methods=")), METHODS)
out = args[0]; S = int(args[1]) if len(args) > 1 else 32768
batches = tuple(int(x) for x in (args[2] if len(args) > 2 else "1,8").split(","))
meta = dict(machine=platform.node(), mlx=mx.__version__, device=str(mx.default_device()), S=S, model="one layer: 32 query / 8 KV heads, head_dim 128, float16",
            coded_shape=dict(U=tiles.CODED_TOKENS, NW=tiles.CODED_WARPS, groups=tiles.CODED_TARGET_GROUPS))
rows = []
def save(): json.dump(dict(meta=meta, rows=rows), open(out, "w"), indent=1)
for B in batches:
    for m in METHODS:
        modes = [(None, True, None)] + ([("replay", True, None)] if "--replay" in sys.argv else [])
        modes += [(None, False, None)] if "--uncompiled" in sys.argv else []
        modes += [(None, True, False)] if "--tiles" in sys.argv else []
        modes += [(False, True, None)] if ("--reference" in sys.argv and B == batches[0]) else []
        for mode, comp, coded in modes:
            gpu.REPLAY_DECODE = mode == "replay"
            VQCache.tiled_decode, tiles.COMPILE_TILES, VQCache.coded_decode = (None if mode == "replay" else mode), comp, coded
            try:
                r = benchmark_layer(["stock", m], seq_lens=(S,), batches=(B,), steps=16, progress=False, prefill_attention=False)
            except Exception as e:
                print(f"{m} B={B}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True); continue
            for x in r: x["tiled"] = ("replayed" if mode == "replay" else (("default" if coded is None else "decoded tiles") if comp else "uncompiled tile decoders") if mode is None else "off (reference path)")
            rows.extend(r); save()
            st, me = r[0], r[1]
            print(f"S={S} B={B} {m:<58} tiled={x['tiled']:<22} {me['us']:9.0f} µs  stock {st['us']:6.0f} µs  ratio {me['ratio']:.3f}  KV {me['kv_bytes']/1e6:.0f} MB", flush=True)
VQCache.tiled_decode, tiles.COMPILE_TILES, VQCache.coded_decode, gpu.REPLAY_DECODE = None, True, None, False
save()
