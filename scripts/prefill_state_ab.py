"""What the cache-state checksum costs end to end: mlx-lm's `generate_step` evaluates every layer's `state` after each
prefill chunk, and a veloxquant cache's `state` carried a checksum over all it stores. B = 1 runs of `benchmark_generate`'s
protocol (random-weight Llama-3.1-8B-shaped model on a GPU), the variants in turn for `--rounds` rounds: stock mlx-lm,
then each spec as shipped ("unsealed": reads from mlx-lm's generation loop get no checksum) and "sealed" (every read
sealed, as before: `veloxquant.cache._read_for_eval` forced False; turboquant's own getter seals twice, as it did).
Prints prefill / decode tok/s and peak GB. (Session 18's first run of this script, before the change, compared the
checksum compiled / op by op / "none"; its "none" patched `seal_state` only where `veloxquant.cache` calls it, so
turboquant's own getter still sealed once there.)

    python scripts/prefill_state_ab.py OUT.json [--contexts 8192,32768] [--rounds 2]
"""
import argparse, json, statistics
import mlx.core as mx
import veloxquant  # noqa: F401
import veloxquant.cache as vc
from veloxquant import bench

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--contexts", default="8192,32768")
ap.add_argument("--rounds", type=int, default=2); ap.add_argument("--decode", type=int, default=32)
ap.add_argument("--specs", default="affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3")
a = ap.parse_args()

SHIPPED = vc._read_for_eval
VARIANTS = {"unsealed": SHIPPED, "sealed": lambda: False}

model, prompts, label = bench._generate_model(None, 32)
res = dict(model=label, mlx=mx.__version__, rounds=a.rounds, runs=[])
specs = a.specs.split(";")
for ctx in [int(c) for c in a.contexts.split(",")]:
    p = prompts(ctx, 1)
    bench._run_one(model, bench.STOCK, prompts(min(ctx, 4160), 1), 2, 0, 2048)
    for s in specs: bench._run_one(model, s, prompts(min(ctx, 4160), 1), 2, 0, 2048)  # warm-up (kernels, compiled functions)
    for r in range(a.rounds):
        for spec, var in [(bench.STOCK, "-")] + [(s, v) for s in specs for v in VARIANTS]:
            if var != "-": vc._read_for_eval = VARIANTS[var]
            try: rec = bench._run_one(model, spec, p, a.decode, 4, 2048)
            finally: vc._read_for_eval = SHIPPED
            rec.update(variant=var, round=r); res["runs"].append(rec)
            print(f"{ctx:6d} r{r} {spec[:34]:34s} {var:9s} prefill {rec['prefill_tps']:8.0f} tok/s  decode {rec['decode_tps']:6.1f}  peak {rec['peak_memory_gb']:.3f} GB", flush=True)
    for spec, var in [(bench.STOCK, "-")] + [(s, v) for s in specs for v in VARIANTS]:
        rs = [x for x in res["runs"] if x["context"] == ctx and x["method"] == spec and x["variant"] == var]
        print(f"median {ctx} {spec[:34]:34s} {var:9s} prefill {statistics.median(x['prefill_tps'] for x in rs):8.0f}  peak max {max(x['peak_memory_gb'] for x in rs):.3f}", flush=True)
json.dump(res, open(a.out, "w"), indent=1)
