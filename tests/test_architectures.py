"""Architecture matrix on tiny random-weight models of mlx-lm families (no downloads): `fp16` through veloxquant gives
logits identical to stock mlx-lm, every registered quantization method runs, and families veloxquant cannot compress
are refused with a clear error (never silently left uncompressed). Families with sliding-window (RotatingKVCache) or
chunked-attention (ChunkedKVCache) layers run 48 tokens through a window of 16 / chunks of 8, prefilled in chunks."""
import importlib
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import veloxquant as vq
from veloxquant.core import method_ids
from veloxquant.eval import standard_settings

BASE = dict(hidden_size=128, head_dim=32, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, vocab_size=100, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
            layer_norm_eps=1e-5, norm_eps=1e-5, layer_norm_epsilon=1e-5, rope_traditional=False, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=16, query_pre_attn_scalar=32, use_qk_norm=False, attention_bias=False,
            mlp_bias=False, logit_scale=1.0, partial_rotary_factor=1.0, num_experts=4, norm_topk_prob=True,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
            rope_scaling=None, embedding_multiplier=1.0, attention_multiplier=1.0, residual_multiplier=1.0,
            logits_scaling=1.0, hidden_act="silu", original_max_position_embeddings=512, sliding_window_pattern=2,
            final_logit_softcapping=30.0, attn_logit_softcapping=50.0, use_sliding_window=False, clip_qkv=None,
            bias=False, norm_type="rms", max_window_layers=2)
SUPPORTED = ["llama", "qwen2", "qwen3", "phi3", "starcoder2", "olmo2", "gemma", "mixtral", "cohere", "internlm2",
             "granite", "qwen3_moe", "phimoe", "nemotron", "helium", "glm4", "hunyuan_v1_dense", "smollm3"]
TOKS = mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
SL = ["sliding_attention", "full_attention"]
# families whose own make_cache gives some layers a RotatingKVCache (window 16) or a ChunkedKVCache (chunk 8);
# "llama_swa" is llama with Mistral-style `layer_types`
EXTRA = {"llama_swa": dict(layer_types=SL), "olmo3": dict(layer_types=SL), "exaone4": dict(sliding_window_pattern="LG"),
         "ministral3": dict(layer_types=SL, rope_parameters=dict(rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                                                  original_max_position_embeddings=512, rope_type="default")),
         "llama4": dict(text_config=dict(BASE, model_type="llama4_text", attention_chunk_size=8, interleave_moe_layer_step=2,
                                         intermediate_size_mlp=128, num_hidden_layers=4, use_qk_norm=True, num_experts_per_tok=1))}
EXTRA["recurrent_gemma"] = dict(conv1d_width=4, logits_soft_cap=30.0, attention_window_size=16, block_types=["recurrent", "attention"])
SLIDING = ["gemma3_text", "gpt_oss", "cohere2", "olmo3", "ministral3", "exaone4", "llama_swa", "llama4"]
LONG = mx.array([[(7 * i + 3) % 100 for i in range(48)]])
PRE_ROPE_POSITIONS = {"comm_vq", "a2ats"}  # methods that refuse sliding-window / chunked layers (veloxquant.methods.comm_vq.PreRopeCache)
CHUNKS = [20, 1, 1, 10, 1, 1, 1, 13]  # prefill chunks and decode steps, well past the window


def build(family):
    mod = importlib.import_module(f"mlx_lm.models.{family.removesuffix('_swa')}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(dict(BASE, model_type=family.removesuffix('_swa'), **EXTRA.get(family, {}))))
    mx.eval(model.parameters())
    return model


def run(model, caches):
    return mx.concatenate([model(TOKS[:, :8], cache=caches), model(TOKS[:, 8:9], cache=caches), model(TOKS[:, 9:], cache=caches)], 1)


def run_long(model, caches):
    outs, s = [], 0
    for n in CHUNKS:
        outs.append(model(LONG[:, s:s + n], cache=caches)); s += n
    return mx.concatenate(outs, 1)


def method_configs(model=None):
    """One standard setting of every registered method except fp16 (group sizes set to head_dim 32). A method with a
    registered calibration (`veloxquant.calibrate`) is calibrated on `model` first (96 token ids, a temporary file)."""
    import tempfile
    from veloxquant.calibrate import calibration_of, calibrate
    for mid in method_ids():
        if mid == "fp16": continue
        opts = dict(standard_settings(mid)[0])
        for name in vq.get_method(mid).config_cls.__dataclass_fields__:
            if "group" in name: opts[name] = 32
        if calibration_of(mid) is not None:
            if model is None: continue
            out = Path(tempfile.mkdtemp(prefix="vq-arch-")) / f"{mid}.safetensors"
            try:
                opts["path"] = str(calibrate(vq.KVCacheConfig(mid, **opts), model, tokens=list(range(1, 97)), window=48,
                                             out=out, progress=False))
            except ValueError as e:  # methods that undo RoPE refuse a model whose RoPE they cannot undo (e.g. llama4's NoPE layers)
                if (mid in PRE_ROPE_POSITIONS and "RoPE" in str(e)) or "methods that undo RoPE cannot serve it" in str(e): continue
                raise
        yield vq.KVCacheConfig(mid, **opts)


def caches_or_refused(model, cfg):
    """The method's caches, or None when it is refused at build time with a clear error: it undoes RoPE and the model's
    RoPE cannot be undone, its hook covers Llama blocks only, or its prompt pass needs every layer (kvzip on sliding layers)."""
    try: return vq.KVCacheBuilder.for_model(model, cfg)
    except ValueError as e:
        if ("methods that undo RoPE cannot serve it" in str(e) or "Llama block family" in str(e)
                or "runs a pass of its own over the prompt through every attention layer" in str(e)): return None  # kvzip on sliding layers
        raise


@pytest.mark.parametrize("family", SUPPORTED)
def test_family(family):
    model = build(family)
    ref = run(model, model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers])
    vq.compress(model, vq.KVCacheConfig("fp16"))
    try:
        assert mx.array_equal(ref, run(model, model.make_cache())).item(), f"{family}: fp16 logits differ from stock mlx-lm"
    finally:
        vq.decompress(model)
    for cfg in method_configs(model):
        if (caches := caches_or_refused(model, cfg)) is None: continue
        out = run(model, caches)
        assert out.shape == ref.shape and mx.isfinite(out).all().item(), f"{family} × {cfg.method}"


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_family(family):
    """48 tokens (prefill chunks + decode) through windows of 16 / chunks of 8: fp16 logits and greedy tokens identical to
    stock mlx-lm; the generic compressed path (fp16 reference) matches to float32 rounding; every method runs, and its
    sliding layers hold at most the window (plus the eviction batch)."""
    from mlx_lm.models.cache import RotatingKVCache, ChunkedKVCache
    from veloxquant.sliding import RotatingVQCache, ChunkedVQCache, FP16RotatingCache
    model = build(family)
    stock = model.make_cache()
    assert {type(c) for c in stock} & {RotatingKVCache, ChunkedKVCache}, f"{family} has no sliding/chunked layer"
    ref = run_long(model, stock)
    vq.compress(model, vq.KVCacheConfig("fp16"))
    try:
        caches = model.make_cache()
        assert [type(c) for c in caches] == [{RotatingKVCache: FP16RotatingCache, ChunkedKVCache: ChunkedVQCache}.get(type(c), vq.get_method("fp16").make_cache(vq.KVCacheConfig()).__class__) for c in stock]
        out = run_long(model, caches)
        assert mx.array_equal(ref, out).item(), f"{family}: fp16 logits differ from stock mlx-lm"
        assert mx.array_equal(ref.argmax(-1), out.argmax(-1)).item()
    finally:
        vq.decompress(model)
    gen = run_long(model, vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("fp16", reference=True)))
    assert mx.abs(gen - ref).max().item() < 1e-4, f"{family}: generic sliding path differs from mlx-lm"
    for cfg in method_configs(model):
        if cfg.method in PRE_ROPE_POSITIONS:  # keys stored before RoPE at positions from the sequence start: refused at build
            with pytest.raises(ValueError, match="sliding-window or chunked layer|methods that undo RoPE cannot serve it|Llama block family"):
                vq.KVCacheBuilder.for_model(model, cfg)
            continue
        if (caches := caches_or_refused(model, cfg)) is None: continue
        assert any(isinstance(c, (RotatingVQCache, ChunkedVQCache)) for c in caches)
        out = run_long(model, caches)
        assert out.shape == ref.shape and mx.isfinite(out).all().item(), f"{family} × {cfg.method}"
        for c in caches:
            if isinstance(c, RotatingVQCache): assert c.stored <= c.max_size - 1 + c.evict_every
            if isinstance(c, ChunkedVQCache): assert c.stored <= c.chunk_size + CHUNKS[-1]  # trimmed before each step, as mlx-lm


@pytest.mark.parametrize("family, message", [
    ("gemma2", "computes attention without"),           # its file computes attention itself
    ("recurrent_gemma", "builds caches of type ArraysCache"),  # recurrent (state-space) layers: no KV cache to compress
])
def test_refused_family(family, message):
    model = build(family)
    with pytest.raises(ValueError, match=message):
        vq.compress(model, vq.KVCacheConfig("affine", group_size=32))
    assert not hasattr(model, "_vq_config")  # left as it was


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3", "gemma3_text", "llama_swa"])
@pytest.mark.parametrize("spec", ["svdq:min_tokens=8,window=4,group_size=32", "kvtc:min_tokens=8,window=4,sinks=2"])
def test_prerope_lowrank_family(family, spec):
    """svdq / kvtc with a basis fitted after 8 tokens (their defaults wait for 256, so test_family leaves them in fp16):
    keys rotated back with each layer's own RoPE, coded, attended with RoPE re-applied per tile; sliding layers stay fp16."""
    from veloxquant.core import parse_method
    model = build(family)
    caches = vq.KVCacheBuilder.for_model(model, parse_method(spec))
    out = run_long(model, caches)  # 48 tokens in prefill chunks and decode steps
    assert mx.isfinite(out).all().item()
    coded = [c for c in caches if getattr(c, "k_store", None) is not None and c.k_store.length]
    assert coded and all(c.rope_spec is not None and c.k_codec.fitted() for c in coded)


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3", "gemma3_text", "llama_swa"])
@pytest.mark.parametrize("spec", ["palu:quant_group=32", "palu:quant_group=32,bits=16,lrd_heads=1,ratio=0.25,sinks=2"])
def test_palu_family(family, spec, tmp_path):
    """palu calibrated on each family's random model: keys rotated back with each layer's own RoPE, their latent coded,
    attended with RoPE re-applied per tile, values mixed in the latent; sliding layers stay fp16 within their window."""
    from veloxquant.core import parse_method
    from veloxquant.calibrate import calibrate
    from veloxquant.sliding import RotatingVQCache
    model = build(family)
    cfg = parse_method(spec)
    path = calibrate(cfg, model, tokens=list(range(1, 97)), window=48, out=tmp_path / "palu.safetensors", progress=False)
    caches = vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("palu", **{**cfg.options.to_dict(), "path": str(path)}))
    out = run_long(model, caches)  # 48 tokens in prefill chunks and decode steps
    assert out.shape[:2] == (1, 48) and mx.isfinite(out).all().item()
    coded = [c for c in caches if getattr(c, "k_store", None) is not None and c.k_store.length]
    assert coded and all(c.rope_spec is not None for c in coded)
    for c in caches:
        if isinstance(c, RotatingVQCache): assert c.stored <= c.max_size - 1 + c.evict_every and not c.inner.k_store.length


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3", "gemma3_text", "llama_swa"])
def test_amc_family(family):
    """amc with its bases fitted on the first 32 coded tokens (its defaults wait for 256, so test_family leaves it in fp16):
    keys and values coded in three tiers and attended over the latent codes; sliding layers stay fp16."""
    from veloxquant.core import parse_method
    model = build(family)
    caches = vq.KVCacheBuilder.for_model(model, parse_method("amc:group_size=32,window=32,min_tokens=8"))
    ids = mx.array([[(5 * i) % 90 + 3 for i in range(100)]])
    out = mx.concatenate([model(ids[:, :80], cache=caches)] + [model(ids[:, t:t + 1], cache=caches) for t in range(80, 100)], 1)
    assert mx.isfinite(out).all().item()
    coded = [c for c in caches if getattr(c, "k_store", None) is not None and c.k_store.length]
    assert coded and all(c.k_codec.fitted() and c.v_codec.fitted() for c in coded)
