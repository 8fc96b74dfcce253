"""A/B of the codebook-pair table layout in turboquant's tensor-core decode kernel (`TQ_MMA_DECODE_BODY`, template LC):
one table shared by the 32 lanes (LC = 1, the default so far) against a copy per lane (LC = 32), alternated
in rounds in one process, each beside its baseline:
  - kernel, `bench.benchmark_tq_decode`: `pipelined_steps` steps back to back against fp16 SDPA (`vs_fp16`);
  - one layer through the cache, `bench.benchmark_layer`: update_and_fetch + mlx-lm's attention, each step evaluated
    on its own, against stock mlx-lm's KVCache (`ratio`).
Usage: python scripts/tq_table_ab.py OUT.json [--rounds N] [--seq-lens 8192,32768] [--batches 1,8] [--affine]"""
import argparse, json, platform
import importlib.metadata as md
import mlx.core as mx
import veloxquant.methods.turboquant as tq
from veloxquant.bench import benchmark_layer, benchmark_tq_decode, STOCK

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("--rounds", type=int, default=2)
p.add_argument("--seq-lens", default="8192,32768"); p.add_argument("--batches", default="1,8")
p.add_argument("--affine", action="store_true", help="also time affine 4/4 through the cache in each round (LC does not touch it)")
a = p.parse_args()
S = [int(x) for x in a.seq_lens.split(",")]; Bs = [int(x) for x in a.batches.split(",")]
meta = dict(machine=platform.node(), mlx=mx.__version__, mlx_lm=md.version("mlx-lm"), device=str(mx.default_device()),
            layer="32 query / 8 KV heads, head_dim 128, float16", method="turboquant:key_bits=3,value_bits=3")
TQ, AFF = "turboquant:key_bits=3,value_bits=3", "affine:key_bits=4,value_bits=4"
rows = []
for r in range(a.rounds):
    for lc in (1, 32):
        tq.TQ_TABLE_COPIES = lc
        for x in benchmark_tq_decode(S, Bs, bits=3):
            rows.append(dict(round=r, LC=lc, kind="kernel", B=x["B"], S=x["S"], us=x["fused_us"], base_us=x["fp16_us"], ratio=x["vs_fp16"]))
        specs = (STOCK, TQ) + (AFF,) * (a.affine and lc == 1)
        lay = benchmark_layer(specs, S, Bs, steps=20, prefill_attention=False, progress=False)
        n0 = len(rows)
        for x in lay:
            if x["method"] != STOCK:
                base = next(y["us"] for y in lay if y["method"] == STOCK and (y["S"], y["B"]) == (x["S"], x["B"]))
                rows.append(dict(round=r, LC=lc, kind="layer" if x["method"] == TQ else "layer affine 4/4", B=x["B"], S=x["S"],
                                 us=x["us"], base_us=base, ratio=x["ratio"]))
        json.dump(dict(meta=meta, rows=rows), open(a.out, "w"), indent=1)
        for x in rows[n0 - len(S) * len(Bs):]:
            print(f"round {x['round']} LC={x['LC']:2d} {x['kind']:6s} B={x['B']} S={x['S']:6d}: {x['us']:7.1f} µs, baseline {x['base_us']:7.1f} µs, x{x['ratio']:.2f}", flush=True)
print("| kind | B | S | LC = 1 (× baseline, median) | LC = 32 |")
print("|---|---|---|---|---|")
for kind in ("kernel", "layer"):
    for B in Bs:
        for s in S:
            med = []
            for lc in (1, 32):
                v = sorted(x["ratio"] for x in rows if (x["kind"], x["B"], x["S"], x["LC"]) == (kind, B, s, lc))
                med.append(f"{v[len(v) // 2]:.2f}" if v else "–")
            print(f"| {kind} | {B} | {s} | {med[0]} | {med[1]} |")
for B in Bs:
    for s in S:
        v = sorted(x["ratio"] for x in rows if (x["kind"], x["B"], x["S"]) == ("layer affine 4/4", B, s))
        if v: print(f"| layer, affine 4/4 (× stock, median of {len(v)}) | {B} | {s} | {v[len(v) // 2]:.2f} | |")
