"""A/B of one switch of turboquant's tensor-core decode kernel, alternated in rounds in one process:
  --switch fwht: `TQ_FWHT_QUERIES` off / on (the queries rotated by R's D² floats per threadgroup, or by butterflies);
  --switch lc:   `TQ_TABLE_COPIES` 1 / 32 (one codebook-pair table shared by the lanes, or a copy per lane).
Each round and setting times
  - the kernel, `bench.benchmark_tq_decode`: `pipelined_steps` steps back to back against fp16 SDPA (`ratio` = fp16 / it);
  - one layer through the cache queued as a model's forward (`bench.benchmark_layer(layers=depth)`), stock mlx-lm's
    KVCache and affine 4/4 beside it (`ratio` = stock µs / turboquant µs).
Usage: python scripts/tq_switch_ab.py OUT.json --switch fwht [--rounds 3] [--seq-lens 8192,32768] [--batches 1,8]"""
import argparse, json, platform, statistics
import importlib.metadata as md
import mlx.core as mx
import veloxquant.methods.turboquant as tq
from veloxquant.bench import benchmark_layer, benchmark_tq_decode, STOCK

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("--switch", choices=("fwht", "lc"), required=True)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--seq-lens", default="8192,32768"); p.add_argument("--batches", default="1,8")
a = p.parse_args()
S = [int(x) for x in a.seq_lens.split(",")]; Bs = [int(x) for x in a.batches.split(",")]
name, values = {"fwht": ("TQ_FWHT_QUERIES", (False, True)), "lc": ("TQ_TABLE_COPIES", (1, 32))}[a.switch]
TQ, AFF = "turboquant:key_bits=3,value_bits=3", "affine:key_bits=4,value_bits=4"
meta = dict(machine=platform.node(), mlx=mx.__version__, mlx_lm=md.version("mlx-lm"), device=str(mx.default_device()),
            layer="32 query / 8 KV heads, head_dim 128, float16", method=TQ, switch=name, values=list(values))
rows = []
for r in range(a.rounds):
    for val in (values if r % 2 == 0 else values[::-1]):  # the order alternates between rounds
        setattr(tq, name, val)
        for x in benchmark_tq_decode(S, Bs, bits=3):
            rows.append(dict(round=r, value=val, kind="kernel", B=x["B"], S=x["S"], us=x["fused_us"], base_us=x["fp16_us"], ratio=x["vs_fp16"]))
        for B in Bs:
            lay = benchmark_layer((STOCK, TQ, AFF), S, [B], steps=12, prefill_attention=False, progress=False, layers=32 if B == 1 else 8)
            for x in lay:
                if x["method"] == STOCK: continue
                base = next(y["us"] for y in lay if y["method"] == STOCK and y["S"] == x["S"])
                rows.append(dict(round=r, value=val, kind="layer" if x["method"] == TQ else "layer affine", B=B, S=x["S"], us=x["us"], base_us=base, ratio=x["ratio"]))
        json.dump(dict(meta=meta, rows=rows), open(a.out, "w"), indent=1)
        for x in rows:
            if (x["round"], x["value"]) == (r, val):
                print(f"round {r} {name}={val} {x['kind']:12s} B={x['B']} S={x['S']:6d}: {x['us']:7.1f} µs, baseline {x['base_us']:7.1f} µs, x{x['ratio']:.2f}", flush=True)
print(f"| kind | B | S | {name} = {values[0]} (× baseline, median) | {name} = {values[1]} |\n|---|---|---|---|---|")
for kind in ("kernel", "layer", "layer affine"):
    for B in Bs:
        for s in S:
            med = [statistics.median(v) if (v := [x["ratio"] for x in rows if (x["kind"], x["B"], x["S"], x["value"]) == (kind, B, s, val)]) else None for val in values]
            if any(m is not None for m in med): print(f"| {kind} | {B} | {s} | " + " | ".join("–" if m is None else f"{m:.2f}" for m in med) + " |")
