"""Run under `mlx.launch` by tests/test_distributed.py (and the distributed notebook); also usable alone.

    mlx.launch --backend ring -n 2 -- python tests/distributed_worker.py shard OUT.json
        every registered method, unsharded and tensor-parallel over the ranks (`veloxquant.distributed.shard`)
        on a 2-layer random-weight Llama with 8 query / 4 KV heads: greedy tokens, logits, bytes and heads per rank;
        rank 0 writes OUT.json.
    python tests/distributed_worker.py tiny-model DIR
        writes that Llama shape as an mlx_lm model folder (random weights, the default model's tokenizer) for the
        `veloxquant serve` / `veloxquant eval` tests under mlx.launch.
"""
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

TINY = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


def tiny_llama(vocab_size=256, seed=0):
    "The test shape with seeded random weights (identical on every rank), float32."
    from mlx_lm.models import llama
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(vocab_size=vocab_size, **TINY))
    mx.eval(model.parameters())
    return model


def method_configs():
    "One config per registered method: its defaults with window=0 where it has a window (the test's short contexts would fit a window whole)."
    import veloxquant as vq
    from veloxquant.core import method_ids, get_method
    from veloxquant.evict import eviction_methods
    evict = set(eviction_methods())  # their `window` is the observation window of the prompt, not an fp16 window
    out = []
    for mid in method_ids():
        names = [f.name for f in dataclasses.fields(get_method(mid).config_cls)]
        try: out.append(vq.KVCacheConfig(mid, **({"window": 0} if "window" in names and mid not in evict else {})))
        except ValueError: out.append(vq.KVCacheConfig(mid))  # a method whose window must be >= 1 (svdq, kvtc, a2ats)
    return out


def greedy(model, config, prompt, n):
    from mlx_lm.generate import generate_step
    from veloxquant.builder import KVCacheBuilder
    caches = KVCacheBuilder.for_model(model, config)
    toks, logits = [], []
    # consumed to the end: a generator left early keeps its next step in flight on mlx-lm's generation stream, whose
    # all_sums would then interleave with the next collective of another stream (the ring back-end mixes them up)
    for t, lp in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=n):
        toks.append(int(t)); logits.append(lp)
    mx.eval(logits)
    return toks, mx.stack(logits), caches


def kv_heads(caches):
    "KV heads held by the first layer's cache: axis 1 of the 4-d arrays of its state (codes, exact window, survivors)."
    from mlx.utils import tree_flatten
    arrays = [a for _, a in tree_flatten(caches[0].state) if isinstance(a, mx.array) and a.ndim == 4]
    return int(arrays[0].shape[1])


def shard_check(out, prompt_len=150, n_tokens=12):
    import veloxquant.distributed as dist
    from veloxquant.core import cache_report
    from veloxquant.eval import config_label
    group = dist.world()
    prompt = [(7 * i + 3) % 256 for i in range(prompt_len)]
    full, sharded = tiny_llama(), dist.shard(tiny_llama(), group)
    res = dict(ranks=group.size(), prompt_tokens=prompt_len, generated=n_tokens, model=TINY, methods={})
    for cfg in method_configs():
        try:  # a method that cannot run here (e.g. it needs a calibration artifact) raises on both ranks alike, before any collective
            t_full, l_full, c_full = greedy(full, cfg, prompt, n_tokens)
            t_sh, l_sh, c_sh = greedy(sharded, cfg, prompt, n_tokens)
        except Exception as e:
            res["methods"][cfg.method] = dict(label=config_label(cfg), error=f"{type(e).__name__}: {e}")
            continue
        rec = dict(label=config_label(cfg), config=cfg.to_dict(), tokens_unsharded=t_full, tokens_sharded=t_sh,
                   tokens_equal=t_full == t_sh, top1_agreement=sum(a == b for a, b in zip(t_full, t_sh)) / n_tokens,
                   max_logit_diff=float(mx.abs(l_full - l_sh).max()), unsharded_bytes=int(cache_report(c_full)["nbytes"]),
                   unsharded_layer_bytes=[int(c.nbytes) for c in c_full], unsharded_heads=kv_heads(c_full),
                   rank_bytes=dist.bytes_per_rank(c_sh, group),
                   rank_layer_bytes=dist.all_gather_json([int(c.nbytes) for c in c_sh], group),
                   rank_heads=dist.all_gather_json(kv_heads(c_sh), group),
                   shared_bytes=int(cache_report(c_sh)["shared_bytes"]))
        if cfg.method == "fp16":  # the heads each rank stores are exactly its slice of the unsharded cache's heads
            r, per = group.rank(), rec["rank_heads"][group.rank()]
            keys = lambda c: c.k_store.slice(0, c.k_store.length)["x"]
            same = all(float(mx.abs(keys(a)[:, r * per:(r + 1) * per] - keys(b)).max()) < 1e-5 for a, b in zip(c_full, c_sh))
            rec["fp16_keys_are_head_slices"] = dist.all_gather_json(same, group)
        res["methods"][cfg.method] = rec
    if group.rank() == 0:
        Path(out).write_text(json.dumps(res, indent=1))


def write_tiny_model(folder):
    "An mlx_lm model folder: `TINY` with random weights and the default model's tokenizer (vocabulary 49152)."
    from mlx.utils import tree_flatten
    from veloxquant.models import default_model_path
    src, dst = Path(default_model_path()), Path(folder)
    dst.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists(): shutil.copy(src / name, dst / name)
    model = tiny_llama(vocab)
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    cfg = dict(TINY, vocab_size=vocab, architectures=["LlamaForCausalLM"], max_position_embeddings=4096)
    for k in ("bos_token_id", "eos_token_id"):
        v = json.loads((src / "config.json").read_text()).get(k)
        if v is not None: cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


if __name__ == "__main__":
    cmd, arg = sys.argv[1], sys.argv[2]
    if cmd == "shard": shard_check(arg)
    elif cmd == "tiny-model": print(write_tiny_model(arg))
    else: raise SystemExit(f"unknown command {cmd!r}: shard OUT.json | tiny-model DIR")
