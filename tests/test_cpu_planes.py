"""The CPU decode path over code planes (`veloxquant.quant.code_planes`) gives the reference path's attention within
float32 rounding: affine (mx.quantized_matmul) and turboquant (codebook gathers), through the cache and the dispatcher,
prefill chunks and decode steps, several layouts. CPU only (the GPU back-ends never take this path)."""
import numpy as np, pytest
import mlx.core as mx
import mlx_lm.models.base as base
import veloxquant.gpu as gpu
from veloxquant.core import parse_method
from veloxquant.methods.affine import AffineCodec
from veloxquant.methods.turboquant import TurboQuantCodec

pytestmark = pytest.mark.skipif(gpu.backend() is not None, reason="the code-plane path runs on the CPU back-end only")

SPECS = ["affine:key_bits=4,value_bits=4", "affine:key_bits=2,value_bits=3,group_size=32", "affine:key_bits=4,value_bits=2,window=0",
         "affine:key_bits=5,value_bits=8",  # widths the planes do not read: the quantized matmul, unchanged
         "turboquant:key_bits=3,value_bits=3", "turboquant:key_bits=4,value_bits=2,window=0", "turboquant:key_bits=2.5,value_bits=3.5",
         "turboquant:key_bits=3,value_bits=3,center=True,window=16", "turboquant:key_bits=1,value_bits=4,rotation=orthogonal"]

def _run(spec, reference, D=64, steps=5):
    mx.random.seed(0)
    off = []
    if reference:  # the reference path: the planes switched off
        off = [(AffineCodec, "_planes", lambda self, blk: None), (TurboQuantCodec, "_cpu_planes", lambda self, blk: None)]
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in off]
    for cls, name, f in off: setattr(cls, name, f)
    try:
        cache = parse_method(spec).make_cache(); outs = []
        for T in (200, 150, *[1] * steps):
            k, v, q = mx.random.normal((1, 3, T, D)), mx.random.normal((1, 3, T, D)), mx.random.normal((1, 9, T, D))
            k1, v1 = cache.update_and_fetch(k, v)
            outs.append(base.scaled_dot_product_attention(q, k1, v1, cache=cache, scale=D ** -0.5, mask="causal" if T > 1 else None))
        mx.eval(outs)
        return outs
    finally:
        for cls, name, f in saved: setattr(cls, name, f)

@pytest.mark.parametrize("spec", SPECS)
def test_planes_match_reference(spec):
    new, ref = _run(spec, False), _run(spec, True)
    for a, b in zip(new, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = mx.abs(a - b).max().item(); scale = mx.abs(b).max().item()
        assert err <= 2e-5 * max(1.0, scale), (spec, err, scale)

def test_planes_decode_match_reference():
    mx.random.seed(1)
    for bits in (1, 2, 2.5, 3, 3.5, 4):
        c = TurboQuantCodec(64, bits); c.cpu_fast = True; blk = c.encode(mx.random.normal((2, 3, 40, 64)))
        assert c._cpu_planes(blk) is not None
        ref = (c.rotated_unit(blk) * blk["norm"].astype(mx.float32)) @ c.R.T
        assert mx.abs(c.decode(blk) - ref).max().item() < 1e-5

def test_one_pass_decode_matches_online_softmax():
    "A CPU decode step (one query, no mask, no sinks) takes one softmax over all scores; the online softmax (forced by an all-True mask) agrees."
    from veloxquant.attention import blockwise_attention, dense_blocks
    mx.random.seed(2)
    for B, Hq, Hkv, S, E in ((1, 9, 3, 700, 70), (2, 4, 4, 64, 1), (1, 8, 2, 0, 5)):
        q = mx.random.normal((B, Hq, 1, 64)); k, v = mx.random.normal((B, Hkv, S + E, 64)), mx.random.normal((B, Hkv, S + E, 64))
        blocks = lambda: dense_blocks(k[:, :, :S], v[:, :, :S], 256)
        one = blockwise_attention(q, S, blocks(), k[:, :, S:], v[:, :, S:], 0.125, one_pass=True)
        online = blockwise_attention(q, S, blocks(), k[:, :, S:], v[:, :, S:], 0.125, mask=mx.ones((1, 1, 1, S + E), mx.bool_))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
        assert mx.abs(one - online).max().item() < 1e-5 and mx.abs(one - ref).max().item() < 1e-5
    test = lambda: blockwise_attention(q, 3, dense_blocks(k[:, :, :S], v[:, :, :S], 256), k[:, :, S:], v[:, :, S:], 0.125, one_pass=True)
    with pytest.raises(ValueError, match="n_hist=3"): test()

@pytest.mark.parametrize("spec", ["affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3", "turboquant:key_bits=2.5,value_bits=3,window=0"])
def test_cpu_decoded_prefill_matches_blockwise(spec):
    "On the CPU these codecs set `cpu_fast`: prefill chunks over codes attend to the decoded history; the blockwise path agrees."
    from veloxquant.cache import VQCache
    outs = {}
    for mode in (None, False):
        VQCache.decoded_prefill = mode
        try:
            mx.random.seed(3); cache = parse_method(spec).make_cache(); res = []
            for T in (300, 200, 150):
                k, v, q = mx.random.normal((1, 3, T, 64)), mx.random.normal((1, 3, T, 64)), mx.random.normal((1, 9, T, 64))
                k1, v1 = cache.update_and_fetch(k, v)
                if mode is None and cache.k_store.length: assert cache._use_decoded_prefill()
                res.append(base.scaled_dot_product_attention(q, k1, v1, cache=cache, scale=0.125, mask="causal"))
            mx.eval(res); outs[mode] = res
        finally: VQCache.decoded_prefill = None
    for a, b in zip(outs[None], outs[False]): assert mx.abs(a - b).max().item() < 2e-5

def test_cpu_fast_is_opt_in():
    "Only the affine and turboquant methods' codecs set `cpu_fast` (the code planes, decoded prefill, one-pass decode on the CPU); methods reusing AffineCodec/TurboQuantCodec keep their outputs bit for bit."
    got = {}
    for spec in ("affine", "turboquant", "q4_0", "qjl", "polar"):
        c = parse_method(spec).make_cache(); c.update_and_fetch(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))
        got[spec] = (c._cpu_fast(), getattr(c.v_codec, "cpu_fast", False))
    # qjl and polar store their values with AffineCodec: not opted in, so their values keep mx.quantized_matmul
    assert got == {"affine": (True, True), "turboquant": (True, True), "q4_0": (False, False), "qjl": (False, False), "polar": (False, False)}
