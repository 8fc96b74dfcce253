"""Record which prompt tokens NVIDIA kvpress 0.5.5 keeps, per layer and KV head, on veloxquant's default model.

Runs ONLY in a separate environment with the optional extra `kvpress` (torch, transformers, kvpress==0.5.5); it does
not import mlx or veloxquant. The prompt (token ids of the evaluation text) and the model folder come from
`tests/kvpress_reference/prompt.json`, written by `scripts/kvpress_prompt.py` in veloxquant's own environment.

For each press and each kvpress `compression_ratio` (fraction of the prompt's tokens REMOVED; veloxquant's `budget`
is 1 - ratio) it runs the press on the prompt exactly as kvpress's pipeline does (prefill under the press's context
manager; CAM, a decode-time press, by prefilling `target_size` tokens and feeding the rest one token at a time), and
records the kept token positions of every (layer, KV head):
- presses that really prune the cache: each kept key is matched bit for bit to the key it was gathered from (post-RoPE
  keys of distinct positions differ), which gives its position; CAM's repeated prunings are chained the same way;
- presses that only mask (AdaKV, KVzip: `module.masked_key_indices`): kept = all positions minus the masked ones.
It also records the scores the press's scorer returned (the boundary between kept and dropped: lowest kept score,
highest dropped score, ties), the press's parameters and the wall time of the compression run. Output:
`tests/kvpress_reference/<method id>.json`, the files `tests/test_kvpress_compare.py` compares veloxquant with.

Usage (see tests/kvpress_reference/README.md):
  OMP_NUM_THREADS=1 nice /work/kvpress-venv/bin/python scripts/kvpress_reference.py [--press snapkv,tova]
      [--ratios 0.25,0.5,0.75] [--prompt tests/kvpress_reference/prompt.json] [--out tests/kvpress_reference]
      [--check-logits /tmp/mlx_logits.npy]
"""
import argparse
import base64
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

import kvpress
from kvpress import (AdaKVPress, CAMPress, ChunkKVPress, CURPress, KnormPress, KVzipPress, ObservedAttentionPress,
                     PyramidKVPress, QFilterPress, SnapKVPress, StreamingLLMPress, TOVAPress)

ROOT = Path(__file__).resolve().parents[1]
RATIOS = (0.25, 0.5, 0.75)
CAM_SEED = 0
QFILTERS = None    # (n_layers, n_kv_heads, head_dim) float32: veloxquant's calibrated filters (--qfilters)


# ---------------------------------------------------------------- the presses, by veloxquant method id
def make_press(method: str, ratio: float, n_tokens: int):
    """(press, attn_implementation, notes) for veloxquant method id `method` at kvpress compression_ratio `ratio`."""
    if method == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5), "sdpa"
    if method == "streaming_llm":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=4), "sdpa"
    if method == "tova":
        return TOVAPress(compression_ratio=ratio), "sdpa"
    if method == "pyramidkv":
        return PyramidKVPress(compression_ratio=ratio, window_size=64, kernel_size=5, beta=20), "sdpa"
    if method == "chunkkv":
        return ChunkKVPress(press=SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
                            chunk_length=20), "sdpa"
    if method == "knorm":
        return KnormPress(compression_ratio=ratio), "sdpa"
    if method == "curdkv":
        return CURPress(compression_ratio=ratio), "sdpa"
    if method == "adakv":
        return AdaKVPress(press=SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5),
                          alpha_safeguard=0.20), "sdpa"
    if method == "h2o":
        return ObservedAttentionPress(compression_ratio=ratio), "eager"   # needs the attention weights
    if method == "kvzip":
        return KVzipPress(compression_ratio=ratio, layerwise=False, n_sink=4), "sdpa"
    if method == "qfilters":   # kvpress would download hub filters (none exist for this model): given veloxquant's
        press = QFilterPress(compression_ratio=ratio)      # kvpress scores -<f, k>; veloxquant keeps the largest <u, k>: f = -u
        press.post_init_from_model = lambda model: None
        press.q_filters = -torch.tensor(QFILTERS)
        return press, "sdpa"
    if method == "cam":
        target = int(n_tokens * (1 - ratio))       # kvpress's own rounding (compute_n_kept)
        return CAMPress(base_press=TOVAPress(), compression_interval=1, target_size=target, merge_budget=32), "sdpa"
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


# presses whose selection is a top-k of per-token scores that do not depend on the ratio: their scores are stored
SCORED = ("snapkv", "tova", "knorm", "curdkv", "h2o", "kvzip", "qfilters")
METHODS = ("snapkv", "streaming_llm", "tova", "pyramidkv", "chunkkv", "cam", "knorm", "kvzip", "curdkv", "adakv", "h2o", "qfilters")


def press_params(press) -> dict:
    "The press's dataclass fields (wrapped presses nested), plus its class name."
    out = {"class": type(press).__name__}
    for f in dataclasses.fields(press):
        v = getattr(press, f.name)
        if isinstance(v, torch.Tensor): continue       # QFilterPress's filters: recorded apart (`filters`)
        out[f.name] = press_params(v) if dataclasses.is_dataclass(v) else v
    return out


# ---------------------------------------------------------------- recording
class Recorder:
    """Wraps a press's compress (and its scorer's score) on the instance to record, per layer, which cache slots
    survive and the scores the selection was made on."""

    def __init__(self, press, n_layers: int, n_kv: int, n_tokens: int):
        self.press, self.n_tokens = press, n_tokens
        self.n_kv = n_kv
        self.slots = {l: [list(range(n_tokens))] * n_kv for l in range(n_layers)}   # [head][cache slot] -> position
        self.scores = {}                                                      # layer -> (n_kv_heads, n) float64
        self.calls = {l: 0 for l in range(n_layers)}
        self.overhead = 0.0                     # seconds spent recording, subtracted from the press's time
        self.position = n_tokens - 1            # position of the newest token in the cache (CAM's decode loop sets it)
        scorer = getattr(press, "press", None) or getattr(press, "base_press", None) or press
        if hasattr(scorer, "score") and not isinstance(press, KVzipPress):
            orig_score = scorer.score

            def score(module, *a, **k):
                s = orig_score(module, *a, **k)
                self.scores[int(module.layer_idx)] = s[0].detach().to(torch.float64).clone()
                return s
            scorer.score = score
        if isinstance(press, KVzipPress):
            orig_post = press.compress_post

            def compress_post(model):
                self.kvzip_scores = press.score_val[:, 0].detach().to(torch.float64).clone()
                return orig_post(model)
            press.compress_post = compress_post
            return
        orig = press.compress

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            l = int(module.layer_idx)
            n_new = keys.shape[2] - len(self.slots[l][0])     # tokens appended since the last pruning (CAM)
            fresh = list(range(self.position - n_new + 1, self.position + 1))
            slots = [s + fresh for s in self.slots[l]]
            k_in = keys.detach().clone()
            k_out, v_out = orig(module, hidden_states, keys, values, attentions, kwargs)
            self.calls[l] += 1
            if k_out.shape[2] == k_in.shape[2] and torch.equal(k_out, k_in):
                self.slots[l] = slots                              # nothing pruned (AdaKV masks instead)
                return k_out, v_out
            t1 = time.perf_counter()
            for h in range(k_in.shape[1]):
                where = {row.tobytes(): i for i, row in enumerate(k_in[0, h].numpy())}
                if len(where) != k_in.shape[2]: raise RuntimeError(f"layer {l} head {h}: two input keys are equal")
                slots[h] = [slots[h][where[row.tobytes()]] for row in k_out[0, h].detach().numpy()]
            self.overhead += time.perf_counter() - t1
            self.slots[l] = slots
            return k_out, v_out
        press.compress = compress


def kept_sets(model, rec: Recorder, n_layers: int, n_kv: int, press) -> list[list[list[int]]]:
    "kept[layer][head] = sorted prompt positions held after the press ran."
    kept = []
    for l in range(n_layers):
        attn = model.model.layers[l].self_attn
        masked = getattr(attn, "masked_key_indices", None)
        if isinstance(press, (AdaKVPress, KVzipPress)):
            keep = np.ones((n_kv, rec.n_tokens), bool)
            if masked is not None:
                _, hi, si = masked
                keep[hi.numpy(), si.numpy()] = False
            kept.append([np.flatnonzero(keep[h]).tolist() for h in range(n_kv)])
        else:
            if masked is not None: raise RuntimeError(f"{type(press).__name__} left masked_key_indices")
            kept.append([sorted(rec.slots[l][h]) for h in range(n_kv)])
    return kept


def boundary(scores: torch.Tensor, kept: list[list[int]]) -> list[list]:
    "Per head [lowest kept score, highest dropped score, dropped tokens tied with the lowest kept] (None if no drop)."
    out = []
    for h, ks in enumerate(kept):
        s = scores[h].numpy()
        mask = np.zeros(s.shape[0], bool); mask[ks] = True
        if mask.all(): out.append(None); continue
        lo, hi = float(s[mask].min()), float(s[~mask].max())
        out.append([float(f"{lo:.7g}"), float(f"{hi:.7g}"), int((s[~mask] == lo).sum())])
    return out


def mask_hex(positions: list[int]) -> str:
    "Kept positions as a hex integer whose bit i is token i (decode: [i for i in range(n) if int(s, 16) >> i & 1])."
    return format(sum(1 << i for i in positions), "x")


# ---------------------------------------------------------------- running one press
def run_press(model, method: str, ratio: float, ids: torch.Tensor) -> dict:
    n = ids.shape[1]
    cfg = model.config
    n_layers, n_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    press, attn_impl = make_press(method, ratio, n)
    model.set_attn_implementation(attn_impl)
    for layer in model.model.layers:          # a mask from an earlier press must not leak into this one
        layer.self_attn.masked_key_indices = None
    rec = Recorder(press, n_layers, n_kv, n)
    cache = DynamicCache()
    schedule = {"prefill_tokens": n, "decode_steps": 0}
    t0 = time.perf_counter()
    with torch.no_grad():
        if isinstance(press, CAMPress):
            torch.manual_seed(CAM_SEED)
            p = press.target_size
            rec.slots = {l: [list(range(p))] * n_kv for l in range(n_layers)}
            model.model(input_ids=ids[:, :p], past_key_values=cache)          # CAM does nothing at prefill
            with press(model):
                for t in range(p, n):
                    rec.position = t
                    model.model(input_ids=ids[:, t:t + 1], past_key_values=cache,
                                position_ids=torch.tensor([[t]]))
            schedule = {"prefill_tokens": p, "decode_steps": n - p, "compression_interval": 1,
                        "seed": f"torch.manual_seed({CAM_SEED}) before the prefill"}
        elif isinstance(press, KVzipPress):
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
                press.prefix_length = 0    # raw text, no chat prefix: reconstruct (and score) every prompt token
        else:
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
    seconds = time.perf_counter() - t0 - rec.overhead
    kept = kept_sets(model, rec, n_layers, n_kv, press)
    held = [cache.layers[l].keys.shape[2] for l in range(n_layers)]
    run = {"compression_ratio": ratio, "budget": round(1 - ratio, 6), "seconds": round(seconds, 3),
           "schedule": schedule, "cache_len_after": held,
           "kept_counts": [[len(k) for k in kl] for kl in kept],
           "kept_hex": [[mask_hex(k) for k in kl] for kl in kept]}
    if isinstance(press, KVzipPress):
        run["boundary"] = [boundary(rec.kvzip_scores[l], kept[l]) for l in range(n_layers)]
    elif rec.scores and not isinstance(press, (ChunkKVPress, CAMPress)):
        run["boundary"] = [boundary(rec.scores[l], kept[l]) for l in range(n_layers)]
    if isinstance(press, CAMPress):
        run["prunings_per_layer"] = rec.calls[0]
    scores = None
    if method in SCORED:
        sc = rec.kvzip_scores if isinstance(press, KVzipPress) else torch.stack([rec.scores[l] for l in range(n_layers)])
        scores = sc.to(torch.float32).numpy()                       # (n_layers, n_kv_heads, n_tokens)
    params = press_params(press)
    if isinstance(press, KVzipPress):   # not a dataclass field: set by this script (README, kvzip)
        params["prefix_length"] = 0
    return {"params": params, "attn_implementation": attn_impl, "run": run, "scores": scores}


# ---------------------------------------------------------------- main
def check_logits(model, ids: list[int], path: str) -> dict:
    ref = np.load(path)
    with torch.no_grad():
        lg = model(torch.tensor([ids[:ref.shape[0]]])).logits[0].double().numpy()
    ref = ref.astype(np.float64)

    def lsm(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    p, q = lsm(ref), lsm(lg)
    return {"tokens": int(ref.shape[0]), "max_abs_logit_diff": float(np.abs(lg - ref).max()),
            "max_abs_logit": float(np.abs(ref).max()),
            "top1_agreement": float((lg.argmax(-1) == ref.argmax(-1)).mean()),
            "max_kl_mlx_to_torch": float((np.exp(p) * (p - q)).sum(-1).max())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default=str(ROOT / "tests/kvpress_reference/prompt.json"))
    ap.add_argument("--out", default=str(ROOT / "tests/kvpress_reference"))
    ap.add_argument("--press", default=",".join(METHODS), help="comma-separated veloxquant method ids")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--check-logits", default=None, help="mlx-lm logits (.npy from scripts/kvpress_prompt.py)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cam-seed", type=int, default=CAM_SEED, help="torch seed of CAM's Bernoulli merges")
    ap.add_argument("--qfilters", default=None, help="veloxquant's Q-Filters directions, .npy (n_layers, n_kv_heads, head_dim)")
    a = ap.parse_args(argv)
    globals()["CAM_SEED"] = a.cam_seed
    if a.qfilters: globals()["QFILTERS"] = np.load(a.qfilters).astype(np.float32)
    torch.set_num_threads(a.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    prompt = json.loads(Path(a.prompt).read_text())
    ids = prompt["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(prompt["model_path"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    if a.check_logits:
        r = check_logits(model, ids, a.check_logits)
        print("logits vs mlx-lm:", json.dumps(r))
        Path(a.out, "logits_check.json").write_text(json.dumps(r, indent=1) + "\n")
    x = torch.tensor([ids])
    with torch.no_grad():                                   # the plain prefill, for scale
        t0 = time.perf_counter(); model.model(input_ids=x, past_key_values=DynamicCache())
        plain = time.perf_counter() - t0
    env = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "threads": torch.get_num_threads(), "plain_prefill_seconds": round(plain, 3)}
    from importlib.metadata import version
    env["kvpress"] = version("kvpress")
    sha = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    for method in filter(None, a.press.split(",")):
        runs, params, scores = [], [], None
        for ratio in (float(r) for r in a.ratios.split(",")):
            r = run_press(model, method, ratio, x)
            runs.append(r["run"]); params.append(r["params"])
            if r["scores"] is not None and scores is None: scores = r["scores"]
            print(f"{method:14s} ratio {ratio:.2f}: {r['run']['seconds']:7.2f} s, kept per layer (head 0) "
                  f"{[c[0] for c in r['run']['kept_counts']][:6]}...", flush=True)
        out = {"method": method, "kvpress_class": params[0]["class"], "params": params[0],
               "params_per_ratio": params if len({json.dumps(p, sort_keys=True) for p in params}) > 1 else None,
               "attn_implementation": r["attn_implementation"], "dtype": "float32", "device": "cpu",
               "model": {"path": prompt["model_path"], "n_layers": model.config.num_hidden_layers,
                         "n_heads": model.config.num_attention_heads, "n_kv_heads": model.config.num_key_value_heads},
               "prompt": {"file": "prompt.json", "n_tokens": len(ids), "sha256_of_json_ids": sha},
               "env": env, "kept_encoding": "kept_hex[layer][kv_head]: hex int, bit i set = prompt token i kept",
               "runs": runs}
        if scores is not None:
            out["scores"] = {"shape": list(scores.shape), "dtype": "float32 little-endian",
                             "note": "the scorer's output at the first ratio, as the selection saw it (before kvzip's "
                                     "sink override); decode: np.frombuffer(base64.b64decode(b64), '<f4').reshape(shape)",
                             "b64": base64.b64encode(scores.astype("<f4").tobytes()).decode()}
        if method == "qfilters":
            out["filters"] = {"source": "veloxquant calibrate --method qfilters (default model), layer{i}/filter stacked",
                              "sha256_float32": hashlib.sha256(QFILTERS.tobytes()).hexdigest(),
                              "given_to_kvpress_as": "q_filters = -filters (kvpress scores -<f, k>)"}
        elif method in ("pyramidkv", "adakv", "chunkkv"):
            out["scores_from"] = "snapkv.json (same SnapKVPress scorer and parameters)"
        Path(a.out, f"{method}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
