"""Golden outputs: what every method at its standard settings computes, recorded once before a refactor and
checked bit for bit after it (tests/test_golden.py).

    LD_PRELOAD=<openblas> python tests/golden.py record           # writes tests/golden/*.json and tests/golden/caches/*
    LD_PRELOAD=<openblas> python tests/golden.py record-machine   # adds this kind of machine's bits (same code)

Recorded per configuration (each method id x each of its STANDARD_SETTINGS, `dict()` when it has none):
(plus `EXTRA`, the methods with kernels and the cache features)
- `generate`: the token ids of 24 greedy tokens from stock `mlx_lm.stream_generate` on the default model
  (SmolLM2-135M-Instruct, float32 on CPU) after `compress`, for one chat prompt;
- `decode`: a 128-token prefill of real Wikipedia text through fresh caches, then 256 teacher-forced decode
  steps one token at a time; the sha256 of the float32 logits of all 256 steps (256 x 49152) and, per step,
  the argmax and the max logit (to see where two runs part when the hashes differ);
- `saved cache`: a 2-layer random-weight Llama's caches after a 160-token prompt, written with
  `mlx_lm.models.cache.save_prompt_cache` (tests/golden/caches/<name>.safetensors), and the sha256 of the logits
  of one further step through them. The check loads the stored file with `load_prompt_cache` (the saved-cache
  format of the recording commit) and must get the same logits.
"""
from __future__ import annotations
import hashlib, json, sys
from pathlib import Path
import mlx.core as mx
import numpy as np

GOLDEN = Path(__file__).parent / "golden"
PROMPT_TOKENS, DECODE_STEPS, GEN_TOKENS, TINY_TOKENS = 128, 256, 24, 160
CHAT = "Tell me about the history of anarchism in two sentences."
# beyond STANDARD_SETTINGS: the methods with kernels and the cache features (window, sinks, centering, 'prod')
EXTRA = [("affine-x1", "affine", dict(key_bits=2, value_bits=3, group_size=32, window=32, sinks=4)),
         ("affine-x2", "affine", dict(key_bits=8, value_bits=8)),
         ("turboquant-x1", "turboquant", dict(key_bits=3, value_bits=3, window=64)),
         ("turboquant-x2", "turboquant", dict(key_bits=2.5, value_bits=4, center=True, sinks=4)),
         ("turboquant-x3", "turboquant", dict(key_bits=4, value_bits=3, variant="prod", rotation="orthogonal"))]


# the methods recorded before the layered architecture (their outputs must not move when the code is reorganised);
# methods added since are pinned by their own notebooks' reference tests, and recorded here when they are refactored
GOLDEN_METHODS = ("fp16", "affine", "turboquant", "qjl", "polar", "q4_0", "q8_0", "turboquant_rvq")


def configs() -> list[tuple[str, str, dict]]:
    "(name, method id, options) for every method of GOLDEN_METHODS and each of its standard settings."
    import importlib
    out = []
    for mid in GOLDEN_METHODS:
        mod = importlib.import_module(f"veloxquant.methods.{mid}")
        for i, opts in enumerate(getattr(mod, "STANDARD_SETTINGS", [dict()])):
            out.append((f"{mid}-{i}", mid, dict(opts)))
    return out + EXTRA


def _sha(a: mx.array) -> str:
    return hashlib.sha256(np.asarray(a.astype(mx.float32)).tobytes()).hexdigest()


def tiny_model():
    "The same 2-layer random-weight Llama as tests/conftest.py's `tiny_model`."
    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
                           tie_word_embeddings=True, head_dim=64)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _builder():
    import veloxquant as vq
    return vq.KVCacheConfig, vq.KVCacheBuilder, vq.compress, vq.decompress


def decode_record(model, tokens: list[int], mid: str, opts: dict) -> dict:
    KVCacheConfig, KVCacheBuilder, _, _ = _builder()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(mid, **opts))
    mx.eval(model(mx.array([tokens[:PROMPT_TOKENS]]), cache=caches))
    h, argmax, top = hashlib.sha256(), [], []
    for t in tokens[PROMPT_TOKENS:PROMPT_TOKENS + DECODE_STEPS]:
        lg = model(mx.array([[t]]), cache=caches)[0, -1].astype(mx.float32)
        mx.eval(lg)
        h.update(np.asarray(lg).tobytes())
        argmax.append(int(mx.argmax(lg).item())); top.append(float(lg.max().item()))
    return dict(sha256=h.hexdigest(), argmax=argmax, max_logit=top)


def generate_record(model, tokenizer, mid: str, opts: dict) -> list[int]:
    import mlx_lm
    KVCacheConfig, _, compress, decompress = _builder()
    compress(model, KVCacheConfig(mid, **opts))
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True)
        return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt=prompt, max_tokens=GEN_TOKENS)]
    finally:
        decompress(model)


def tiny_tokens() -> list[int]:
    return [int(x) for x in np.random.default_rng(0).integers(0, 128, TINY_TOKENS + 1)]


def saved_cache_record(name: str, mid: str, opts: dict, write: bool) -> str:
    "Save (when `write`) the tiny model's caches after the prompt; return the sha256 of one further step through the stored file."
    return _sha(saved_cache_logits(name, mid, opts, write))


def saved_cache_logits(name: str, mid: str, opts: dict, write: bool = False) -> mx.array:
    "The float32 logits [vocab] of one further step of the tiny model through its stored caches (saved first when `write`)."
    from mlx_lm.models.cache import save_prompt_cache, load_prompt_cache
    KVCacheConfig, KVCacheBuilder, _, _ = _builder()
    model, toks = tiny_model(), tiny_tokens()
    path = GOLDEN / "caches" / f"{name}.safetensors"
    if write:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(mid, **opts))
        mx.eval(model(mx.array([toks[:TINY_TOKENS]]), cache=caches))
        path.parent.mkdir(parents=True, exist_ok=True)
        save_prompt_cache(str(path), caches)
    caches = load_prompt_cache(str(path))
    return model(mx.array([toks[TINY_TOKENS:]]), cache=caches)[0, -1].astype(mx.float32)


def record(names: list[str] | None = None) -> None:
    from veloxquant.models import load_model, eval_tokens
    model, tokenizer = load_model()
    tokens = eval_tokens(tokenizer, PROMPT_TOKENS + DECODE_STEPS)
    GOLDEN.mkdir(exist_ok=True)
    import mlx_lm
    for name, mid, opts in configs():
        if names and name not in names: continue
        rec = dict(method=mid, options=opts, mlx=mx.__version__, mlx_lm=mlx_lm.__version__, machine=machine(),
                   generate=generate_record(model, tokenizer, mid, opts),
                   decode=decode_record(model, tokens, mid, opts),
                   saved_cache=saved_cache_record(name, mid, opts, write=True),
                   saved_cache_logits=np.asarray(saved_cache_logits(name, mid, opts)).tolist())
        (GOLDEN / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(name, rec["decode"]["sha256"][:12], rec["generate"][:8], flush=True)


def machine() -> str:
    "The CPU model and family, and the BLAS preloaded: float32 results are bit-identical only on the same kind of machine (`VELOXQUANT_GOLDEN_MACHINE` overrides it)."
    import os, platform
    if os.environ.get("VELOXQUANT_GOLDEN_MACHINE"): return os.environ["VELOXQUANT_GOLDEN_MACHINE"]
    info = {}
    try:
        for line in open("/proc/cpuinfo"):
            k, _, v = line.partition(":")
            if k.strip() in ("model name", "cpu family", "model") and k.strip() not in info: info[k.strip()] = v.strip()
    except OSError: pass
    cpu = " / ".join(f"{k} {v}" for k, v in info.items()) or platform.processor() or platform.machine()
    return f"{cpu}; LD_PRELOAD={os.path.basename(os.environ.get('LD_PRELOAD', '')) or '-'}"


def record_machine() -> None:
    """Add this kind of machine's bits to every recording, from the code as it is (run it only on code whose outputs
    match the recordings bit for bit on their own kind of machine, or within tolerance here): `machines[machine()]`
    holds the greedy tokens, the decode sha256 and the saved cache's sha256 where any of them differs from the
    primary recording's; `saved_cache_logits` keeps the saved cache's logits for the tolerance check elsewhere."""
    from veloxquant.models import load_model, eval_tokens
    model, tokenizer = load_model()
    tokens = eval_tokens(tokenizer, PROMPT_TOKENS + DECODE_STEPS)
    fp = machine()
    for p in sorted(GOLDEN.glob("*.json")):
        rec = json.loads(p.read_text()); mid, opts = rec["method"], rec["options"]
        lg = saved_cache_logits(p.stem, mid, opts)
        mine = dict(generate=generate_record(model, tokenizer, mid, opts), decode_sha256=decode_record(model, tokens, mid, opts)["sha256"],
                    saved_cache=_sha(lg))
        rec.setdefault("saved_cache_logits", np.asarray(lg).tolist())
        same = (mine["generate"] == rec["generate"], mine["decode_sha256"] == rec["decode"]["sha256"], mine["saved_cache"] == rec["saved_cache"])
        if not all(same): rec.setdefault("machines", {})[fp] = mine
        p.write_text(json.dumps(rec, indent=1) + "\n")
        print(p.stem, "equal to the primary recording" if all(same) else f"recorded for {fp} (equal: generate, decode, saved cache = {same})", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["record-machine"]: sys.exit(record_machine())
    if sys.argv[1:2] != ["record"]: sys.exit(__doc__)
    record(sys.argv[2:] or None)
