"""The builder gives caches that undo RoPE their layer's own `RopeSpec`, and refuses a RoPE it cannot describe."""
import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE
import veloxquant as vq
import veloxquant.rope as rope
from veloxquant.cache import VQCache


def tiny(rope_theta=5000.0):
    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
                           tie_word_embeddings=True, rope_theta=rope_theta)
    mx.random.seed(0); m = llama.Model(args); mx.eval(m.parameters()); return m


@pytest.fixture
def rope_aware():
    VQCache.use_rope = lambda self, spec: setattr(self, "_test_rope", spec)
    yield
    del VQCache.use_rope


def test_builder_hands_each_layer_its_rope(rope_aware):
    caches = vq.KVCacheBuilder.for_model(tiny(), vq.KVCacheConfig("affine"))
    specs = [c._test_rope for c in caches]
    assert [s.base for s in specs] == [5000.0, 5000.0] and specs[0].head_dim == 64
    assert rope.from_json(rope.to_json(specs[1])) == specs[1]


def test_undescribable_rope_is_refused_at_build_time(rope_aware):
    m = tiny()
    m.model.layers[1].self_attn.rope = DynamicNTKScalingRoPE(64, 2048, False, 5000.0, 2.0)
    with pytest.raises(ValueError, match="cannot serve model family.*undoes RoPE.*DynamicNTKScalingRoPE"):
        vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("affine"))


def test_caches_that_do_not_undo_rope_never_look():
    m = tiny()
    m.model.layers[1].self_attn.rope = DynamicNTKScalingRoPE(64, 2048, False, 5000.0, 2.0)
    vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("affine"))   # no `use_rope`: built as before
