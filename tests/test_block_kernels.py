"""The llama.cpp block formats (`q4_0`, `q8_0`) on `affine`'s fused decode kernel: their stored arrays read as
`mx.quantize`'s layout (`q8_0.block_arrays`) decode to the codec's own values (any device), and on a GPU (`-m gpu`) a
decode step through the kernel equals the reference path over the same codes (window buffer, sinks, GQA, batch)."""
import mlx.core as mx
import pytest

import veloxquant as vq  # noqa: F401  (registers every method)
import veloxquant.gpu as gpu
from veloxquant.core import parse_method
from veloxquant.methods.q8_0 import QK, Q8_0Codec, block_arrays
from veloxquant.methods.q4_0 import Q4_0Codec


@pytest.mark.parametrize("codec_cls", [Q8_0Codec, Q4_0Codec])
def test_block_arrays_are_the_affine_layout(codec_cls):
    mx.random.seed(0)
    c = codec_cls(128)
    x = mx.random.normal((2, 3, 50, 128)) * mx.array([0.1, 1.0, 30.0]).reshape(1, 3, 1, 1)
    blk = c.encode(x)
    w, s, b = block_arrays(codec_cls.offset)(blk)
    assert s.dtype == b.dtype == mx.float16 and b.shape == s.shape == (2, 3, 50, 128 // QK)
    got = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=QK, bits=codec_cls.bits)
    assert mx.array_equal(got, c.decode(blk)).item()  # -offset·d is exact in float16: the same values


def test_hook_with_kernels_only():
    with pytest.raises(ValueError, match="use_kernels"):
        parse_method("q4_0:use_kernels=2")
    for spec, on in (("q4_0", True), ("q8_0", True), ("q4_0:hadamard=true", True), ("q8_0:hadamard=true,seed=3", True),
                     ("q4_0:use_kernels=false", False), ("q4_0:hadamard=true,use_kernels=false", False)):
        c = parse_method(spec).make_cache(); c._ensure_codecs(128, 128)
        assert (c._fused() is not None) == (on and gpu.backend() is not None), spec  # no kernel on the CPU: the CPU paths as before


def _pair(spec, B, Hkv, rep, D, n, sinks=False, in_window=True):
    "(kernel, reference) outputs of one decode step of two caches holding the same tokens."
    outs = []
    for s in (spec, spec + (",use_kernels=false" if ":" in spec else ":use_kernels=false")):
        mx.random.seed(1)
        c = parse_method(s).make_cache(); c.tiled_decode = False; c.compiled_decode = False
        k, v = (mx.random.normal((B, Hkv, n, D)).astype(mx.float16) for _ in "kv")
        c.update_and_fetch(k, v); c.attend(mx.random.normal((B, Hkv * rep, n, D)).astype(mx.float16), k, v, D ** -0.5, "causal")
        k1, v1 = (mx.random.normal((B, Hkv, 1, D)).astype(mx.float16 if in_window else mx.float32) for _ in "kv")
        c.update_and_fetch(k1, v1)
        q = mx.random.normal((B, Hkv * rep, 1, D)).astype(mx.float16)
        sk = mx.random.normal((Hkv * rep,)) if sinks else None
        outs.append((c.attend(q, k1, v1, D ** -0.5, None, sk), c))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["q4_0", "q8_0", "q4_0:window=0", "q8_0:sinks=4", "q4_0:sinks=2,window=16", "q4_0:hadamard=true",
                                  "q8_0:hadamard=true,sinks=4,seed=5"])
@pytest.mark.parametrize("B, Hkv, rep, D, n", [(1, 8, 4, 128, 3000), (2, 2, 3, 64, 1300), (1, 2, 1, 128, 700), (3, 4, 8, 128, 2049)])
def test_kernel_equals_reference(spec, B, Hkv, rep, D, n):
    (out, c), (ref, r) = _pair(spec, B, Hkv, rep, D, n, sinks=(rep == 3))
    assert c._fused() is not None and r._fused() is None
    assert out.shape == ref.shape == (B, Hkv * rep, 1, D) and out.dtype == ref.dtype
    assert mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), rtol=3e-3, atol=3e-3).item(), float(mx.abs(out - ref).max())
