"""Quantization primitives (rotations, Lloyd–Max codebooks, bit packing) and the `turboquant` method."""
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import veloxquant as vq
from veloxquant.quant import (PACK_BITS, ROTATIONS, SUPPORTED_HEAD_DIMS, codebook, fwht, load_codebooks, lloyd_max,
                              pack_bits, packed_words, precompute, rotation, sylvester_hadamard, unpack_bits)


def feed(model, caches, toks, chunks):
    outs, s = [], 0
    for c in chunks:
        outs.append(model(mx.array(toks[s:s + c])[None], cache=caches)); s += c
    return mx.concatenate(outs, axis=1)


# ---------------------------------------------------------------- rotations
@pytest.mark.parametrize("kind", ROTATIONS)
@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
def test_rotation_orthogonal(kind, d):
    for seed in (0, 5):
        R = rotation(kind, d, seed)
        assert R.shape == (d, d) and R.dtype == mx.float32
        assert mx.abs(R @ R.T - mx.eye(d)).max().item() < 2e-5
        assert mx.abs(R.T @ R - mx.eye(d)).max().item() < 2e-5
    assert not mx.array_equal(rotation(kind, d, 0), rotation(kind, d, 1))


def test_rotation_bad_kind():
    with pytest.raises(ValueError, match="rotation='dct'"):
        rotation("dct", 64)


def test_fwht_matches_matrix():
    x = mx.random.normal((4, 7, 256))
    np.testing.assert_allclose(np.array(fwht(x)), np.array(x) @ sylvester_hadamard(256), atol=1e-4)


# ---------------------------------------------------------------- codebooks
def test_lloyd_max_known_values():
    c, t, m = lloyd_max("gaussian", 1)
    np.testing.assert_allclose(c, [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], atol=1e-6)
    assert m == pytest.approx(1 - 2 / math.pi, abs=1e-6)
    c, t, m = lloyd_max("gaussian", 2)
    np.testing.assert_allclose(c, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    c, t, m = lloyd_max("laplace", 1)
    np.testing.assert_allclose(c, [-2 ** -0.5, 2 ** -0.5], atol=1e-6)
    # sphere: d·mse close to (and slightly below) the Gaussian value; the paper's ≈0.36, 0.117, 0.03, 0.009
    for b, ref in zip((1, 2, 3, 4), (0.36, 0.117, 0.034, 0.0093)):
        assert 128 * lloyd_max("sphere", b, 128)[2] == pytest.approx(ref, rel=0.05)
    np.testing.assert_array_equal(lloyd_max("sphere", 3, 80)[0], lloyd_max("sphere", 3, 80)[0])


def test_codebook_artifact_roundtrip_and_corruption(tmp_path):
    p = precompute(tmp_path / "cb.safetensors", bits=(1, 2, 3, 4), dims=(64,))
    books = load_codebooks(p)
    assert set(books) >= {"gaussian/b2/centroids", "laplace/b4/boundaries", "sphere64/b3/mse"}
    np.testing.assert_array_equal(books["sphere64/b3/centroids"], lloyd_max("sphere", 3, 64)[0])
    cb = codebook("sphere", 2, 64, path=p)
    assert cb.centroids.shape == (4,) and cb.boundaries.shape == (3,)
    raw = bytearray(p.read_bytes()); raw[-3] ^= 0x01
    bad = tmp_path / "bad.safetensors"; bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        load_codebooks(bad)
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="unreadable"):
        load_codebooks(bad)


def test_codebook_bad_args():
    with pytest.raises(ValueError, match="bits=0"):
        codebook("gaussian", 0)
    with pytest.raises(ValueError, match="kind='student'"):
        codebook("student", 2)
    with pytest.raises(ValueError, match="dim=2"):
        codebook("sphere", 2, 2)


# ---------------------------------------------------------------- bit packing
@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(PACK_BITS), n=st.integers(1, 300), lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
       seed=st.integers(0, 2 ** 31))
def test_pack_roundtrip(bits, n, lead, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=(*lead, n)).astype(np.uint32)
    w = pack_bits(mx.array(codes), bits)
    assert w.dtype == mx.uint32 and w.shape == (*lead, packed_words(n, bits)) and w.shape[-1] == -(-n * bits // 32)
    np.testing.assert_array_equal(np.array(unpack_bits(w, bits, n)), codes)


def test_pack_layout_3bit_straddle():
    c = mx.zeros((64,), mx.uint32); c[10] = 7; c[53] = 5  # bits 30-32 and 159-161
    w = pack_bits(c, 3).tolist()
    assert w[0] == 3 << 30 and w[1] == 1 and w[4] == 1 << 31 and w[5] == 2 and len(w) == 6


def test_pack_bad_bits():
    with pytest.raises(ValueError, match="bits=6"):
        pack_bits(mx.zeros((4,), mx.uint32), 6)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(mx.zeros((3,), mx.uint32), 3, 64)


# ---------------------------------------------------------------- turboquant: theory
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
def test_turboquant_mse_within_paper_bounds(d, kind):
    from veloxquant.methods.turboquant import TurboQuantCodec
    mx.random.seed(1)
    u = mx.random.normal((2048, d)); u = u / mx.linalg.norm(u, axis=-1, keepdims=True)
    for b in (1, 2, 3, 4):
        cd = TurboQuantCodec(d, b, seed=3, rotation_kind=kind)
        D = ((cd.decode(cd.encode(u[None, None]))[0, 0] - u) ** 2).sum(-1).mean().item()
        assert 4.0 ** -b < D < math.sqrt(3) * math.pi / 2 * 4.0 ** -b, (b, D)


def test_turboquant_scores_mix_match_decode():
    from veloxquant.methods.turboquant import TurboQuantCodec
    for d, b in ((64, 2.5), (80, 3), (96, 1.5), (256, 4)):
        cd = TurboQuantCodec(d, b)
        x = mx.random.normal((1, 2, 9, d)) * 3; enc = cd.encode(x)
        dec = mx.expand_dims(cd.decode(enc), 2)
        q = mx.random.normal((1, 2, 3, 2, d)); p = mx.random.uniform(shape=(1, 2, 3, 2, 9))
        np.testing.assert_allclose(np.array(cd.scores(q, enc)), np.array(q @ dec.swapaxes(-1, -2)), atol=2e-3, rtol=1e-3)
        np.testing.assert_allclose(np.array(cd.mix(p, enc)), np.array(p @ dec), atol=2e-3, rtol=1e-3)


# ---------------------------------------------------------------- turboquant: the method
@pytest.mark.parametrize("kwargs, msg", [
    (dict(key_bits=5), r"key_bits=5 is not allowed; allowed values: \[1, 1.5, 2, 2.5, 3, 3.5, 4\]"),
    (dict(value_bits=0), "value_bits=0"),
    (dict(key_bits=2.25), "key_bits=2.25"),
    (dict(key_bits=True), "key_bits=True"),
    (dict(value_bits="3"), "value_bits='3'"),
    (dict(window=-1), "window=-1"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(rotation="random"), "rotation='random'"),
    (dict(codebook="laplace"), "codebook='laplace'"),
    (dict(bits=3), "bits=3: unknown option"),
    (dict(center="yes"), "center='yes'"),
    (dict(variant="qjl"), "variant='qjl'"),
    (dict(variant="prod", key_bits=1.5), "key_bits=1.5 is not allowed with variant='prod'"),
])
def test_turboquant_bad_config(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        vq.KVCacheConfig("turboquant", **kwargs)


@pytest.mark.parametrize("spec", ["turboquant", "turboquant:key_bits=2.5,value_bits=2,window=5",
                                  "turboquant:key_bits=4,value_bits=3.5,rotation=orthogonal,codebook=gaussian,seed=3",
                                  "turboquant:key_bits=3,value_bits=2,center=true",
                                  "turboquant:key_bits=2.5,value_bits=3,variant=prod,center=true"])
def test_turboquant_save_load_roundtrip(tiny_model, tmp_path, spec):
    from veloxquant.core import parse_method
    cfg = parse_method(spec)
    caches = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 120 + 3 for i in range(300)], (290, 1, 1, 8))
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches, {"note": "tq"})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta == {"note": "tq"} and [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.offset for c in loaded] == [c.offset for c in caches] == [300, 300]
    assert loaded[0].config == cfg
    nxt = [7, 8, 9]
    assert mx.array_equal(feed(tiny_model, caches, nxt, (3,)), feed(tiny_model, loaded, nxt, (3,))).item()
    assert mx.array_equal(feed(tiny_model, caches, [1], (1,)), feed(tiny_model, loaded, [1], (1,))).item()


def test_turboquant_trim_then_continue(tiny_model):
    cfg = vq.KVCacheConfig("turboquant", key_bits=3, value_bits=3)
    toks = list(range(10, 70))
    a = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, a, toks, (40, 5)); assert [c.trim(5) for c in a] == [5, 5]
    out_a = feed(tiny_model, a, toks[40:], (3, 1, 16))
    b = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, b, toks, (40,))
    assert mx.array_equal(out_a, feed(tiny_model, b, toks[40:], (3, 1, 16))).item()


def test_turboquant_close_to_fp16_and_ordered(tiny_model):
    toks = [i * 7 % 128 for i in range(200)]
    ref = feed(tiny_model, vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("fp16")), toks, (150, 1, 1, 48))
    errs = {}
    for b in (2, 4):
        out = feed(tiny_model, vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("turboquant", key_bits=b, value_bits=b)),
                   toks, (150, 1, 1, 48))
        errs[b] = mx.abs(out[:, 150:] - ref[:, 150:]).max().item()
    assert errs[4] < errs[2] and errs[4] < 0.5, errs


@pytest.mark.parametrize("bits, expect", [(3, 3 + 16 / 64), (2.5, 2.5 + 16 / 64), (4, 4 + 16 / 64), (1.5, 1.5 + 16 / 64)])
def test_turboquant_sizes_are_honest(tiny_model, bits, expect):
    cfg = vq.KVCacheConfig("turboquant", key_bits=bits, value_bits=bits, sinks=0, center=False, window=0)  # codes + norms only
    caches = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 128 for i in range(512)], (512,))
    rep = vq.cache_report(caches)
    assert rep["elements"] == 2 * 2 * 512 * 128  # layers x heads x tokens x (Dk + Dv)
    assert rep["nbytes"] == sum(a.nbytes for c in caches for s in (c.k_store, c.v_store) for a in s.arrays.values())
    assert rep["bits_per_element"] == pytest.approx(expect)  # codes + fp16 norm, 512 = 2 x 256 allocation steps: no headroom
    R = caches[0].k_codec.R
    assert rep["shared_bytes"] >= R.nbytes and rep["shared_bytes"] < R.nbytes + 4096


def test_turboquant_center_state_and_size(tiny_model):
    cfg = vq.KVCacheConfig("turboquant", key_bits=3, value_bits=3, center=True, sinks=4, window=0)
    caches = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 128 for i in range(512)], (512,))
    c = caches[0]
    assert c.k_codec.mu.shape == (1, 2, 1, 64) and "k_mu" in c.state and "v_mu" not in c.state  # keys only
    rep = vq.cache_report(caches)
    codes = sum(a.nbytes for c in caches for s in (c.k_store, c.v_store) for a in s.arrays.values())
    sinks = 2 * 2 * (2 * 4 * 64 * 2)  # layers x (k, v) x 2 heads x 4 tokens x 64 x fp16
    assert rep["nbytes"] == codes + sinks + 2 * (2 * 64 * 4)  # + fp32 mean key per layer and head


def test_turboquant_prod_unbiased_and_sizes(tiny_model):
    from veloxquant.methods.turboquant import TurboQuantProdCodec
    d, rho, errs = 64, 0.5, []
    for seed in range(24):
        mx.random.seed(seed); cd = TurboQuantProdCodec(d, 2, seed=seed)
        k = mx.random.normal((500, d)); k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
        w = mx.random.normal((500, d)); w = w - (w * k).sum(-1, keepdims=True) * k; w = w / mx.linalg.norm(w, axis=-1, keepdims=True)
        q = rho * k + math.sqrt(1 - rho * rho) * w
        enc = cd.encode(k[None, None])
        s = cd.scores(q[None, None, None], enc)[0, 0, 0]          # [500, 500]: diagonal = own pair
        errs.append(mx.diagonal(s) - rho)
    e = mx.concatenate(errs)
    assert abs(e.mean().item()) < 4 * e.std().item() / math.sqrt(e.size)
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("turboquant", key_bits=3, value_bits=3, variant="prod", window=0,
                                                                        sinks=0, center=False))
    feed(tiny_model, caches, [i % 128 for i in range(512)], (512,))
    # keys: 2-bit MSE codes + fp16 norm + 64 sign bits + fp16 gamma; values: 3-bit codes + fp16 norm
    assert vq.cache_report(caches)["bits_per_element"] == pytest.approx(((2 * 64 + 16 + 64 + 16) + (3 * 64 + 16)) / 128)


def test_turboquant_tampered_state_refused(tiny_model):
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("turboquant", key_bits=3, value_bits=3, center=True, window=0))
    feed(tiny_model, caches, list(range(20)), (20,))
    st_ = dict(caches[0].state)
    bad = dict(st_, config=vq.KVCacheConfig("turboquant", key_bits=2, value_bits=3, window=0).to_json())
    with pytest.raises(ValueError, match="checksum does not match"):
        type(caches[0]).from_state(bad)
    from veloxquant.cache import seal_state  # behind the checksum, the layout check (a forger who recomputes the checksum)
    with pytest.raises(ValueError, match="do not match method 'turboquant'"):
        type(caches[0]).from_state(seal_state(bad))
    ok = type(caches[0]).from_state(st_)
    # the saved mean key, never one left by the layout probe; values are not centered
    assert ok.offset == 20 and mx.array_equal(ok.k_codec.mu, st_["k_mu"]).item() and ok.v_codec.mu is None


@pytest.mark.parametrize("b", [1.5, 2.5, 3.5])
def test_turboquant_fractional_bits_mix_the_two_widths(b):
    "A fractional width splits the rotated coordinates: its distortion is the channel-weighted mix of ⌊b⌋ and ⌈b⌉ bits."
    from veloxquant.methods.turboquant import TurboQuantCodec
    mx.random.seed(2)
    u = mx.random.normal((4096, 64)); u = u / mx.linalg.norm(u, axis=-1, keepdims=True)
    D = lambda bits: ((lambda cd: ((cd.decode(cd.encode(u[None, None]))[0, 0] - u) ** 2).sum(-1).mean().item())(TurboQuantCodec(64, bits)))
    lo, hi, mid = D(int(b)), D(int(b) + 1), D(b)
    assert hi < mid < lo and mid == pytest.approx((lo + hi) / 2, rel=0.05), (lo, mid, hi)
    assert 4.0 ** -b < mid < math.sqrt(3) * math.pi / 2 * 4.0 ** -b
