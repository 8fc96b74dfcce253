"""End-to-end decode/prefill/peak memory on a GPU, every lever side by side in one process (`benchmark_generate`'s
protocol: a random-weight Llama-3.1-8B-shaped model, fp16, 32 layers; `generate_step`, prefill_step_size 2048, 8 untimed
then 64 timed decode steps; one untimed pass of stock, affine and turboquant at each context first). Variants switch `veloxquant.gpu.FUSED_DECODE` (one dispatch per decode step) and the class flags of `VQCache`: `window_buffer` (decode tokens written in
place into the fp16 window, the fused step reads that buffer) and `decoded_prefill` (prefill chunks over codes attend to
the decoded history with the fused SDPA). Usage: python scripts/bench_speed.py OUT_JSON [contexts] [slow_contexts]"""
import json, sys
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.bench import STOCK, _generate_model, _run_one
from veloxquant.cache import VQCache
import veloxquant.gpu as gpu

out = sys.argv[1]
contexts = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8192,32768").split(",")]
slow = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "8192").split(",")]  # contexts for the slow (lever-off) prefills
A, T = "affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3"
variants = [("stock", STOCK, {}, False), ("affine", A, {}, False), ("affine window_buffer=False", A, {"window_buffer": False}, False),
            ("affine decoded_prefill=False", A, {"decoded_prefill": False}, True), ("turboquant", T, {}, False),
            ("turboquant window_buffer=False", T, {"window_buffer": False}, False),
            ("turboquant decoded_prefill=False", T, {"decoded_prefill": False}, True), ("stock (again)", STOCK, {}, False)]
variants[2:2] = [("affine FUSED_DECODE=False", A, {"FUSED_DECODE": False}, False)]
variants[6:6] = [("turboquant FUSED_DECODE=False", T, {"FUSED_DECODE": False}, False)]
if len(sys.argv) > 4 and sys.argv[4] == "short": variants = [v for v in variants if not v[2]]  # defaults only
owner = lambda k: gpu if k == "FUSED_DECODE" else VQCache
m, prompt_fn, label = _generate_model(None, 32)
for spec in (STOCK, A, T): _run_one(m, spec, prompt_fn(64, 1), 2, 0, 2048)  # untimed: compilation
rows = []
for ctx in contexts:
    prompts = prompt_fn(ctx, 1)
    for spec in (STOCK, A, T): _run_one(m, spec, prompts, 2, 0, 2048)  # untimed at this context: per-shape compilation (SDPA, kernels) of every chunk
    for name, spec, flags, is_slow in variants:
        if is_slow and ctx not in slow: continue
        saved = {k: getattr(owner(k), k) for k in flags}
        for k, v in flags.items(): setattr(owner(k), k, v)
        try: r = _run_one(m, spec, prompts, 64, 8, 2048)
        finally:
            for k, v in saved.items(): setattr(owner(k), k, v)
        r.update(variant=name, model=label, mlx=mx.__version__, backend="cuda")
        rows.append(r); print(json.dumps(r), flush=True)
for r in rows:
    b = next(x for x in rows if x["context"] == r["context"] and x["variant"] == "stock")
    r["decode_ratio"], r["prefill_ratio"] = r["decode_tps"] / b["decode_tps"], r["prefill_tps"] / b["prefill_tps"]
    r["peak_target_gb"] = (b["peak_memory_gb"] * 1e9 - 0.7 * (b["kv_bytes"] - r["kv_bytes"])) / 1e9
json.dump(rows, open(out, "w"), indent=1)
print("| context | variant | prefill tok/s | ×stock | decode tok/s | ×stock | peak GB | target GB | KV MB |")
for r in rows:
    print(f"| {r['context']} | {r['variant']} | {r['prefill_tps']:.0f} | {r['prefill_ratio']:.2f} | {r['decode_tps']:.1f} | "
          f"{r['decode_ratio']:.2f} | {r['peak_memory_gb']:.2f} | {r['peak_target_gb']:.2f} | {r['kv_bytes'] / 1e6:.0f} |")
