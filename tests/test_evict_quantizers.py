"""Quantizers under an evicting cache: per-token codecs are accepted; methods the evicting cache cannot keep are
refused when the config is built, with a ValueError naming the quantizer (not at the first token, not garbage)."""
import pytest
import veloxquant as vq
from veloxquant.cli import draft_model_refusal


@pytest.mark.parametrize("q", ["fp16", "affine", "turboquant:key_bits=4+value_bits=4", "q4_0", "q8_0", "polar", "qjl", "rabitq",
                               "nsnquant", "turboquant_rvq"])
def test_per_token_quantizers_accepted(q):
    assert vq.KVCacheConfig("snapkv", budget=0.5, quantizer=q).options.quantizer == q


@pytest.mark.parametrize("q,why", [("xkv", "own way"), ("minicache", "own way"), ("xquant", "own way"), ("cachegen", "own way"),
                                   ("vecinfer", "calibrated"), ("kvquant", "calibrated"), ("skvq", "calibrated"),
                                   ("kivi", "groups"), ("h2o", "eviction method")])
def test_quantizers_an_evicting_cache_cannot_keep_are_refused(q, why):
    for method in ("snapkv", "h2o"):
        with pytest.raises(ValueError, match=why) as e:
            vq.KVCacheConfig(method, budget=0.5, quantizer=q)
        assert repr(q) in str(e.value)


def test_draft_model_refused_for_untrimmable_caches():
    cfg = vq.KVCacheConfig("h2o", budget=0.5)
    assert "cannot be trimmed" in draft_model_refusal(cfg, ["--draft-model", "x"])
    assert "cannot be trimmed" in draft_model_refusal(cfg, ["--draft=x"])
    assert draft_model_refusal(cfg, ["--max-tokens", "4"]) is None
    assert draft_model_refusal(vq.KVCacheConfig("affine"), ["--draft-model", "x"]) is None   # trimmable
