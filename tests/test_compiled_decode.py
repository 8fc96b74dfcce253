"""The compiled decode path (`veloxquant.cache.compiled_decode_attention`) against the reference path over the same
codes, for every method whose codecs opt in, forced on the CPU (`VQCache.compiled_decode = True`)."""
import mlx.core as mx
import pytest

import veloxquant as vq
import veloxquant.cache as vcache
import veloxquant.gpu as gpu
from veloxquant.core import parse_method

SPECS = ["q4_0:use_kernels=false", "q8_0:use_kernels=false", "q8_0:hadamard=true,use_kernels=false", "qjl", "polar", "turboquant_rvq", "affine:use_kernels=false",
         "turboquant:use_kernels=false", "turboquant:variant=prod,use_kernels=false",
         "kivi", "kivi:group_size=128,value_group=64,window=0", "kitty", "gear:outlier_pct=1.0", "rabitq:use_kernels=false",
         "rabitq:rotation=hadamard,value_bits=2,value_group=32,use_kernels=false"]
SHAPES = [(1, 1, 700, 256), (2, 3, 1300, 512), (2, 3, 333, 8192)]  # (B, rep, codes + window, block size)


def decode_pair(spec, B, Hkv, rep, D, n, bs, sinks=False, dtype=mx.float32):
    mx.random.seed(1)
    c = parse_method(spec).make_cache(); c.block_size = bs
    c.cpu_step = False  # this path, not the CPU step of cpu_fast codecs (tests/test_fast_path.py)
    k, v = (mx.random.normal((B, Hkv, n, D)).astype(mx.float16) for _ in "kv")
    c.update_and_fetch(k, v); c.attend(mx.random.normal((B, Hkv * rep, n, D)), k, v, D ** -0.5, "causal")
    k1, v1 = (mx.random.normal((B, Hkv, 1, D)).astype(mx.float16) for _ in "kv")
    c.update_and_fetch(k1, v1); c.pending = None  # attend twice over the same state (no flush of the step's tokens)
    q = mx.random.normal((B, Hkv * rep, 1, D)).astype(dtype)
    sk = mx.random.normal((Hkv * rep,)) if sinks else None
    outs, calls = [], []
    orig = vcache.compiled_decode_attention
    def spy(*a, **kw):
        r = orig(*a, **kw); calls.append(r is not None); return r
    vcache.compiled_decode_attention = spy
    try:
        for flag in (True, False):
            c.compiled_decode = flag
            outs.append(c.attend(q, k1, v1, D ** -0.5, None, sk))
    finally:
        vcache.compiled_decode_attention = orig
    return outs[0], outs[1], calls, c


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_equals_reference(spec, shape):
    B, rep, n, bs = shape
    out, ref, calls, c = decode_pair(spec, B, 2, rep, 64, n, bs)
    assert c.k_store.length > 0
    assert calls == [True], calls  # the compiled path ran (once: the reference run does not call it)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert mx.allclose(out, ref, rtol=1e-5, atol=1e-6).item(), float(mx.abs(out - ref).max())


@pytest.mark.parametrize("spec", ["q4_0:sinks=4,use_kernels=false", "polar:window=0", "turboquant_rvq:sinks=3,window=16"])
def test_compiled_sinks_windows_dtypes(spec):
    for dtype in (mx.float32, mx.float16):
        out, ref, calls, _ = decode_pair(spec, 1, 2, 3, 128, 900, 256, sinks=True, dtype=dtype)
        assert calls == [True] and out.dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == mx.float32 else dict(rtol=1e-3, atol=1e-3)
        assert mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), **tol).item()


def test_not_compiled_where_unsafe_or_cpu_default():
    assert not parse_method("turboquant:center=true").make_cache()._make_codecs(64, 64)[0].compilable
    out, ref, calls, c = decode_pair("turboquant:center=true,use_kernels=false", 1, 2, 1, 64, 700, 256)
    assert calls == [True]  # the centered keys score uncompiled (their mean stays live); softmax and values compiled
    assert mx.allclose(out, ref, rtol=1e-5, atol=1e-6).item()
    c = parse_method("q4_0").make_cache()
    assert c.compiled_decode is False and not c._use_compiled()  # off by default
    c.compiled_decode = None; assert c._use_compiled() == (gpu.backend() is not None)  # None: GPU back-ends only


def test_traced_shapes_bounded():
    "Many decode steps trace a bounded number of window sizes (`decode_plan`), not one per step."
    sizes = {P for n in range(1, 70000, 13) for _, P, _ in vcache.decode_plan(n, 8192)}
    assert len(sizes) <= 15, sizes
