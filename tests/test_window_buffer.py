"""The float16 decode-step window buffer (`VQCache.window_buffer`) is an optimisation only: a cache fed a mix of
prefill chunks, single-token decode steps and multi-token chunks gives the same attention output and the same exact
window with the buffer as without it. Regression: replacing the window's keys after a decode step once left the values
as the whole preallocated buffer (more values than keys), which broke every windowed method in 16-token scoring steps
of float16 models (the matmul shape error and the cuDNN error of the H200 quality sweep)."""
import mlx.core as mx
import numpy as np
import pytest
import veloxquant as vq
from veloxquant.builder import KVCacheBuilder
import veloxquant.cache as cache_mod

SPECS = ["kivi_sink:key_bits=2,value_bits=2", "kitty:group_size=32,value_bits=2,window=32",
         "turboquant:key_bits=3,value_bits=3,window=32,sinks=4", "affine:key_bits=4,value_bits=4,window=64"]
STEPS = (300, 1, 16, 16, 1, 1, 16, 40, 1, 16)


def _run(tiny_model, spec, buffer: bool):
    old = cache_mod.VQCache.window_buffer
    cache_mod.VQCache.window_buffer = buffer
    try:
        cfg = vq.parse_method(spec)
        c = KVCacheBuilder.for_model(tiny_model, cfg)[0]
        outs, lens = [], []
        rng = np.random.default_rng(0)
        H, D = c_shape(tiny_model)
        for T in STEPS:
            k = mx.array(rng.standard_normal((1, H, T, D)), mx.float16)
            v = mx.array(rng.standard_normal((1, H, T, D)), mx.float16)
            q = mx.array(rng.standard_normal((1, H, T, D)), mx.float16)
            c.update_and_fetch(k, v)
            o = c.attend(q, k, v, scale=D ** -0.5, mask="causal" if T > 1 else None)
            mx.eval(o)
            outs.append(np.array(o.astype(mx.float32)))
            lens.append((c.k_exact.shape[2], c.v_exact.shape[2]))
        return outs, lens
    finally:
        cache_mod.VQCache.window_buffer = old


def c_shape(model):
    a = model.layers[0].self_attn
    return a.n_kv_heads, a.k_proj.weight.shape[0] // a.n_kv_heads


@pytest.mark.parametrize("spec", SPECS)
def test_window_buffer_changes_nothing(tiny_model, spec):
    try:
        KVCacheBuilder.for_model(tiny_model, vq.parse_method(spec))
    except ValueError as e:  # a setting this method does not allow on the tiny model
        pytest.skip(f"{spec}: {e}")
    with_buf, lens = _run(tiny_model, spec, True)
    without, lens0 = _run(tiny_model, spec, False)
    assert all(k == v for k, v in lens), lens  # as many exact values as exact keys after every step
    assert lens == lens0
    for a, b in zip(with_buf, without):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)
