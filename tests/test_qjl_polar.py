"""`qjl` (1-bit JL sign sketch of keys) and `polar` (PolarQuant): theory, sizes, contract (tiny random model)."""
import math
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import veloxquant as vq
from veloxquant import gpu
from veloxquant.methods import qjl
from veloxquant.methods.qjl import QJL_QUERY_BITS, QJLKeyCodec
from veloxquant.methods.polar import PolarKeyCodec


def feed(model, caches, toks, chunks):
    outs, s = [], 0
    for c in chunks:
        outs.append(model(mx.array(toks[s:s + c])[None], cache=caches)); s += c
    return mx.concatenate(outs, axis=1)


def _qjl_errors(m, d=64, rho=0.5, n=500, seeds=48):
    "Errors of the QJL inner-product estimate for unit (k, q) with <k, q> = rho, a fresh S per seed."
    errs = []
    for seed in range(seeds):
        mx.random.seed(7000 + seed)
        codec = QJLKeyCodec(d, m, seed=seed)
        k = mx.random.normal((n, d)); k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
        w = mx.random.normal((n, d)); w = w - (w * k).sum(-1, keepdims=True) * k
        w = w / mx.linalg.norm(w, axis=-1, keepdims=True)
        q = rho * k + math.sqrt(1 - rho * rho) * w
        enc = codec.encode(k[None, None])
        # the estimator exactly as attention computes it: scores of each query against its own key
        s = codec.scores(q[None, None, None], enc)[0, 0, 0]  # [n, n]
        errs.append(mx.diagonal(s) - rho)
    return mx.concatenate(errs)


def test_qjl_unbiased_and_variance_shrinks_as_1_over_m():
    theory = math.pi / 2 - 0.25  # m · Var for unit vectors with rho = 0.5
    var = {}
    for m in (64, 256):
        e = _qjl_errors(m)
        mean, v = e.mean().item(), e.var().item()
        se = math.sqrt(v / e.size)
        assert abs(mean) < 4 * se and abs(mean) / 0.5 < 0.01, (m, mean, se)  # unbiased: mean relative error < 1%
        assert abs(m * v / theory - 1) < 0.12, (m, m * v)
        var[m] = v
    assert 3.3 < var[64] / var[256] < 4.8, var  # ~1/m


def test_polar_error_decreases_with_bits():
    mx.random.seed(0)
    x = mx.random.normal((1, 1, 2048, 64))
    for levels in (4, 0):
        errs = []
        for kb, db in ((2, 1), (3, 1), (3, 2), (4, 2), (4, 3)):
            cd = PolarKeyCodec(64, kb, db, levels)
            e = cd.decode(cd.encode(x)) - x
            errs.append(((e * e).sum(-1) / (x * x).sum(-1)).mean().item())
        assert all(a > b for a, b in zip(errs, errs[1:])), (levels, errs)
        assert errs[-1] < 0.03


@pytest.mark.parametrize("cfg,key_bits", [
    (vq.KVCacheConfig("qjl", window=0), 128 + 16),                                     # m = 2d sign bits + fp16 norm
    (vq.KVCacheConfig("qjl", sketch_dim=64, value_bits=2, value_group=32, window=0), 64 + 16),
    (vq.KVCacheConfig("polar", window=0), 32 * 4 + 64 + 4 * 16),                       # level-1 4-bit, 28 2-bit codes in 2 words, 4 radii
    (vq.KVCacheConfig("polar", levels=0, key_bits=3, deep_bits=1, window=0), 96 + 32 + 16),
])
def test_exact_bits_per_element(tiny_model, cfg, key_bits):
    caches = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 128 for i in range(512)], (512,))
    rep = vq.cache_report(caches)
    o = cfg.options
    value_bits = 64 * o.value_bits + 2 * 16 * 64 // o.value_group
    assert rep["elements"] == 2 * 2 * 512 * 128
    assert rep["nbytes"] == sum(a.nbytes for c in caches for s in (c.k_store, c.v_store) for a in s.arrays.values())
    assert rep["bits_per_element"] == pytest.approx((key_bits + value_bits) / 128)


@pytest.mark.parametrize("cfg", [vq.KVCacheConfig("qjl", window=5), vq.KVCacheConfig("qjl", sketch_dim=96, value_bits=2, value_group=32),
                                 vq.KVCacheConfig("polar", window=5), vq.KVCacheConfig("polar", levels=0, value_bits=8)])
def test_save_load_roundtrip(tiny_model, tmp_path, cfg):
    caches = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 120 + 3 for i in range(300)], (290, 1, 1, 8))
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches, {"note": "x"})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta == {"note": "x"} and [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.offset for c in loaded] == [c.offset for c in caches] == [300, 300]
    assert [c.config.to_json() for c in loaded] == [c.config.to_json() for c in caches]
    nxt = [7, 8, 9]
    assert mx.array_equal(feed(tiny_model, caches, nxt, (3,)), feed(tiny_model, loaded, nxt, (3,))).item()
    assert mx.array_equal(feed(tiny_model, caches, [1], (1,)), feed(tiny_model, loaded, [1], (1,))).item()


def test_compressed_attention_close_to_fp16_tiny(tiny_model):
    "Higher-precision settings stay close to the fp16 cache's logits on the tiny model (sanity of the whole path)."
    toks = [i % 120 + 3 for i in range(200)]
    ref = feed(tiny_model, vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("fp16")), toks, (190, 1, 1, 8))
    for cfg in (vq.KVCacheConfig("qjl", sketch_dim=1024, value_bits=8), vq.KVCacheConfig("polar", deep_bits=4, value_bits=8)):
        out = feed(tiny_model, vq.KVCacheBuilder.for_model(tiny_model, cfg), toks, (190, 1, 1, 8))
        err = (mx.abs(out[:, 190:] - ref[:, 190:]).max() / mx.abs(ref[:, 190:]).max()).item()
        assert err < 0.1, (cfg.method, err)


@pytest.mark.parametrize("method,kwargs,msg", [
    ("qjl", dict(sketch_dim=48), "sketch_dim=48"),
    ("qjl", dict(sketch_dim=-1), "sketch_dim=-1"),
    ("qjl", dict(value_bits=3), "value_bits=3"),
    ("qjl", dict(value_group=128), "value_group=128"),
    ("qjl", dict(window=-2), "window=-2"),
    ("qjl", dict(seed=1.5), "seed=1.5"),
    ("qjl", dict(bogus=1), "bogus"),
    ("qjl", dict(use_kernels=1), "use_kernels=1"),
    ("polar", dict(key_bits=1), "key_bits=1"),
    ("polar", dict(deep_bits=5), "deep_bits=5"),
    ("polar", dict(levels=-1), "levels=-1"),
    ("polar", dict(levels="4"), "levels='4'"),
    ("polar", dict(value_bits=True), "value_bits=True"),
])
def test_bad_options(method, kwargs, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        vq.KVCacheConfig(method, **kwargs)


def test_polar_levels_must_fit_head_dim():
    with pytest.raises(ValueError, match="levels=5"):
        PolarKeyCodec(80, levels=5)


def _qjl_scores_case(m, rep, L, T=700, d=64, seed=11, use_kernels=True):
    "A QJL codec, encoded random keys (fp16, as the cache passes them) and grouped queries [1, 3, rep, L, d]."
    mx.random.seed(seed)
    codec = QJLKeyCodec(d, m, seed=seed, use_kernels=use_kernels)
    k = (mx.random.normal((1, 3, T, d)) * 2 + 0.5).astype(mx.float16)
    q = mx.random.normal((1, 3, rep, L, d))
    return codec, codec.encode(k), q, k.astype(mx.float32)


def _query_bound(codec, q, enc, qb):
    "Hard bound of |quantized − unquantized| scores: √(π/2)/m · ‖k‖ · m · δ/2, δ = (max − min)/(2^qb − 1) of each row of S q."
    u = q @ codec.ST
    delta = (u.max(-1, keepdims=True) - u.min(-1, keepdims=True)) / ((1 << qb) - 1)
    return codec.c * enc["norm"].astype(mx.float32)[:, :, None, None, :, 0] * codec.m * delta / 2


@pytest.mark.parametrize("m,rep,L", [(128, 3, 1), (256, 4, 2), (96, 2, 1)])
def test_qjl_scores_match_sign_score_reference(m, rep, L):
    """CPU: the kernel's MLX reference, fed the codec's storage through the codec's adapter, gives the codec's scores
    up to the query quantization (within its hard bound; RMS < 2% of the estimator's own error)."""
    codec, enc, q, k = _qjl_scores_case(m, rep, L, use_kernels=False)
    ref = codec.scores(q, enc)                                                  # MLX path, unquantized S q
    got = codec.kernel_scores(q, enc, qjl.sign_scores_reference)
    assert got.shape == ref.shape == (1, 3, rep, L, k.shape[2]) and got.dtype == mx.float32
    diff = mx.abs(got - ref)
    assert (diff <= _query_bound(codec, q, enc, QJL_QUERY_BITS) * 1.001 + 1e-4).all().item()
    est_err = mx.sqrt(((ref - q @ mx.expand_dims(k, 2).swapaxes(-1, -2)) ** 2).mean()).item()
    assert mx.sqrt((diff ** 2).mean()).item() < 0.02 * est_err
    if L == 1:  # the layout by hand, without the adapter: u [B, Hkv, rep, m], signs/norms as stored
        direct = qjl.sign_scores_reference((q @ codec.ST)[..., 0, :], enc["signs"], enc["norm"], k.shape[2], QJL_QUERY_BITS)
        np.testing.assert_allclose(np.array(direct), np.array(got[..., 0, :]), rtol=1e-5, atol=1e-5)
    # fewer bit planes: larger error, still within its bound (the bound is what the adapter's tolerance rests on)
    got4 = codec.kernel_scores(q, enc, lambda u, s, nk, t, _: qjl.sign_scores_reference(u, s, nk, t, 4))
    d4 = mx.abs(got4 - ref)
    assert (d4 <= _query_bound(codec, q, enc, 4) * 1.001 + 1e-4).all().item()
    assert mx.sqrt((d4 ** 2).mean()).item() > 4 * mx.sqrt((diff ** 2).mean()).item()


def test_qjl_kernel_path_selection():
    q1, q_many = mx.zeros((1, 3, 3, 1, 64)), mx.zeros((1, 3, 3, 4, 64))   # 3 and 12 query rows per KV head
    assert QJLKeyCodec(64, 128).kernel_applies(q1) == (gpu.backend() is not None)
    assert not QJLKeyCodec(64, 128, use_kernels=False).kernel_applies(q1)
    assert not QJLKeyCodec(64, 96).kernel_applies(q1)                    # m not a multiple of 128
    assert not QJLKeyCodec(64, 128).kernel_applies(q_many)               # prefill-sized chunk: MLX path
    for flag in (True, False):  # the option reaches the key codec
        cache = vq.KVCacheConfig("qjl", use_kernels=flag).make_cache()
        cache.update_and_fetch(mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 4, 64)))
        assert cache.k_codec.use_kernels is flag


@pytest.mark.gpu
@pytest.mark.parametrize("m,rep,L,T", [(128, 3, 1, 700), (256, 4, 1, 5000), (256, 2, 3, 300)])
def test_qjl_scores_kernel_vs_mlx_gpu(m, rep, L, T):
    "GPU: `QJLKeyCodec.scores` with use_kernels=True (XOR/popcount kernel) vs False (MLX), same codec and data."
    codec, enc, q, k = _qjl_scores_case(m, rep, L, T=T)
    assert codec.kernel_applies(q)
    on = codec.scores(q, enc)
    codec.use_kernels = False
    off = codec.scores(q, enc)
    assert on.shape == off.shape == (1, 3, rep, L, T)
    scale = mx.sqrt((off ** 2).mean()).item()                           # the MLX matmul runs in TF32 on CUDA: small slack
    assert (mx.abs(on - off) <= _query_bound(codec, q, enc, QJL_QUERY_BITS) * 1.001 + 2e-3 * scale).all().item()
    est_err = mx.sqrt(((off - q @ mx.expand_dims(k, 2).swapaxes(-1, -2)) ** 2).mean()).item()
    assert mx.sqrt(((on - off) ** 2).mean()).item() < 0.02 * est_err


@pytest.mark.gpu
def test_qjl_cache_decode_kernel_vs_mlx_gpu():
    "GPU: one decode step through two `qjl` caches (use_kernels True / False) on the same tokens: close attention outputs (the sign-score kernel: the coded path off)."
    outs = []
    for flag in (True, False):
        mx.random.seed(2)
        cache = vq.KVCacheConfig("qjl", sketch_dim=256, use_kernels=flag).make_cache(); cache.coded_decode = False
        k, v = mx.random.normal((1, 8, 3000, 128)), mx.random.normal((1, 8, 3000, 128))
        cache.update_and_fetch(k[:, :, :-1], v[:, :, :-1]); cache._flush()
        kn, vn = cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
        q = mx.random.normal((1, 32, 1, 128))
        assert cache.k_codec.kernel_applies(q.reshape(1, 8, 4, 1, 128)) == flag
        outs.append(cache.attend(q, kn, vn, 128 ** -0.5, None))
    assert outs[0].shape == (1, 32, 1, 128)
    np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_qjl_kernel_in_generation_gpu(tiny_model, monkeypatch):
    "GPU: decode steps of the tiny model through `qjl` caches call the kernel (use_kernels=True) and give the MLX path's logits."
    calls = []
    real_fn = qjl.sign_scores
    monkeypatch.setattr(qjl, "sign_scores", lambda *a, **k: calls.append(1) or real_fn(*a, **k))
    monkeypatch.setattr(vq.cache.VQCache, "coded_decode", False)  # the codes-in-one-kernel path goes first (tests/test_coded_decode.py)
    toks = [i % 120 + 3 for i in range(300)]
    outs = []
    for uk in (True, False):
        caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("qjl", use_kernels=uk))  # m = 128 (head_dim 64)
        tiny_model(mx.array(toks[:280])[None], cache=caches)
        n0 = len(calls)
        outs.append(mx.concatenate([tiny_model(mx.array([[t]]), cache=caches) for t in toks[280:]], axis=1))
        assert (len(calls) > n0) == uk
    ref = np.array(outs[1])
    assert np.abs(np.array(outs[0]) - ref).max() < 2e-2 * np.abs(ref).max()
