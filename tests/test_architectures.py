"""Architecture matrix on tiny random-weight models of mlx-lm families (no downloads): `fp16` through veloxquant gives
logits identical to stock mlx-lm, every registered quantization method runs, and families veloxquant cannot compress
are refused with a clear error (never silently left uncompressed)."""
import importlib

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


def build(family):
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(dict(BASE, model_type=family)))
    mx.eval(model.parameters())
    return model


def run(model, caches):
    return mx.concatenate([model(TOKS[:, :8], cache=caches), model(TOKS[:, 8:9], cache=caches), model(TOKS[:, 9:], cache=caches)], 1)


@pytest.mark.parametrize("family", SUPPORTED)
def test_family(family):
    model = build(family)
    ref = run(model, model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers])
    vq.compress(model, vq.KVCacheConfig("fp16"))
    try:
        assert mx.array_equal(ref, run(model, model.make_cache())).item(), f"{family}: fp16 logits differ from stock mlx-lm"
    finally:
        vq.decompress(model)
    for mid in method_ids():
        if mid == "fp16": continue
        opts = dict(standard_settings(mid)[0])
        for name in vq.get_method(mid).config_cls.__dataclass_fields__:  # head_dim is 32 here
            if "group" in name: opts[name] = 32
        out = run(model, vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig(mid, **opts)))
        assert out.shape == ref.shape and mx.isfinite(out).all().item(), f"{family} × {mid}"


@pytest.mark.parametrize("family, message", [
    ("gemma2", "computes attention without"),           # its file computes attention itself
    ("gemma3_text", "compresses only plain KVCache"),   # sliding-window (RotatingKVCache) layers
    ("gpt_oss", "compresses only plain KVCache"),
])
def test_refused_family(family, message):
    model = build(family)
    with pytest.raises(ValueError, match=message):
        vq.compress(model, vq.KVCacheConfig("affine", group_size=32))
    assert not hasattr(model, "_vq_config")  # left as it was
