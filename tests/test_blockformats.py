"""llama.cpp block formats (`q8_0`, `q4_0`) and `turboquant_rvq`: numpy references, exact sizes,
save/load round trips on a tiny random llama, option validation, residual passes."""
import math
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import veloxquant as vq
from veloxquant.core import cache_report
from veloxquant.methods.q8_0 import QK, Q8_0Codec, block_absmax
from veloxquant.methods.q4_0 import Q4_0Codec
from veloxquant.methods.turboquant_rvq import RVQCodec, residual_sigmas


def ref_q8_0(x):
    "llama.cpp quantize_row_q8_0_ref + dequantize_row_q8_0, transcribed in numpy float32."
    xb = x.astype(np.float32).reshape(-1, QK)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    idv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    v = xb * idv
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    return (d.astype(np.float16).astype(np.float32) * q).reshape(x.shape)


def ref_q4_0(x):
    "llama.cpp quantize_row_q4_0_ref + dequantize_row_q4_0, transcribed in numpy float32."
    xb = x.astype(np.float32).reshape(-1, QK)
    m = np.take_along_axis(xb, np.abs(xb).argmax(-1)[:, None], -1)
    d = (m / np.float32(-8)).astype(np.float32)
    idv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.minimum(15, np.trunc(xb * idv + np.float32(8.5)))
    return (d.astype(np.float16).astype(np.float32) * (q - 8)).reshape(x.shape)


def data(seed, shape=(2, 3, 17, 64)):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)
    x[0, 0, 0, :QK] = 0  # an all-zero block
    x[0, 0, 1, :QK] = 0.25  # a constant block (ties in |max|)
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("D", [64, 128])
def test_block_formats_match_llama_cpp(seed, D):
    x = data(seed, (2, 3, 17, D))
    for codec, ref, bound in ((Q8_0Codec(D), ref_q8_0, 1 / 254), (Q4_0Codec(D), ref_q4_0, 1 / 8)):
        dec = np.array(codec.decode(codec.encode(mx.array(x))))
        np.testing.assert_allclose(dec, ref(x), rtol=1e-5, atol=1e-6)
        # error bound per block: q8_0 half a step (amax/254); q4_0 the clamp of the side opposite the signed max
        # (codes reach only +7d = 7/8·amax there, so amax/8); plus the fp16 rounding of d
        amax = np.abs(x).reshape(-1, QK).max(-1)
        err = np.abs(dec - x).reshape(-1, QK).max(-1)
        assert np.all(err <= amax * (bound + 2 ** -10) + 1e-12)


def test_q4_0_signed_max_is_exact():
    x = data(3)
    dec = np.array(Q4_0Codec(64).decode(Q4_0Codec(64).encode(mx.array(x))))
    xb, db = x.reshape(-1, QK), dec.reshape(-1, QK)
    i = np.abs(xb).argmax(-1)
    m, mh = xb[np.arange(len(xb)), i], db[np.arange(len(db)), i]
    np.testing.assert_allclose(mh, m.astype(np.float16).astype(np.float32), rtol=1e-6)  # −8·fp16(m/−8)


def test_block_absmax():
    x = mx.array(np.array([[1.0, -3.0, 3.0, 2.0] * 8], np.float32))
    _, amax, m = block_absmax(x)
    assert amax.item() == 3.0 and m.item() == -3.0  # first of the tied magnitudes, with its sign


@pytest.mark.parametrize("codec,bits", [(Q8_0Codec(64), 8.5), (Q4_0Codec(64), 4.5), (Q4_0Codec(128, hadamard=True), 4.5),
                                        (RVQCodec(64), 2 + 16 / 64), (RVQCodec(64, 3, 1, "rms"), 3 + 48 / 64),
                                        (RVQCodec(128, 2, 2), 4 + 16 / 128)])
def test_bits_per_element_exact(codec, bits):
    enc = codec.encode(mx.random.normal((1, 2, 5, codec.head_dim)))
    stored = sum(a[0, 0, 0].nbytes for a in enc.values()) * 8
    assert stored == codec.bits_per_vector() == bits * codec.head_dim


@pytest.mark.parametrize("spec,bits", [("q8_0", 8.5), ("q4_0", 4.5), ("turboquant_rvq", 2.25)])
def test_cache_bits_per_element(tiny_model, spec, bits):
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig(spec, window=0))  # codes only
    tiny_model(mx.array([[i % 120 + 3 for i in range(257)]]), cache=caches)
    tiny_model(mx.array([[5] * 255]), cache=caches)  # 512 tokens: no allocation headroom
    assert cache_report(caches)["bits_per_element"] == pytest.approx(bits)


def test_compressed_scores_and_mix_match_decode():
    q = mx.random.normal((1, 2, 3, 2, 64)); p = mx.random.uniform(shape=(1, 2, 3, 2, 9))
    for cd in (Q8_0Codec(64), Q8_0Codec(64, hadamard=True), Q4_0Codec(64), Q4_0Codec(64, hadamard=True, seed=5),
               RVQCodec(64), RVQCodec(64, 3, 2, "rms")):
        enc = cd.encode(mx.random.normal((1, 2, 9, 64)) * 2)
        dec = mx.expand_dims(cd.decode(enc), 2)
        assert mx.allclose(cd.scores(q, enc), q @ dec.swapaxes(-1, -2), atol=1e-3).item()
        assert mx.allclose(cd.mix(p, enc), p @ dec, atol=1e-3).item()


def feed(model, caches, toks, chunks):
    outs, s = [], 0
    for c in chunks:
        outs.append(model(mx.array(toks[s:s + c])[None], cache=caches)); s += c
    return mx.concatenate(outs, axis=1)


@pytest.mark.parametrize("method,opts", [("q8_0", {}), ("q4_0", {}), ("q4_0", dict(hadamard=True, window=7)),
                                         ("turboquant_rvq", {}), ("turboquant_rvq", dict(passes=3, residual_scale="rms"))])
def test_save_load_roundtrip(tiny_model, tmp_path, method, opts):
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig(method, **opts))
    feed(tiny_model, caches, [i % 120 + 3 for i in range(300)], (290, 1, 1, 8))
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches, {"m": method})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta == {"m": method} and [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.offset for c in loaded] == [300, 300]
    assert mx.array_equal(feed(tiny_model, caches, [7, 8, 9], (3,)), feed(tiny_model, loaded, [7, 8, 9], (3,))).item()


@pytest.mark.parametrize("method,kwargs,msg", [
    ("q8_0", dict(window=-1), "window=-1"), ("q8_0", dict(hadamard=1), "hadamard=1"),
    ("q4_0", dict(hadamard="yes"), "hadamard='yes'"), ("q4_0", dict(seed=-2), "seed=-2"),
    ("q4_0", dict(bits=3), "bits"),
    ("turboquant_rvq", dict(passes=4), "passes=4"), ("turboquant_rvq", dict(bits_per_pass=3), "bits_per_pass=3"),
    ("turboquant_rvq", dict(passes=True), "passes=True"),
    ("turboquant_rvq", dict(residual_scale="std"), "residual_scale='std'")])
def test_bad_options(method, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        vq.KVCacheConfig(method, **kwargs)


def test_head_dim_must_be_multiple_of_32():
    with pytest.raises(ValueError, match="head_dim=80"):
        Q4_0Codec(80)


def test_residual_pass_reduces_mse():
    x = mx.random.normal((1, 1, 2048, 64))
    u = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    for bits in (1, 2):
        for scale in ("fixed", "rms"):
            mse = [((RVQCodec(64, P, bits, scale).decode(RVQCodec(64, P, bits, scale).encode(u)) - u) ** 2).sum(-1).mean().item()
                   for P in (1, 2, 3)]
            assert mse[0] > mse[1] > mse[2], (bits, scale, mse)
    # first pass = 1-bit Lloyd–Max on N(0, 1/d): D ≈ 1 − 2/π
    cd = RVQCodec(64, 1)
    mse_1 = ((cd.decode(cd.encode(u)) - u) ** 2).sum(-1).mean().item()
    assert abs(mse_1 - (1 - 2 / math.pi)) < 0.01
    s = residual_sigmas(3, 1)
    assert s[0] == 1.0 and s[0] > s[1] > s[2] and abs(s[1] - math.sqrt(1 - 2 / math.pi)) < 2e-3
