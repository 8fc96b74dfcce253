"""The second real model, Gemma-3-270M (15 of 18 layers with a 512-token sliding window; Gemma Terms of Use), prepared
from PyPI like the default model: fp16 through veloxquant equals stock mlx-lm past the window, a compressed method
stays close, and the sliding layers hold no more than the window."""
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import veloxquant as vq
from veloxquant.sliding import FP16RotatingCache, RotatingVQCache

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    from veloxquant.gemma import load_gemma_model
    from veloxquant.models import eval_tokens, with_bos
    model, tok = load_gemma_model()
    return model, tok, with_bos(tok, eval_tokens(tok, 600))


def run(model, caches, ids, chunks=(300, 250, 1, 1, 1, 1)):
    "Prefill in chunks past the 512-token window, then decode steps; returns the logits of every step's last token."
    outs, s = [], 0
    for n in chunks:
        outs.append(model(mx.array(ids[s:s + n])[None], cache=caches)[:, -1]); s += n
    return mx.concatenate(outs).astype(mx.float32)


def test_gemma_fp16_identical_and_affine_close(gemma):
    model, tok, ids = gemma
    assert ids[0] == tok.bos_token_id
    ref = run(model, make_prompt_cache(model), ids)
    caches = vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("fp16"))
    assert sum(isinstance(c, FP16RotatingCache) for c in caches) == 15
    assert mx.array_equal(ref, run(model, caches, ids)).item()
    caches = vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("affine", key_bits=8, value_bits=8))
    out = run(model, caches, ids)
    assert mx.array_equal(out.argmax(-1), ref.argmax(-1)).item()
    p, q = mx.softmax(ref, -1), mx.softmax(out, -1)
    kl = (p * (mx.log(p + 1e-30) - mx.log(q + 1e-30))).sum(-1).max().item()
    assert kl < 0.05, kl
    sliding = [c for c in caches if isinstance(c, RotatingVQCache)]
    assert len(sliding) == 15 and all(c.stored <= 511 + c.evict_every for c in sliding)
    assert 0 < vq.cache_report(caches)["bits_per_element"] < 16  # smaller than 16-bit storage, allocated headroom included
