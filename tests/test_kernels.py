"""Kernels: plain-file copies in sync, CUDA bodies compile for sm_90, and (flag `gpu`) parity with the MLX reference."""
import os, shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from veloxquant import kernels
from veloxquant.attention import Partial, blockwise_attention

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_files_in_sync():
    for name, text in kernels.kernel_files().items():
        assert (ROOT / "kernels" / name).read_text() == text, f"kernels/{name} is out of sync: run nbs/06_kernels.ipynb"


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CI"), reason="nvcc not installed")
@pytest.mark.parametrize("D,kb,vb,rep", [(64, 2, 4, 1), (64, 4, 4, 3), (128, 8, 2, 8), (128, 4, 4, 4)])
def test_cuda_body_compiles(tmp_path, D, kb, vb, rep):
    p = tmp_path / "k.cu"
    p.write_text(kernels.cuda_source("vq_affine_decode", kernels.AFFINE_DECODE_BODY,
                                     template=dict(D=D, KBITS=kb, VBITS=vb, G=64, REP=rep), **kernels.AFFINE_DECODE_CU_TYPES))
    kernels.nvcc_check(p)


def test_cpu_has_no_kernel_backend():
    if mx.default_device() == mx.cpu and not mx.metal.is_available():
        assert kernels.backend() is None
        with pytest.raises(ValueError, match="does not support"):
            kernels.affine_decode_attention(mx.zeros((1, 1, 1, 1, 64)), {}, {}, 1, 4, 4, 64)


def _reference(q, kd, vd, n, kbits, vbits, gs):
    deq = lambda d, b: mx.dequantize(d["w"][:, :, :n], d["scales"][:, :, :n].astype(mx.float32), d["biases"][:, :, :n].astype(mx.float32), group_size=gs, bits=b)
    return deq(kd, kbits), deq(vd, vbits)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,rep,D,n,cap,kbits,vbits,gs", [
    (1, 8, 4, 128, 1000, 1024, 4, 4, 64), (2, 2, 3, 64, 777, 1024, 2, 4, 32), (1, 1, 8, 128, 5000, 5120, 8, 8, 128),
    (3, 4, 1, 64, 257, 512, 4, 2, 64), (1, 3, 3, 64, 31, 256, 4, 4, 64)])
def test_fused_decode_parity(B, Hkv, rep, D, n, cap, kbits, vbits, gs):
    mx.random.seed(1)
    k = mx.random.normal((B, Hkv, cap, D)).astype(mx.float16); v = mx.random.normal((B, Hkv, cap, D)).astype(mx.float16)
    kd = dict(zip(("w", "scales", "biases"), mx.quantize(k, group_size=gs, bits=kbits)))
    vd = dict(zip(("w", "scales", "biases"), mx.quantize(v, group_size=gs, bits=vbits)))
    q = mx.random.normal((B, Hkv * rep, 1, D))
    ek, ev = mx.random.normal((B, Hkv, 3, D)), mx.random.normal((B, Hkv, 3, D))  # window + current token
    sinks = mx.random.normal((Hkv * rep,))
    kr, vr = _reference(q, kd, vd, n, kbits, vbits, gs)
    ref = mx.fast.scaled_dot_product_attention(q, mx.concatenate([kr, ek], 2), mx.concatenate([vr, ev], 2), scale=D ** -0.5, mask=None, sinks=sinks)
    part = Partial(lambda qq: kernels.affine_decode_attention(qq, kd, vd, n, kbits, vbits, gs, split=200), n)
    out = blockwise_attention(q, n, [part], ek, ev, D ** -0.5, None, sinks)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-4, rtol=2e-3)


@pytest.mark.gpu
def test_fused_matches_reference_in_generation(tiny_model):
    import veloxquant as vq
    toks = [i % 120 + 3 for i in range(300)]
    outs = []
    for uk in (True, False):
        caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("affine", key_bits=4, value_bits=4, use_kernels=uk))
        tiny_model(mx.array(toks[:280])[None], cache=caches)
        outs.append(mx.concatenate([tiny_model(mx.array([[t]]), cache=caches) for t in toks[280:]], axis=1))
    np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CI"), reason="nvcc not installed")
@pytest.mark.parametrize("D,rep", [(64, 3), (128, 8)])
def test_merge_body_compiles(tmp_path, D, rep):
    p = tmp_path / "m.cu"
    p.write_text(kernels.cuda_source("vq_decode_merge", kernels.DECODE_MERGE_BODY, template=dict(D=D, REP=rep), **kernels.DECODE_MERGE_CU_TYPES))
    kernels.nvcc_check(p)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,rep,D,n,E,sinks,dtype", [(1, 8, 4, 128, 1000, 1, False, mx.float16), (2, 3, 3, 64, 700, 17, True, mx.bfloat16),
                                                        (3, 2, 1, 64, 65, 4, True, mx.float32)])
def test_fused_decode_end_to_end_parity(B, Hkv, rep, D, n, E, sinks, dtype):
    mx.random.seed(2)
    cap = n + 100
    k = mx.random.normal((B, Hkv, cap, D)).astype(mx.float16); v = mx.random.normal((B, Hkv, cap, D)).astype(mx.float16)
    kd = dict(zip(("w", "scales", "biases"), mx.quantize(k, group_size=64, bits=4)))
    vd = dict(zip(("w", "scales", "biases"), mx.quantize(v, group_size=64, bits=4)))
    q = mx.random.normal((B, Hkv * rep, 1, D)).astype(dtype)
    ek, ev = mx.random.normal((B, Hkv, E, D)).astype(dtype), mx.random.normal((B, Hkv, E, D)).astype(dtype)
    sk = mx.random.normal((Hkv * rep,)) if sinks else None
    kr, vr = _reference(q, kd, vd, n, 4, 4, 64)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), mx.concatenate([kr, ek.astype(mx.float32)], 2),
                                               mx.concatenate([vr, ev.astype(mx.float32)], 2), scale=D ** -0.5, mask=None, sinks=sk)
    out = kernels.affine_fused_decode(q, kd, vd, n, ek, ev, D ** -0.5, sk, 4, 4, 64)
    assert out.dtype == dtype and out.shape == (B, Hkv * rep, 1, D)
    tol = 2e-4 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), atol=tol, rtol=tol)
