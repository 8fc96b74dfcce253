"""The decode over codes inside one kernel (`veloxquant.tiles.coded_decode`): every codec's `TileReader` decodes each
stored token to exactly its `key_tile` / `value_tile` (run on the host through g++, tests/reader_host.py: no GPU needed),
and on a GPU (`-m gpu`) the kernel's decode step equals the reference path and is the one a decode step takes."""
import shutil

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq  # noqa: F401  (registers every method)
import veloxquant.gpu as gpu
import veloxquant.tiles as tiles
from veloxquant.cache import TokenStore
from veloxquant.core import parse_method
from veloxquant.methods.affine import AffineCodec

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

SPECS = ["kivi", "kivi_sink", "kivi:key_bits=3,value_bits=3", "kivi:key_bits=4,value_bits=4,group_size=128,value_group=64",
         "polar", "polar:levels=0", "polar:key_bits=3,deep_bits=3,value_bits=2,value_group=32",
         "gear", "gear:key_bits=4,value_bits=4,rank=2,group_size=64", "gear:rank=0",
         "turboquant_rvq", "turboquant_rvq:passes=3,bits_per_pass=2,residual_scale=rms",
         "qjl", "qjl:sketch_dim=96", "rabitq", "rabitq:rotation=hadamard,value_bits=2,value_group=32"]


def _store(codec, x):
    s = TokenStore(); s.append(codec.encode(x)); return s


@needs_gxx
@pytest.mark.parametrize("spec", SPECS)
def test_reader_equals_tiles(spec):
    from reader_host import run_reader
    mx.random.seed(0)
    D, T = 128, 384  # a capacity (512) beyond the tokens: the readers index rows by the stores' capacity
    kc, vc = parse_method(spec).make_cache()._make_codecs(D, D)
    x = mx.random.normal((2, 3, T, D)) * mx.array(np.linspace(0.5, 3.0, D).astype(np.float32))
    for codec, tile in ((kc, kc.key_tile), (vc, vc.value_tile)):
        r = codec.tile_reader()
        assert r is not None, (spec, type(codec).__name__)
        st = _store(codec, x)
        assert st.arrays[next(iter(r.fields))].shape[2] == 512
        got = run_reader(r, st.arrays, T)
        want = np.array(tile(st.slice(0, T), mx.float32))
        assert got.shape == want.shape, (got.shape, want.shape)
        err = np.abs(got - want).max() / (np.abs(want).max() + 1e-12)
        assert err < 2e-5, (spec, type(codec).__name__, err)


@needs_gxx
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_quantized_reader_every_width(bits, gs):
    from reader_host import run_reader
    mx.random.seed(bits)
    c = AffineCodec(128, bits, gs)
    x = mx.random.normal((1, 2, 256 + 7, 128))
    st = _store(c, x)
    np.testing.assert_allclose(run_reader(c.tile_reader(), st.arrays, 263), np.array(c.decode(st.slice(0, 263))), rtol=1e-5, atol=1e-5)


def test_who_gives_a_reader():
    "Outliers (gear), `use_kernels=False` (qjl, rabitq) and a subclass's own arithmetic give none; the kernel takes dims up to 256."
    assert parse_method("gear:outlier_pct=1.0").make_cache()._make_codecs(128, 128)[0].tile_reader() is None
    assert parse_method("qjl:use_kernels=false").make_cache()._make_codecs(128, 128)[0].tile_reader() is None
    assert parse_method("rabitq:use_kernels=false").make_cache()._make_codecs(128, 128)[0].tile_reader() is None
    class Other(AffineCodec):
        def decode(self, blk): return super().decode(blk) * 2
    assert Other(128, 4, 64).tile_reader() is None and AffineCodec(128, 4, 64).tile_reader() is not None
    r64, r96 = AffineCodec(64, 4, 32).tile_reader(), parse_method("qjl:sketch_dim=96").make_cache()._make_codecs(64, 64)[0].tile_reader()
    assert tiles.coded_supported(r64, r64, 4) and not tiles.coded_supported(r96, r64, 4)
    assert not tiles.coded_supported(AffineCodec(512, 4, 64).tile_reader(), r64, 4)
    with pytest.raises(ValueError, match="fields is empty"): tiles.TileReader("", {}, 64)


def test_subclasses_and_settings_are_asked_again():
    "A subclass overriding the arithmetic below the class that gives the reader gets none (any codec); a changed `use_kernels` is seen."
    from veloxquant.channel import ChannelCodec
    from veloxquant.methods.polar import PolarKeyCodec
    class K(ChannelCodec):
        def decode(self, blk): return super().decode(blk) * 2
    class P(PolarKeyCodec):
        def rotated(self, blk): return super().rotated(blk) * 2
    class A(AffineCodec):
        def decode_as(self, blk, dtype): return super().decode_as(blk, dtype) * 2
    for c in (K(128, 2, 32), P(128), A(128, 4, 64)): assert tiles._reader(c) is None, type(c).__name__
    assert tiles._reader(ChannelCodec(128, 2, 32)) is not None and tiles._reader(PolarKeyCodec(128)) is not None
    kc = parse_method("qjl").make_cache()._make_codecs(128, 128)[0]
    assert tiles._reader(kc) is not None
    kc.use_kernels = False
    assert tiles._reader(kc) is None


def test_cpu_takes_no_coded_path():
    "Without a GPU back-end `coded_decode` declines (None) and the cache's outputs are the reference path's."
    if gpu.backend() is not None: pytest.skip("a GPU back-end")
    kc, vc = parse_method("kivi").make_cache()._make_codecs(64, 64)
    q = mx.zeros((1, 2, 1, 64)); e = mx.zeros((1, 2, 1, 64))
    assert tiles.coded_decode(kc, vc, q, {}, {}, 1, e, e, 0.125) is None


def _pair(spec, B, Hkv, rep, D, n, coded: bool, dtype=mx.float16, sinks=False):
    mx.random.seed(1)
    c = parse_method(spec).make_cache()
    k, v = (mx.random.normal((B, Hkv, n, D)).astype(dtype) for _ in "kv")
    c.update_and_fetch(k, v); c.attend(mx.random.normal((B, Hkv * rep, n, D)).astype(dtype), k, v, D ** -0.5, "causal")
    k1, v1 = (mx.random.normal((B, Hkv, 1, D)).astype(dtype) for _ in "kv")
    c.update_and_fetch(k1, v1); c.pending = None
    q = mx.random.normal((B, Hkv * rep, 1, D)).astype(dtype)
    sk = mx.random.normal((Hkv * rep,)) if sinks else None
    calls, orig = [], tiles.coded_partials
    def spy(*a, **kw):
        calls.append(1); return orig(*a, **kw)
    tiles.coded_partials = spy
    try:
        out = c.attend(q, k1, v1, D ** -0.5, None, sk)
    finally:
        tiles.coded_partials = orig
    c.tiled_decode = False; c.compiled_decode = False; c.fused_decode = None; c._fused_memo = (None, None)
    for codec in (c.k_codec, c.v_codec):
        if hasattr(codec, "use_kernels"): codec.use_kernels = False  # the MLX reference scores (no sign-score kernel)
    ref = c.attend(q, k1, v1, D ** -0.5, None, sk)
    return out, ref, calls


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1, 8, 4, 128, 3000), (2, 2, 3, 64, 1100), (3, 2, 8, 128, 700)])
def test_gpu_coded_equals_reference(spec, shape):
    B, Hkv, rep, D, n = shape
    if "sketch_dim=96" in spec: pytest.skip("dims not a multiple of 64: the tiles path")
    out, ref, calls = _pair(spec, B, Hkv, rep, D, n, True, sinks=(B == 2))
    assert calls == [1], calls
    assert mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), rtol=3e-3, atol=3e-3).item(), float(mx.abs(out - ref).max())


@needs_gxx
@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["polar", "kivi", "qjl"])
def test_gpu_coded_second_step_calls_directly(spec):
    """A cache's second step of one layout launches the kernels directly (without the safety net's per-call check,
    `coded_decode`): it gives the first step's answer for the same state and query."""
    B, Hkv, rep, D, n = 1, 8, 4, 128, 3000
    mx.random.seed(2)
    c = parse_method(spec).make_cache()
    k, v = (mx.random.normal((B, Hkv, n, D)).astype(mx.float16) for _ in "kv")
    c.update_and_fetch(k, v); c.attend(mx.random.normal((B, Hkv * rep, n, D)).astype(mx.float16), k, v, D ** -0.5, "causal")
    k1, v1 = (mx.random.normal((B, Hkv, 1, D)).astype(mx.float16) for _ in "kv")
    c.update_and_fetch(k1, v1); c.pending = None
    q = mx.random.normal((B, Hkv * rep, 1, D)).astype(mx.float16)
    first = c.attend(q, k1, v1, D ** -0.5, None)
    assert len(c.k_codec.__dict__.get("_coded_seen", ())) == 1  # the layout went through the safety net once
    second = c.attend(q, k1, v1, D ** -0.5, None)
    assert mx.array_equal(first, second).item()
