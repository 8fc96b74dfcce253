"""GPU timing of the compiled decode path: one layer's decode step (32 query / 8 KV heads, head_dim 128) at 32k tokens,
B=1 and B=8, with `VQCache.compiled_decode` off (the reference path) and auto (compiled on a GPU back-end), stock
mlx-lm KVCache + fused SDPA side by side. Usage: python scripts/bench_compiled_decode.py [seq_lens] [batches]
e.g. python scripts/bench_compiled_decode.py 32768 1,8  (prints one table; `ratio` = stock µs / method µs)."""
import sys
import veloxquant as vq
from veloxquant.bench import benchmark_layer
from veloxquant.cache import VQCache

METHODS = ["stock", "q4_0", "q8_0", "qjl", "qjl:use_kernels=false", "polar", "turboquant_rvq",
           "affine:key_bits=4,value_bits=4,use_kernels=false", "turboquant:key_bits=3,value_bits=3,use_kernels=false",
           "affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3"]  # the last two: fused kernels, unchanged

seq_lens = tuple(int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32768").split(","))
batches = tuple(int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(","))
res = {}
for mode in (False, None):
    VQCache.compiled_decode = mode
    for r in benchmark_layer(METHODS, seq_lens=seq_lens, batches=batches, steps=24, progress=False):
        res.setdefault((r["S"] if "S" in r else r.get("seq_len"), r.get("B", r.get("batch")), r["method"]), {})[mode] = r
print(f"{'S':>6} {'B':>2} {'method':<58} {'ref µs':>9} {'compiled µs':>12} {'ratio to stock':>15}")
for (S, B, m), d in res.items():
    a, b = d.get(False, {}), d.get(None, {})
    us = lambda r: r.get("us", r.get("median_us", float("nan")))
    print(f"{S!s:>6} {B!s:>2} {m:<58} {us(a):>9.0f} {us(b):>12.0f} {b.get('ratio', float('nan')):>15.3f}")
