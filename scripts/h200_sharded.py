"""Tensor-parallel generation on 2 GPUs (NCCL) against 1 GPU: a random-weight Llama-3.1-8B-shaped model (fp16, 32 layers,
32 query / 8 KV heads, head_dim 128, vocab 128256) sharded with mlx-lm's `model.shard(group)`
(`veloxquant.distributed.shard`), stock mlx-lm caches and veloxquant's affine 4/4 and turboquant 3/3.

    python scripts/h200_sharded.py single OUT_DIR [--contexts 32768,131072]      # one process, one GPU
    mlx.launch --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 -- \\
        python scripts/h200_sharded.py sharded OUT_DIR [--contexts 32768,131072]  # one process per GPU

Both build the same weights (seeded). `parity`: a 1024-token random prompt is prefilled, then 32 given tokens are fed one at
a time through fp16 caches (teacher forcing, so both runs score the same positions); the single run saves its logits
(OUT_DIR/parity_single.npy), the sharded run compares with them: relative L2 error of the logits (stated tolerance 1e-2:
an fp16 all_sum over 2 ranks is not bit-exact), the largest absolute difference, and top-1 agreement. `speed`: per method
and context, prefill and `--decode-tokens` greedy decode steps with stock `mlx_lm.generate.generate_step` (the first 8
untimed), decode tok/s, prefill tok/s, the process's peak memory (`mx.get_peak_memory`, weights included) and the cache's
resident bytes, per rank (gathered on rank 0). Records are appended to OUT_DIR/{single,sharded}.jsonl as they finish, so a
run stopped by a time limit keeps what it measured. scripts/h200_sharded.sh runs the whole thing (and the eval sweep).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import veloxquant as vq  # noqa: E402
import veloxquant.distributed as dist  # noqa: E402

METHODS = ["stock", "affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3"]
PARITY_PROMPT, PARITY_STEPS, TOLERANCE = 1024, 32, 1e-2


def llama_8b(n_layers=32, smoke=False):
    "The Llama-3.1-8B shape with seeded random fp16 weights; `smoke`: a 2-layer, 1024-wide model of the same head layout (CPU check of this script)."
    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", hidden_size=1024 if smoke else 4096, num_hidden_layers=2 if smoke else n_layers,
                           intermediate_size=2048 if smoke else 14336, num_attention_heads=8 if smoke else 32,
                           num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, vocab_size=1024 if smoke else 128256,
                           rope_theta=500000.0, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model, args


def caches_for(model, spec):
    from mlx_lm.models.cache import make_prompt_cache
    return make_prompt_cache(model) if spec == "stock" else vq.KVCacheBuilder.for_model(model, vq.parse_method(spec))


def parity_logits(model, vocab):
    toks = mx.random.randint(0, vocab, (PARITY_PROMPT + PARITY_STEPS,), key=mx.random.key(1)).tolist()
    caches = caches_for(model, "fp16")
    for s in range(0, PARITY_PROMPT, 512):
        model(mx.array(toks[s:min(s + 512, PARITY_PROMPT)])[None], cache=caches); mx.eval([c.state for c in caches])
    out = []
    for t in toks[PARITY_PROMPT:]:
        lg = model(mx.array([[t]]), cache=caches)[0, -1].astype(mx.float32)
        mx.eval(lg); out.append(np.array(lg))
    return np.stack(out)


def speed(model, vocab, spec, ctx, decode_tokens, warmup=8):
    from mlx_lm.generate import generate_step
    prompt = mx.random.randint(0, vocab, (ctx,), key=mx.random.key(2))
    caches = caches_for(model, spec)
    mx.clear_cache(); mx.reset_peak_memory()
    total = warmup + decode_tokens + 1
    t0 = time.perf_counter(); times = []
    for _ in generate_step(prompt, model, max_tokens=total, prompt_cache=caches, prefill_step_size=2048):
        times.append(time.perf_counter())
    dist.settle()
    return dict(method=spec, context=ctx, prefill_tps=ctx / (times[0] - t0),
                decode_tps=decode_tokens / (times[-1] - times[warmup]), peak_memory_gb=mx.get_peak_memory() / 1e9,
                kv_bytes=int(sum(c.nbytes for c in caches)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["single", "sharded"])
    p.add_argument("out")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--methods", default=";".join(METHODS))
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--smoke", action="store_true", help="a 2-layer model of the same head layout: checks this script on a CPU")
    a = p.parse_args()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    group = dist.world(); lead = group.rank() == 0
    if (a.mode == "sharded") != (group.size() > 1):
        raise SystemExit(f"mode {a.mode} with {group.size()} rank(s): 'single' runs alone, 'sharded' under mlx.launch -n 2")
    t0 = time.perf_counter()
    model, args = llama_8b(smoke=a.smoke)
    if a.smoke and mx.default_device() == mx.cpu: model.set_dtype(mx.float32)  # CPU float16 is slow
    if a.mode == "sharded": dist.shard(model, group)
    meta = dict(mode=a.mode, ranks=group.size(), mlx=mx.__version__, device=str(mx.default_device()),
                build_s=round(time.perf_counter() - t0, 1), model="smoke: 2 layers, 1024 wide" if a.smoke else "random-weight Llama-3.1-8B shape, fp16, 32 layers")
    log = out / f"{a.mode}.jsonl"

    def record(rec):
        if a.mode == "sharded":  # every rank's numbers, rank order
            per = dist.all_gather_json(rec, group)
            if rec["kind"] == "speed":
                rec = dict(per[0], per_rank=[{k: r[k] for k in ("peak_memory_gb", "kv_bytes", "decode_tps", "prefill_tps")} for r in per])
        if lead:
            with open(log, "a") as f: f.write(json.dumps(dict(rec, **meta)) + "\n")
            print(json.dumps(rec), flush=True)

    if not a.skip_parity:
        lg = parity_logits(model, args.vocab_size)
        if a.mode == "single":
            np.save(out / "parity_single.npy", lg)
            record(dict(kind="parity", saved=str(out / "parity_single.npy")))
        else:
            ref_path = out / "parity_single.npy"
            if ref_path.exists():
                ref = np.load(ref_path)
                rel = float(np.linalg.norm(lg - ref) / np.linalg.norm(ref))
                record(dict(kind="parity", rel_l2=rel, max_abs=float(np.abs(lg - ref).max()),
                            top1_agreement=float((lg.argmax(-1) == ref.argmax(-1)).mean()), tolerance=TOLERANCE,
                            within_tolerance=rel <= TOLERANCE, steps=PARITY_STEPS, prompt=PARITY_PROMPT))
            else:
                record(dict(kind="parity", error=f"{ref_path} missing: run the single mode first"))
    specs = [s for s in a.methods.split(";") if s.strip()]
    for spec in specs:  # untimed: kernel compilation and first allocations stay out of the timed runs
        speed(model, args.vocab_size, spec, 256, 2, warmup=0)
    for ctx in [int(c) for c in a.contexts.split(",") if c.strip()]:
        for spec in specs:
            record(dict(kind="speed", **speed(model, args.vocab_size, spec, ctx, a.decode_tokens)))


if __name__ == "__main__":
    main()
