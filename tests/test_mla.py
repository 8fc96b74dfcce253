"""MLA families (deepseek_v3 and its kimi_vl / kimi_k25 wrappers, glm4_moe_lite, mistral4) as tiny random-weight models
through `veloxquant.mla`: fp16 gives stock mlx-lm's greedy tokens (and logits) exactly, the exact reference path the same
tokens, every served per-token quantizer runs and stays close (KL to stock over decode steps, bounds below), decode attends
over the latent codes one block at a time, save/load round trips with its checksum, trim is exact, fp16 batches and
quantized batches are refused, and every method or MLA variant that cannot be served is refused at build time."""
import functools, importlib, sys, warnings
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, BatchGenerator
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache, load_prompt_cache, RotatingKVCache

sys.path.insert(0, str(Path(__file__).parent))
from test_architectures import BASE, method_configs  # noqa: E402

import veloxquant as vq  # noqa: E402
from veloxquant.mla import MLACache, MLAFP16Cache, batch_refusal  # noqa: E402

MLA = dict(kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=None,
           n_shared_experts=None, moe_intermediate_size=64, routed_scaling_factor=1.0, first_k_dense_replace=0, n_group=1,
           topk_group=1, num_experts_per_tok=2, num_key_value_heads=4)
ROPE4 = dict(rope_theta=10000.0, llama_4_scaling_beta=0.1, original_max_position_embeddings=512, rope_type="default")
ARGS = {  # MoE layers and a low-rank query in glm4_moe_lite / mistral4, dense ones in deepseek_v3 and its wrappers
    "deepseek_v3": dict(BASE, **MLA),
    "glm4_moe_lite": dict(BASE, **dict(MLA, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32)),
    "mistral4": dict(BASE, **dict(MLA, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1), rope_parameters=ROPE4),
    "kimi_vl": dict(text_config=dict(BASE, **MLA, model_type="deepseek_v3")),
    "kimi_k25": dict(text_config=dict(BASE, **MLA, model_type="deepseek_v3")),
}
FAMILIES = list(ARGS)
PROMPT = mx.array([(7 * i + 3) % 100 for i in range(96)])


@functools.cache
def build(family, **kw):
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(dict(ARGS[family], model_type=family, **kw)))
    mx.eval(model.parameters())
    return model


def greedy(model, cache, n=16):
    "Greedy tokens through `generate_step` (prefill in chunks of 16: later chunks attend over a history)."
    return [t for (t, _), _ in zip(generate_step(PROMPT[:40], model, prompt_cache=cache, max_tokens=n, prefill_step_size=16), range(n))]


def run(model, cache, n=96):
    "Logits of a 32-token prefill, a second 16-token prefill chunk over the history, then one-token decode steps up to n."
    outs = [model(PROMPT[None, :32], cache=cache), model(PROMPT[None, 32:48], cache=cache)]
    outs += [model(PROMPT[None, i:i + 1], cache=cache) for i in range(48, n)]
    return mx.concatenate(outs, 1)


def kl(ref, out):
    "Mean KL(stock || compressed) over the decode steps (positions 48..)."
    lp, lq = (x[:, 48:].astype(mx.float32) - mx.logsumexp(x[:, 48:].astype(mx.float32), -1, keepdims=True) for x in (ref, out))
    return (mx.exp(lp) * (lp - lq)).sum(-1).mean().item()


@functools.cache
def stock(family):
    m = build(family)
    return greedy(m, make_prompt_cache(m)), run(m, make_prompt_cache(m))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_is_stock(family):
    "fp16: greedy tokens and logits bit-identical to stock mlx-lm; the exact reference path (codes = exact latent) gives the same tokens."
    m = build(family)
    toks, ref = stock(family)
    caches = vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("fp16"))
    assert all(type(c) is MLAFP16Cache for c in caches)
    assert greedy(m, caches) == toks
    assert mx.array_equal(run(m, vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("fp16"))), ref).item()
    exact = vq.KVCacheConfig("fp16", reference=True)
    caches = vq.KVCacheBuilder.for_model(m, exact)
    assert all(type(c) is MLACache for c in caches)
    assert greedy(m, caches) == toks
    assert mx.abs(run(m, vq.KVCacheBuilder.for_model(m, exact)) - ref).max().item() < 1e-4
    vq.compress(m, vq.KVCacheConfig("fp16"))  # the three lines: stock generate_step over model.make_cache()
    try: assert greedy(m, None) == toks
    finally: vq.decompress(m)


# KL bounds (measured on these tiny models: affine 4/4 ≤ 3.6e-3, turboquant 3/3 ≤ 1.1e-2, mistral4 the largest)
QUANT = {"affine": (dict(key_bits=4, value_bits=4, group_size=32, window=0), 2e-2),
         "turboquant": (dict(key_bits=3, value_bits=3, window=0), 5e-2)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", QUANT)
def test_quantized_close(family, method):
    m = build(family)
    opts, bound = QUANT[method]
    caches = vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig(method, **opts))
    out = run(m, caches)
    assert mx.isfinite(out).all().item()
    assert kl(stock(family)[1], out) < bound
    c = caches[0]
    assert c.k_store.length == 96 and c.k_exact is None  # every latent is codes (no window)
    assert c.n_elements == 96 * (64 + 16)
    for c in caches:  # honest bytes: the latent codes and the exact RoPE keys with their 256-token headroom, nothing else
        assert c.pending is None and c.nbytes == c.k_store.nbytes + c.v_store.nbytes
        assert c.v_store.nbytes == 256 * 16 * 4 and c.k_store.nbytes < 256 * 64 * 2 // 3  # float32 k_pe; latent under 1/3 of fp16


def served_configs():
    "Every method's first standard setting (group sizes 32) with a window of 8 where it has one, calibrated methods left out."
    for cfg in method_configs():
        o = cfg.to_dict(); o.pop("method")
        if "window" in o: o["window"] = 8
        try: yield vq.KVCacheConfig(cfg.method, **o)
        except ValueError: yield cfg  # a method whose window must be longer keeps its standard one


SERVED = ["affine", "gear", "kitty", "kivi", "kivi_sink", "polar", "q4_0", "q8_0", "qjl", "rabitq", "turboquant", "turboquant_rvq"]


@pytest.mark.parametrize("family", ["deepseek_v3", "mistral4"])
def test_every_method_served_or_refused(family):
    """Every registered method either serves the MLA layers (runs, finite, KL < 0.5: the 1-bit sign sketches qjl/rabitq are
    the loosest) or is refused at build time with a message naming the method and the family."""
    m = build(family)
    ref = stock(family)[1]
    served = []
    for cfg in served_configs():
        try: caches = vq.KVCacheBuilder.for_model(m, cfg)
        except ValueError as e:
            assert str(e).startswith(f"veloxquant cannot serve model family 'mlx_lm.models.{family}'") and repr(cfg.method) in str(e), str(e)
            continue
        out = run(m, caches)
        assert all(isinstance(c, MLACache) for c in caches) and mx.isfinite(out).all().item(), cfg
        assert kl(ref, out) < 0.5, (cfg, kl(ref, out))
        served.append(cfg.method)
    assert served == SERVED


@pytest.mark.parametrize("cfg, why", [
    (dict(method="snapkv"), "own storage or attention"), (dict(method="xquant"), "own storage or attention"),
    (dict(method="minicache"), "own storage or attention"), (dict(method="nsnquant"), "per-sequence statistics"),
    (dict(method="turboquant", center=True), "per-sequence statistics"), (dict(method="spectral"), "calibration artifact"),
])
def test_refused_methods(cfg, why):
    "Methods that cannot serve an MLA layer are refused by compress and for_model before any cache exists; the model is left as it was."
    m = build("deepseek_v3")
    c = vq.KVCacheConfig(**cfg)
    for entry in (lambda: vq.KVCacheBuilder.for_model(m, c), lambda: vq.compress(m, c)):
        with pytest.raises(ValueError, match=f"veloxquant cannot serve model family 'mlx_lm.models.deepseek_v3': method '{cfg['method']}'.*{why}"):
            entry()
    assert not hasattr(m, "_vq_config")


def test_refused_variants():
    """MLA variants that cannot be served are refused at build time: a latent the key codec cannot code (kv_lora_rank 48 with
    groups of 32), MLA layers whose own cache is not a plain KVCache (a RotatingKVCache here), and deepseek_v32 (its
    CacheList pairs the latent with a sparse-attention indexer)."""
    m = build("deepseek_v3", kv_lora_rank=48)
    with pytest.raises(ValueError, match="cannot code a 48-dim latent"):
        vq.compress(m, vq.KVCacheConfig("affine", group_size=32))
    vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("fp16"))  # fp16 serves it
    m = build.__wrapped__("deepseek_v3")  # a fresh model (not the cached one): its make_cache is replaced
    m.make_cache = lambda: [RotatingKVCache(max_size=16) for _ in m.layers]
    with pytest.raises(ValueError, match="its MLA layers use a RotatingKVCache"):
        vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("fp16"))
    import test_families
    with pytest.raises(ValueError, match="veloxquant cannot serve model family 'mlx_lm.models.deepseek_v32'"):
        vq.KVCacheBuilder.for_model(test_families.build("deepseek_v32"), vq.KVCacheConfig("affine", group_size=32))


def test_decode_attends_codes(monkeypatch):
    """At decode the model passes its absorbed query (latent_dim wide) and this step's latent only; the cache scores and mixes
    the latent codes in blocks of `block_size` tokens (never the whole history decoded) and returns k_pe whole."""
    m = build("deepseek_v3")
    caches = vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("affine", key_bits=4, group_size=32, window=0))
    for c in caches: c.block_size = 16
    mx.eval(m(PROMPT[None, :40], cache=caches))
    seen, calls, whole = [], [], []
    st = caches[0].k_store
    orig_slice = type(st).slice
    monkeypatch.setattr(type(st), "slice", lambda self, s, e: (seen.append(e - s) if self is st else None, orig_slice(self, s, e))[1])
    orig_whole = MLACache._whole
    monkeypatch.setattr(MLACache, "_whole", lambda self, side, step: (whole.append(side), orig_whole(self, side, step))[1])
    orig_attend = MLACache.attend
    def spy(self, queries, keys, values, scale, mask, sinks=None):
        calls.append((queries.shape, keys.shape, getattr(mask, "shape", mask))); return orig_attend(self, queries, keys, values, scale, mask, sinks)
    monkeypatch.setattr(MLACache, "attend", spy)
    for i in range(40, 44): mx.eval(m(PROMPT[None, i:i + 1], cache=caches))
    assert seen and max(seen) <= 16  # the latent codes are read one block at a time
    assert set(whole) == {"v"}  # only the (small, exact) RoPE keys are returned whole at decode, never the latent
    q, k, msk = calls[-1]
    assert q == (1, 4, 1, 64) and k == (1, 1, 1, 64) and msk == (1, 4, 1, 44)  # absorbed query, this step's latent, pe_scores over all
    lat, pe = caches[0].update_and_fetch(mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 16)))
    assert lat.shape == (1, 1, 1, 64) and pe.shape == (1, 1, 45, 16)


@pytest.mark.parametrize("cfg", [dict(method="affine", key_bits=4, group_size=32, window=8),
                                 dict(method="turboquant", key_bits=3, window=8, sinks=2), dict(method="fp16")])
def test_save_load_trim(cfg, tmp_path):
    """save_prompt_cache / load_prompt_cache: the loaded caches continue exactly as the originals; an edited file is refused
    (checksum); trim(1) then the same token again gives the same logits (exact trim)."""
    m = build("deepseek_v3")
    c = vq.KVCacheConfig(**cfg)
    a = vq.KVCacheBuilder.for_model(m, c)
    mx.eval(m(PROMPT[None, :30], cache=a))
    for i in range(30, 40): mx.eval(m(PROMPT[None, i:i + 1], cache=a))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = load_prompt_cache(str(path))
    assert [type(x) for x in b] == [type(x) for x in a] and b[0].offset == 40 and b[0].nbytes <= a[0].nbytes
    nxt = PROMPT[None, 40:41]
    assert mx.array_equal(m(nxt, cache=a), m(nxt, cache=b)).item()
    arrays, meta = mx.load(str(path), return_metadata=True)
    key = next(k for k, v in arrays.items() if v.ndim >= 3 and "checksum" not in k)
    arrays[key] = arrays[key] + mx.ones_like(arrays[key]) if mx.issubdtype(arrays[key].dtype, mx.floating) else arrays[key] ^ 1
    mx.save_safetensors(str(path), arrays, meta)
    with pytest.raises(ValueError, match="checksum"):
        load_prompt_cache(str(path))
    assert all(x.is_trimmable() for x in a)
    before = m(PROMPT[None, 41:42], cache=a)
    assert all(x.exact_trim(1) for x in a) and all(x.trim(1) == 1 for x in a)
    assert mx.array_equal(m(PROMPT[None, 41:42], cache=a), before).item()


def batched(model, prompts, n):
    g = BatchGenerator(model, stop_tokens=[])
    uids = g.insert(prompts, [n] * len(prompts))
    toks = {u: [] for u in uids}
    while responses := g.next_generated():
        for r in responses: toks[r.uid].append(r.token)
    g.close()
    return [toks[u] for u in uids]


def test_batch():
    "fp16 batches through mlx-lm's own BatchKVCache (tokens as stock); quantized MLA caches refuse the batch before its first token."
    m = build("deepseek_v3")
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
    ref = batched(m, prompts, 5)
    vq.compress(m, vq.KVCacheConfig("fp16"))
    try:
        assert batched(m, prompts, 5) == ref
        vq.compress(m, vq.KVCacheConfig("affine", group_size=32))
        with pytest.raises(ValueError, match="MLA caches .* do not support batch generation"):
            batched(m, prompts, 5)
        assert "only fp16 batches" in batch_refusal(m.make_cache())  # what `veloxquant serve` checks before serving
        vq.compress(m, vq.KVCacheConfig("fp16"))
        assert batch_refusal(m.make_cache()) is None
    finally: vq.decompress(m)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sinks_window_order(dtype):
    """Near-exact 8-bit latent codes with 4 sink tokens and an fp16 window of 8: the RoPE scores (the model's additive mask)
    line up with sinks, codes, window and step in position order (KL ~ 1e-6; a misordering gives a large KL); float16 takes
    the decode path that writes into the preallocated window buffer."""
    m = build("deepseek_v3") if dtype == "float32" else build.__wrapped__("deepseek_v3")  # set_dtype: not the cached model
    if dtype == "float16": m.set_dtype(mx.float16)
    ref = run(m, make_prompt_cache(m))
    caches = vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("affine", key_bits=8, group_size=32, window=8, sinks=4))
    out = run(m, caches)
    c = caches[0]
    assert c.n_sink == 4 and c.k_store.length > 0 and c.k_exact is not None and (c._xbuf if dtype == "float16" else True)
    assert kl(ref, out) < 1e-4


def test_eval_harness():
    "The evaluation harness runs on an MLA model: KL/perplexity against the fp16 reference; MLA layers are left out of the attention probe."
    from veloxquant.eval import decode_run, fp16_reference, compare_to_reference
    m = build("deepseek_v3")
    toks = [int(t) for t in PROMPT] + [int(t) for t in PROMPT[:64]]
    ref = fp16_reference(m, toks, 64)
    run = decode_run(m, vq.KVCacheConfig("affine", key_bits=4, group_size=32, window=0), toks, 64, attn_probe=4)
    q = compare_to_reference(ref, run)
    assert q["kl_mean"] < 2e-2 and run["attn"] == [] and run["report"]["elements"] == 2 * 159 * 80  # 160 tokens, the last one only scored


def test_value_options_cannot_refuse_the_latent():
    "MLA layers never use the value codec: a value option that does not divide the latent must not refuse it."
    import veloxquant.mla as mla
    from veloxquant.core import parse_method
    assert mla.unsupported(parse_method("kivi:window=0,group_size=32,value_group=64"), 96) is None
    assert "cannot code a 48-dim latent" in mla.unsupported(parse_method("affine:group_size=32"), 48)
