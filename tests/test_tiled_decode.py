"""The decode over decoded tiles (`veloxquant.tiles.tiled_decode`, `VQCache.tiled_decode`) against the reference path
over the same codes: on any device with MLX operations over float32 tiles (forced, `tiled_decode = True`), and on a GPU
(`-m gpu`) through the tile kernel and the merge over float16 tiles."""
import mlx.core as mx
import pytest

import veloxquant as vq  # noqa: F401  (registers every method)
import veloxquant.gpu as gpu
import veloxquant.tiles as tiles
from veloxquant.core import parse_method

# every method with a tile form (the last ones run the path through `decode`'s default tile form)
SPECS = ["q4_0:use_kernels=false", "q8_0:use_kernels=false", "q8_0:hadamard=true,use_kernels=false", "qjl:use_kernels=false", "polar", "turboquant_rvq", "affine:use_kernels=false",
         "turboquant:use_kernels=false", "turboquant:variant=prod,use_kernels=false", "turboquant:center=true,use_kernels=false",
         "rabitq:use_kernels=false", "kivi", "kivi_sink", "gear:outlier_pct=1.0"]
SHAPES = [(1, 1, 700, 256), (2, 3, 1300, 512), (2, 4, 333, 8192)]  # (B, rep, codes + window, block size)


def decode_pair(spec, B, Hkv, rep, D, n, bs, sinks=False, dtype=mx.float32, in_window=False):
    "(tiled, reference) decode outputs of one cache of `spec` holding `n` tokens, and whether the tiled path ran."
    mx.random.seed(1)
    c = parse_method(spec).make_cache(); c.block_size = bs; c.cpu_step = False  # the tiled path, not the CPU step of cpu_fast codecs
    c.coded_decode = False  # nor the codecs' decoders inside one kernel (tests/test_coded_decode.py)
    k, v = (mx.random.normal((B, Hkv, n, D)).astype(mx.float16) for _ in "kv")
    c.update_and_fetch(k, v); c.attend(mx.random.normal((B, Hkv * rep, n, D)).astype(dtype), k, v, D ** -0.5, "causal")
    k1, v1 = (mx.random.normal((B, Hkv, 1, D)).astype(mx.float16 if in_window else dtype) for _ in "kv")
    c.update_and_fetch(k1, v1); c.pending = None  # attend twice over the same state (no flush of the step's tokens)
    q = mx.random.normal((B, Hkv * rep, 1, D)).astype(dtype)
    sk = mx.random.normal((Hkv * rep,)) if sinks else None
    calls, orig = [], tiles.tiled_decode
    def spy(*a, **kw):
        r = orig(*a, **kw); calls.append(r is not None); return r
    tiles.tiled_decode = spy
    outs = []
    try:
        for flag in (True, False):
            c.tiled_decode = flag; c.compiled_decode = False
            outs.append(c.attend(q, k1, v1, D ** -0.5, None, sk))
    finally:
        tiles.tiled_decode = orig
    return outs[0], outs[1], calls, c


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES)
def test_tiled_equals_reference(spec, shape):
    B, rep, n, bs = shape
    out, ref, calls, c = decode_pair(spec, B, 2, rep, 64, n, bs)
    assert c.k_store.length > 0
    assert calls == [True], calls  # the tiled path ran (once: the reference run does not call it)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 2e-4 if gpu.backend() is None else 2e-3  # on a GPU the reference path itself scores in other precisions
    assert mx.allclose(out, ref, rtol=tol, atol=tol).item(), float(mx.abs(out - ref).max())


@pytest.mark.parametrize("spec", ["q4_0:sinks=4,use_kernels=false", "polar:window=0", "turboquant_rvq:sinks=3,window=16", "qjl:sinks=2,use_kernels=false"])
def test_tiled_sinks_windows_dtypes(spec):
    for dtype in (mx.float32, mx.float16):
        out, ref, calls, _ = decode_pair(spec, 1, 2, 3, 128, 900, 256, sinks=True, dtype=dtype)
        assert calls == [True] and out.dtype == dtype
        tol = 2e-4 if dtype == mx.float32 and gpu.backend() is None else 3e-3
        assert mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), rtol=tol, atol=tol).item()


def test_window_buffer_goes_in_as_it_is():
    "A float16 decode step written into the preallocated window buffer attends over the buffer with its valid length."
    out, ref, calls, c = decode_pair("q4_0:use_kernels=false", 1, 2, 2, 64, 700, 256, dtype=mx.float16, in_window=True)
    assert c._in_window and c._xk.shape[2] > c._xkn and calls == [True]
    assert mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), rtol=3e-3, atol=3e-3).item()


def test_who_takes_the_path_and_cpu_default():
    c = parse_method("q4_0").make_cache()
    assert c.tiled_decode is None  # None: GPU back-ends only
    kc, vc = parse_method("turboquant:center=true,use_kernels=false").make_cache()._make_codecs(64, 64)
    assert kc.attends_by_tiles()  # a sequence statistic: decoded each step, never compiled (`compilable` False)
    # qjl / rabitq keys have no tile form where their sign-score kernel runs (on a GPU the coded path reads their signs first)
    assert parse_method("qjl").make_cache()._make_codecs(128, 128)[0].attends_by_tiles() == (gpu.backend() is None)
    assert parse_method("qjl:use_kernels=false").make_cache()._make_codecs(128, 128)[0].attends_by_tiles()
    # codecs whose scores carry terms a tile cannot hold keep the reference path
    from veloxquant.methods.nsnquant import NSNCodec
    assert not NSNCodec.attends_by_tiles(NSNCodec.__new__(NSNCodec))
    if gpu.backend() is None:  # on the CPU the default does not take it: outputs unchanged
        mx.random.seed(1)
        c = parse_method("q4_0").make_cache()
        k, v = (mx.random.normal((1, 2, 600, 64)).astype(mx.float16) for _ in "kv")
        c.update_and_fetch(k, v); c.attend(mx.random.normal((1, 2, 600, 64)), k, v, 0.125, "causal")
        calls, orig = [], tiles.tiled_decode
        tiles.tiled_decode = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
        try:
            k1, v1 = (mx.random.normal((1, 2, 1, 64)) for _ in "kv")
            c.update_and_fetch(k1, v1); c.attend(mx.random.normal((1, 2, 1, 64)), k1, v1, 0.125, None)
        finally: tiles.tiled_decode = orig
        assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("DK, DV, rep, T, lo", [(128, 128, 4, 8192, 0), (256, 128, 4, 1024, 37), (64, 64, 3, 512, 500),
                                              (128, 128, 8, 256, 255), (128, 128, 1, 4096, 4000)])
def test_tile_kernel_equals_reference(DK, DV, rep, T, lo):
    mx.random.seed(3)
    B, Hkv = 2, 2
    qt = mx.random.normal((B * Hkv * rep, DK)) * 0.1
    kt, vt = mx.random.normal((B, Hkv, T, DK)).astype(mx.float16), mx.random.normal((B, Hkv, T, DV)).astype(mx.float16)
    m, l, acc = tiles.tile_partials(qt, kt, vt, lo, rep)
    rm, rl, racc = tiles.tile_partials_reference(qt, kt, vt, lo, rep)
    M = m.max(-1, keepdims=True)  # the chunks' partials combined: the same softmax state
    w = mx.exp(m - M)
    L, A = (l * w).sum(-1, keepdims=True), (acc * w[..., None]).sum(-2)
    assert mx.allclose(M, rm, rtol=2e-3, atol=2e-3).item()  # the reference matmul may run in TF32 on CUDA
    assert mx.allclose(L, rl, rtol=5e-3).item()
    assert mx.allclose(A / L, racc[:, 0] / rl, rtol=3e-3, atol=3e-3).item()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["q4_0:use_kernels=false", "q4_0:hadamard=true,use_kernels=false", "qjl:use_kernels=false", "polar", "turboquant_rvq", "kivi"])
def test_gpu_default_takes_the_tiles(spec):
    "On a GPU back-end the default (`tiled_decode = None`) runs the kernel path for the methods without kernels of their own."
    mx.random.seed(1)
    c = parse_method(spec).make_cache(); c.coded_decode = False  # (with a `tile_reader`, the coded kernel first: tests/test_coded_decode.py)
    k, v = (mx.random.normal((1, 8, 3000, 128)).astype(mx.float16) for _ in "kv")
    q = mx.random.normal((1, 32, 3000, 128)).astype(mx.float16)
    c.update_and_fetch(k, v); c.attend(q, k, v, 128 ** -0.5, "causal")
    k1, v1 = (mx.random.normal((1, 8, 1, 128)).astype(mx.float16) for _ in "kv")
    c.update_and_fetch(k1, v1); c.pending = None
    q1 = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    calls, orig = [], tiles.tiled_decode
    tiles.tiled_decode = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
    try: out = c.attend(q1, k1, v1, 128 ** -0.5, None)
    finally: tiles.tiled_decode = orig
    c.tiled_decode = False
    ref = c.attend(q1, k1, v1, 128 ** -0.5, None)
    assert calls == [1]
    assert mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), rtol=3e-3, atol=3e-3).item(), float(mx.abs(out - ref).max())


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_by_selects_equals_gathers(bits):
    "The GPU branch of `unpack_bits` (element-wise selects) gives the codes of the gather branch, and `lookup` the table's values."
    import numpy as np
    from veloxquant.quant import _select_plan, _unpack_select, _unpack_plan, lookup
    rng = np.random.default_rng(bits)
    w = mx.array(rng.integers(0, 2 ** 32, size=(3, 5, bits), dtype=np.uint64).astype(np.uint32))
    wi, wn, rs, ls, st = _unpack_plan(bits)
    ref = ((mx.take(w, wi, axis=-1) >> rs) | mx.where(st, mx.take(w, wn, axis=-1) << ls, mx.array(0, mx.uint32))) & mx.array((1 << bits) - 1, mx.uint32)
    assert mx.array_equal(_unpack_select(w, bits), ref).item()
    if bits <= 4:
        table = mx.array(rng.normal(size=1 << bits).astype(np.float32))
        with mx.stream(mx.gpu) if gpu.backend() else mx.stream(mx.cpu):
            assert mx.array_equal(lookup(table, ref), table[ref]).item()


@pytest.mark.parametrize("D", [80, 128])
def test_any_head_dim_falls_back_inside(D):
    "Head dims the kernel does not take (not a multiple of 32) run MLX operations over the same tiles: the same attention."
    from veloxquant.methods.fp16 import IdentityCodec
    mx.random.seed(2)
    B, Hkv, rep, T, E = 1, 2, 2, 300, 4
    kc, vc = IdentityCodec(D), IdentityCodec(D)
    k, v = (mx.random.normal((B, Hkv, T, D)).astype(mx.float16) for _ in "kv")
    ek, ev = (mx.random.normal((B, Hkv, E, D)).astype(mx.float16) for _ in "kv")
    q = mx.random.normal((B, Hkv * rep, 1, D)).astype(mx.float16)
    wins = [(kc.encode(k[:, :, :256]), vc.encode(v[:, :, :256]), 0), (kc.encode(k[:, :, 44:]), vc.encode(v[:, :, 44:]), 212)]
    out = tiles.tiled_decode(kc, vc, q, wins, ek, ev, D ** -0.5, kernel=True if (D % 32 or gpu.backend()) else False)
    K, V = (mx.repeat(mx.concatenate([a, b], axis=2).astype(mx.float32), rep, axis=1) for a, b in ((k, ek), (v, ev)))
    ref = mx.softmax((q.astype(mx.float32) * D ** -0.5) @ K.swapaxes(-1, -2), axis=-1) @ V
    assert mx.allclose(out.astype(mx.float32), ref, rtol=3e-3, atol=3e-3).item()
