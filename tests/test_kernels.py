"""Kernels: plain-file copies in sync, CUDA bodies compile for sm_90, the bit-level scoring identity (CPU), and
(flag `gpu`) parity of every kernel with the MLX reference."""
import math, os, shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from veloxquant import gpu, gpu_decode, bench
from veloxquant.methods import affine, turboquant, qjl
from veloxquant.attention import Partial, blockwise_attention
from veloxquant.quant import pack_bits, unpack_bits

ROOT = Path(__file__).resolve().parents[1]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CI"), reason="nvcc not installed")


def test_kernel_files_in_sync():
    files = gpu.kernel_files()
    assert set(files) == {f"{n}.{e}" for n in gpu.all_kernels() for e in ("cu", "metal")}
    for name, text in files.items():
        assert (ROOT / "kernels" / name).read_text() == text, f"kernels/{name} is out of sync: run the notebooks that register kernels (nbs/03b_gpu_decode.ipynb, nbs/03e_tiles.ipynb, nbs/03f_vq.ipynb, nbs/methods/*.ipynb)"


@needs_nvcc
@pytest.mark.parametrize("name,i", [(n, i) for n, k in gpu.all_kernels().items() for i in range(1 + len(k[4]))])
def test_cuda_body_compiles(tmp_path, name, i):
    kname, body, types, tmpl, extra = gpu.KERNELS[name]
    p = tmp_path / f"{name}.cu"
    p.write_text(gpu.cuda_source(kname, body, template=[tmpl, *extra][i], **types))
    gpu.nvcc_check(p)


def test_nvcc_check_reports_errors(tmp_path):
    if shutil.which("nvcc") is None: pytest.skip("nvcc not installed")
    p = tmp_path / "bad.cu"
    p.write_text(gpu.cuda_source("bad", "int x = undefined_name;", inputs=[("a", "float32")], outputs=[("b", "float32")], template={}))
    with pytest.raises(RuntimeError, match="undefined_name"):
        gpu.nvcc_check(p)


def test_cpu_has_no_kernel_backend():
    if mx.default_device() == mx.cpu and not mx.metal.is_available():
        assert gpu.backend() is None
        with pytest.raises(ValueError, match="does not support"):
            affine.affine_decode_attention(mx.zeros((1, 1, 1, 1, 64)), {}, {}, 1, 4, 4, 64)
        with pytest.raises(ValueError, match="does not support"):
            affine.affine_fused_append(mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 64)), 4, 4, 64)
        with pytest.raises(ValueError, match="does not support"):
            turboquant.tq_fused_append(mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 64)), mx.eye(64), mx.zeros((7,)), mx.zeros((7,)))
        with pytest.raises(ValueError, match="does not support"):
            qjl.sign_scores(mx.zeros((1, 1, 1, 128)), mx.zeros((1, 1, 4, 4), mx.uint32), mx.zeros((1, 1, 4, 1), mx.float16), 4)


def test_decode_split():
    for n, rows in [(1, 8), (1000, 8), (32768, 8), (32768, 64), (131072, 64), (10 ** 6, 1)]:
        s = gpu.decode_split(n, rows, warps=4)
        assert s % 128 == 0 and 128 <= s <= 8192 and s & (s - 1) == 0  # a power of two: few compiled chunk sizes
        assert -(-n // s) * rows <= max(gpu.DECODE_TARGET_GROUPS, rows) or s == 8192


def test_decode_split_is_a_power_of_two_and_checks_its_arguments():
    for warps in (1, 2, 3, 4, 8):
        for n in (1, 77, 1000, 10 ** 7):
            sp = gpu.decode_split(n, 8, None, warps)
            assert sp & (sp - 1) == 0 and 32 * warps <= sp <= 8192
    for bad in (dict(n=0, n_rows=8), dict(n=10, n_rows=0), dict(n=10.0, n_rows=8), dict(n=10, n_rows=8, warps=0)):
        with pytest.raises(ValueError, match="decode_split"):
            gpu.decode_split(**bad)


def test_support_checks_reject_odd_arguments(monkeypatch):
    monkeypatch.setattr(gpu, "backend", lambda: "cuda")
    assert not affine.mma_decode_supported(128.0, 4, 4, 64, 4) and not affine.mma_decode_supported(128, 4, 4, 64, 4.5)
    assert not turboquant.tq_decode_supported(128, "3", 3, 4) and not turboquant.tq_decode_supported(128, 3, 3, 4.5)
    assert not turboquant.tq_decode_supported(128, None, 3, 4) and not affine.affine_decode_supported(128, 4, 4, 64, None)
    # the scalar kernel keeps its queries and per-simdgroup accumulators in threadgroup memory (48 KB on CUDA)
    # (fewer simdgroups per threadgroup for many query heads per kv head: 24 at head_dim 128 runs with 2)
    assert affine.affine_decode_supported(128, 2, 4, 64, 40) and not affine.affine_decode_supported(128, 2, 4, 64, 48)
    assert affine._pick(128, 2, 4, 64, 24, None, None) == (False, 2) and affine._pick(128, 2, 4, 64, 4, None, None) == (False, 4)
    assert affine.affine_decode_supported(128, 4, 4, 64, 8)           # the tensor-core kernel
    assert not affine.affine_decode_supported(128, 4, 4, 32, 48)      # neither: the method falls back to the reference path
    monkeypatch.setattr(gpu, "backend", lambda: "metal")
    assert affine.affine_decode_supported(128, 2, 4, 64, 24) and not affine.affine_decode_supported(128, 2, 4, 64, 32)  # 32 KB


def test_kernel_entry_points_refuse_bad_steps(monkeypatch):
    "Shape errors are ValueErrors naming the field, checked before any back-end work."
    kd = {"w": mx.zeros((1, 2, 10, 16), mx.uint32)}
    q, kv = mx.zeros((1, 4, 1, 128)), mx.zeros((1, 2, 1, 128))
    with pytest.raises(ValueError, match="keys must be"):
        affine.affine_fused_decode(q, kd, kd, 5, None, kv, 1.0, None, 4, 4, 64)
    with pytest.raises(ValueError, match="queries must be"):
        affine.affine_fused_decode(mx.zeros((4, 1, 128)), kd, kd, 5, kv, kv, 1.0, None, 4, 4, 64)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        affine.affine_fused_decode(mx.zeros((1, 3, 1, 128)), kd, kd, 5, kv, kv, 1.0, None, 4, 4, 64)
    with pytest.raises(ValueError, match="capacity=10"):
        affine.affine_fused_decode(q, kd, kd, 11, kv, kv, 1.0, None, 4, 4, 64)
    with pytest.raises(ValueError, match="c0"):
        turboquant.tq_fused_decode(q, kd, kd, 5, kv, kv, 1.0, None, None, None)
    with pytest.raises(ValueError, match="key_codec must be"):
        turboquant.tq_fused_decode(q, {"c0": kd["w"]}, {"c0": kd["w"]}, 5, kv, kv, 1.0, None, None, None)
    for bits, cents in ((3.0, [0.0] * 8), (0, [0.0]), (5, [0.0] * 32), (2, [0.0, 1.0, float("nan"), 2.0]), (2, [0.0, 1.0, 1e6, 2.0])):
        with pytest.raises(ValueError):
            turboquant.codebook_pair_table(cents, bits)


def test_benchmark_cli_without_gpu(tmp_path, capsys):
    "On a machine without a GPU back-end the GPU-only parts are skipped with a message and the JSON is written."
    if gpu.backend() is not None: pytest.skip("has a GPU back-end")
    from veloxquant.cli import main
    out = tmp_path / "b.json"
    main(["benchmark", "--append", "--seq-lens", "40", "--batches", "1", "--head-dims", "64", "--repeats", "1", "--out", str(out)])
    assert "skipped" in capsys.readouterr().out
    import json
    res = json.loads(out.read_text())
    assert res["append"] == [] and res["sign_scores"] == [] and res["tq_decode"] == []


def test_benchmark_and_sign_functions_check_arguments():
    for kw in (dict(seq_lens=(0,)), dict(seq_lens=64), dict(seq_lens="64"), dict(head_dims=(96,)), dict(batches=(0,)),
               dict(repeats=0), dict(group_size=7), dict(n_heads=30, n_kv_heads=8)):
        with pytest.raises(ValueError, match="benchmark_decode"):
            bench.benchmark_decode(**kw, progress=False)
    signs = mx.zeros((1, 1, 10, 4), mx.uint32)
    for n, qb in ((20, 8), (0, 8), (-1, 8), (5, 0), (5, 40)):
        with pytest.raises(ValueError):
            qjl.sign_scores_reference(mx.zeros((1, 1, 1, 128)), signs, mx.zeros((1, 1, 10, 1)), n, qb)
    for bad in ([[0.0]], None):
        with pytest.raises(ValueError):
            affine.affine_fused_append(bad, bad, 4, 4, 64)
    rows = [dict(S=8, B=1, D=64, variant="x fused", us=1.0, GBps=1.0, us_pipelined=1.0, GBps_pipelined=1.0)]
    bench.print_benchmark(rows)  # no fp16 row: no ratio column, no KeyError


def test_benchmark_generate_on_the_cpu(monkeypatch, tmp_path):
    "Without a GPU `--generate` runs the default model (the 8B-shaped model is never built) against stock mlx-lm, B = 1 and 2."
    if gpu.backend() is not None: pytest.skip("has a GPU back-end")
    import json
    from veloxquant.cli import main
    out = tmp_path / "g.json"
    main(["benchmark", "--generate", "--skip-decode", "--contexts", "64", "--gen-batches", "1,2", "--decode-tokens", "2",
          "--methods", "stock;affine:key_bits=4,value_bits=4", "--out", str(out)])
    rows = json.loads(out.read_text())["generate"]
    assert [(r["batch"], r["method"]) for r in rows] == [(1, "stock"), (1, "affine:key_bits=4,value_bits=4"),
                                                         (2, "stock"), (2, "affine:key_bits=4,value_bits=4")]
    for r in rows:
        assert r["model"].startswith("SmolLM2") and r["context"] == 64 and r["prefill_tps"] > 0 and r["decode_tps"] > 0 and r["kv_bytes"] > 0 and r["backend"] == "cpu"
        assert r["decode_ratio"] > 0 and r["prefill_ratio"] > 0
    assert rows[1]["kv_bytes"] < rows[0]["kv_bytes"]  # affine 4/4 stores fewer bytes than float32 KVCache
    with pytest.raises(SystemExit) as e:
        main(["benchmark", "--generate", "--skip-decode", "--methods", "stock;affine:key_bits=9"])
    assert e.value.code == 2


def test_length_reference_is_a_view():
    "The decode kernels read the token count from the shape of `_nref(n)`: a prefix of one cached buffer, never uploaded."
    for n in (1, 1000, 1024, 1025, 70000):
        r = gpu._nref(n)
        assert r.shape == (n,) and r.dtype == mx.uint8
    assert gpu._nref(3).shape == (3,) and gpu._length_buffer.cache_info().currsize <= 4


def test_mma_support_rules(monkeypatch):
    monkeypatch.setattr(gpu, "backend", lambda: "cuda")
    ok = affine.mma_decode_supported
    assert ok(128, 4, 4, 64, 4) and ok(64, 4, 4, 64, 3) and ok(128, 4, 4, 128, 16) and ok(64, 4, 4, 32, 8)
    assert not ok(128, 4, 4, 32, 4)       # four groups per head
    assert not ok(128, 4, 4, 64, 9)       # two groups hold at most 8 query heads
    assert not ok(128, 2, 4, 64, 4) and not ok(256, 4, 4, 128, 4) and not ok(128, 4, 4, 128, 17)
    monkeypatch.setattr(gpu, "backend", lambda: "metal")
    assert not ok(128, 4, 4, 64, 4)       # Metal keeps the scalar kernel (its mma is the shuffle emulation)


def test_mma_kernel_source_names_shapes():
    "Both decode bodies take the token count and capacity from input shapes, not from a host-built params array."
    for body in (affine.AFFINE_DECODE_BODY, affine.AFFINE_MMA_DECODE_BODY):
        assert "nref_shape[0]" in body and "kw_shape[2]" in body and "params" not in body
    src = gpu.cuda_source("x", affine.AFFINE_MMA_DECODE_BODY, template=gpu.KERNELS["affine_mma_decode"][3], **affine.AFFINE_DECODE_CU_TYPES)
    assert "const __grid_constant__ Shape nref_shape" in src and "const __grid_constant__ Shape kw_shape" in src
    assert "mma.sync.aligned.m16n8k16" in gpu.COMPAT_CUDA and "vq_mma16816_emul" in gpu.COMPAT_METAL


def test_codebook_pair_table():
    t = np.array(turboquant.codebook_pair_table([-1.5, -0.5, 0.5, 1.5], 2))
    assert t.shape == (16,) and t.dtype == np.uint32
    h = lambda x: int(np.array([x], np.float16).view(np.uint16)[0])
    for x in range(4):
        for y in range(4):
            assert t[x | y << 2] == h([-1.5, -0.5, 0.5, 1.5][x]) | h([-1.5, -0.5, 0.5, 1.5][y]) << 16
    with pytest.raises(ValueError, match="2\\^bits"):
        turboquant.codebook_pair_table([0.0, 1.0, 2.0], 2)


def test_tq_decode_support_rules(monkeypatch):
    monkeypatch.setattr(gpu, "backend", lambda: "cuda")
    ok = turboquant.tq_decode_supported
    assert ok(128, 3, 3, 4) and ok(64, 1, 4, 16) and ok(128, 2.0, 4, 1)
    assert not ok(128, 2.5, 3, 4) and not ok(96, 3, 3, 4) and not ok(128, 3, 3, 17) and not ok(128, 5, 3, 4)
    monkeypatch.setattr(gpu, "backend", lambda: None)
    assert not ok(128, 3, 3, 4)


def _popcount(x):
    return np.unpackbits(x.view(np.uint8), axis=-1).reshape(*x.shape, 32).sum(-1).astype(np.int64)


@pytest.mark.parametrize("m,qb", [(128, 4), (256, 8)])
def test_sign_score_identity(m, qb):
    "The XOR/popcount formula of SIGN_SCORE_BODY, emulated bit for bit in numpy, equals the quantized estimator (float64)."
    rng = np.random.default_rng(0)
    u = rng.standard_normal((3, m)); z = rng.choice([-1.0, 1.0], size=(5, m))
    words = np.array(pack_bits(mx.array((z > 0).astype(np.uint32)), 1))                      # [5, m/32]
    lo, hi = u.min(-1, keepdims=True), u.max(-1, keepdims=True)
    delta = (hi - lo) / ((1 << qb) - 1)
    ub = np.clip(np.round((u - lo) / delta), 0, (1 << qb) - 1).astype(np.uint32)             # [3, m]
    planes = np.stack([np.array(pack_bits(mx.array((ub >> k) & 1), 1)) for k in range(qb)], 1)  # [3, qb, m/32]
    pb = _popcount(words).sum(-1)                                                             # [5]
    x = _popcount(planes[:, None] ^ words[None, :, None])                                     # [3, 5, qb, m/32]
    acc = ((_popcount(words)[None, :, None] - x).sum(-1) * (1 << np.arange(qb))).sum(-1)      # [3, 5]
    est = lo * (2 * pb - m)[None] + delta * acc
    np.testing.assert_allclose(est, (lo + delta * ub) @ z.T, rtol=1e-12, atol=1e-9)
    # and the MLX reference computes the same estimator
    ref = qjl.sign_scores_reference(mx.array(u[None, None].astype(np.float32)), mx.array(words[None, None]),
                                        mx.ones((1, 1, 5, 1), mx.float16), 5, qb)
    np.testing.assert_allclose(np.array(ref)[0, 0], est * math.sqrt(math.pi / 2) / m, rtol=1e-4, atol=1e-4)


def _codes(words, bits, n):
    "Codes of an LSB-first bit stream of uint32 words [..., W] (any bits), numpy int64 [..., n]."
    b = np.unpackbits(np.array(words).view(np.uint8), axis=-1, bitorder="little")[..., :n * bits]
    return (b.reshape(*b.shape[:-1], n, bits).astype(np.int64) << np.arange(bits)).sum(-1)


def _reference(q, kd, vd, n, kbits, vbits, gs):
    deq = lambda d, b: mx.dequantize(d["w"][:, :, :n], d["scales"][:, :, :n].astype(mx.float32), d["biases"][:, :, :n].astype(mx.float32), group_size=gs, bits=b)
    return deq(kd, kbits), deq(vd, vbits)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,rep,D,n,cap,kbits,vbits,gs,warps", [
    (1, 8, 4, 128, 1000, 1024, 4, 4, 64, 4), (2, 2, 3, 64, 777, 1024, 2, 4, 32, 2), (1, 1, 8, 128, 5000, 5120, 8, 8, 128, 8),
    (3, 4, 1, 64, 257, 512, 4, 2, 64, 4), (1, 3, 3, 64, 31, 256, 4, 4, 64, 1), (2, 8, 4, 128, 3000, 3072, 2, 8, 32, 4)])
@pytest.mark.parametrize("mma", [False, None])
def test_fused_decode_parity(B, Hkv, rep, D, n, cap, kbits, vbits, gs, warps, mma):
    mx.random.seed(1)
    k = mx.random.normal((B, Hkv, cap, D)).astype(mx.float16); v = mx.random.normal((B, Hkv, cap, D)).astype(mx.float16)
    kd = dict(zip(("w", "scales", "biases"), mx.quantize(k, group_size=gs, bits=kbits)))
    vd = dict(zip(("w", "scales", "biases"), mx.quantize(v, group_size=gs, bits=vbits)))
    q = mx.random.normal((B, Hkv * rep, 1, D))
    ek, ev = mx.random.normal((B, Hkv, 3, D)), mx.random.normal((B, Hkv, 3, D))  # window + current token
    sinks = mx.random.normal((Hkv * rep,))
    kr, vr = _reference(q, kd, vd, n, kbits, vbits, gs)
    ref = mx.fast.scaled_dot_product_attention(q, mx.concatenate([kr, ek], 2), mx.concatenate([vr, ev], 2), scale=D ** -0.5, mask=None, sinks=sinks)
    part = Partial(lambda qq: affine.affine_decode_attention(qq, kd, vd, n, kbits, vbits, gs, split=200, warps=warps, mma=mma), n)
    out = blockwise_attention(q, n, [part], ek, ev, D ** -0.5, None, sinks)
    tc = mma is None and affine.mma_decode_supported(D, kbits, vbits, gs, rep)  # tensor cores: fp16 query and weights
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-3 if tc else 2e-4, rtol=1e-2 if tc else 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,rep,D,n,cap,gs,warps,split,emulate,dtype", [
    (1, 8, 4, 128, 1000, 1024, 64, 4, None, False, mx.float16), (2, 2, 3, 64, 777, 800, 32, 2, 200, False, mx.bfloat16),
    (1, 1, 16, 128, 5000, 5001, 128, 4, None, False, mx.float16), (3, 4, 1, 64, 257, 512, 64, 1, 64, False, mx.float32),
    (1, 3, 7, 64, 31, 33, 64, 4, None, False, mx.float16), (2, 8, 4, 128, 3000, 3072, 64, 2, 1024, False, mx.float16),
    (1, 2, 8, 64, 300, 333, 32, 4, 96, True, mx.float16), (1, 2, 9, 128, 333, 400, 128, 2, None, True, mx.float32),
    (8, 8, 4, 128, 32768, 32769, 64, None, None, False, mx.float16)])
def test_mma_decode_parity(B, Hkv, rep, D, n, cap, gs, warps, split, emulate, dtype):
    """The tensor-core kernel (and, `emulate`, its software product — the Metal path's arithmetic) against float32
    attention over the dequantized cache: GQA 1–16, one and two groups, head_dim 64/128, lengths and capacities not
    multiple of the tile, chunk sizes not powers of two, sink logits and an exact window."""
    mx.random.seed(3)
    k = (mx.random.normal((B, Hkv, cap, D)) * 2 + 0.5).astype(mx.float16); v = (mx.random.normal((B, Hkv, cap, D)) + 0.3).astype(mx.float16)
    kd = dict(zip(("w", "scales", "biases"), mx.quantize(k, group_size=gs, bits=4)))
    vd = dict(zip(("w", "scales", "biases"), mx.quantize(v, group_size=gs, bits=4)))
    q = (mx.random.normal((B, Hkv * rep, 1, D)) * 2).astype(dtype)
    ek, ev = mx.random.normal((B, Hkv, 2, D)).astype(dtype), mx.random.normal((B, Hkv, 2, D)).astype(dtype)
    sinks = mx.random.normal((Hkv * rep,))
    kr, vr = _reference(q, kd, vd, n, 4, 4, gs)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), mx.concatenate([kr, ek.astype(mx.float32)], 2),
                                               mx.concatenate([vr, ev.astype(mx.float32)], 2), scale=D ** -0.5, mask=None, sinks=sinks)
    out = affine.affine_fused_decode(q, kd, vd, n, ek, ev, D ** -0.5, sinks, 4, 4, gs, split=split, warps=warps, mma=True, emulate=emulate)
    assert out.dtype == dtype and out.shape == (B, Hkv * rep, 1, D)
    # fp16 products (query, softmax weights) and fp16 outputs: errors ~1e-3 of the output scale
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), atol=1e-2, rtol=1e-2)
    err = float(mx.abs(out.astype(mx.float32) - ref).max()); scalar = affine.affine_fused_decode(q, kd, vd, n, ek, ev, D ** -0.5, sinks, 4, 4, gs, mma=False)
    assert err <= 3 * float(mx.abs(scalar.astype(mx.float32) - ref).max()) + 2e-3   # no worse than the float32 scalar kernel, within fp16 rounding


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,rep,D,n,kbits,vbits,E,sinks,emulate,dtype", [
    (1, 8, 4, 128, 1000, 3, 3, 1, False, False, mx.float16), (2, 2, 3, 64, 777, 4, 2, 3, True, False, mx.bfloat16),
    (1, 1, 16, 128, 513, 1, 4, 1, False, False, mx.float32), (3, 2, 1, 64, 65, 2, 3, 2, True, True, mx.float16),
    (1, 2, 8, 128, 300, 3, 1, 1, False, True, mx.float32), (8, 8, 4, 128, 20000, 3, 3, 1, False, False, mx.float16)])
@pytest.mark.parametrize("fwht", [False, True])
def test_tq_decode_parity(B, Hkv, rep, D, n, kbits, vbits, E, sinks, emulate, dtype, fwht, monkeypatch):
    """`tq_fused_decode` (codebook lookups on tensor cores; `emulate`: the software product) against float32 attention
    over the codecs' own decoding of the same codes: bits 1–4 (3 straddles words), GQA 1–16, head_dim 64/128, sinks;
    `fwht`: the queries rotated by butterflies in the kernel (template HAD = 1, `TQ_FWHT_QUERIES`) instead of R's product."""
    from veloxquant.methods.turboquant import TurboQuantCodec
    monkeypatch.setattr(turboquant, "TQ_FWHT_QUERIES", fwht)
    mx.random.seed(5)
    kc, vc = TurboQuantCodec(D, kbits, seed=1), TurboQuantCodec(D, vbits, seed=1)
    k = (mx.random.normal((B, Hkv, n, D)) * 2 + 0.3).astype(mx.float16); v = mx.random.normal((B, Hkv, n, D)).astype(mx.float16)
    kd, vd = kc.encode(k), vc.encode(v)
    kd = {a: mx.concatenate([x, mx.zeros((B, Hkv, 7, x.shape[-1]), x.dtype)], 2) for a, x in kd.items()}  # capacity > n
    vd = {a: mx.concatenate([x, mx.zeros((B, Hkv, 7, x.shape[-1]), x.dtype)], 2) for a, x in vd.items()}
    q = (mx.random.normal((B, Hkv * rep, 1, D)) * 2).astype(dtype)
    ek, ev = mx.random.normal((B, Hkv, E, D)).astype(dtype), mx.random.normal((B, Hkv, E, D)).astype(dtype)
    sk = mx.random.normal((Hkv * rep,)) if sinks else None
    kr = kc.decode({a: x[:, :, :n] for a, x in kd.items()}); vr = vc.decode({a: x[:, :, :n] for a, x in vd.items()})
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), mx.concatenate([kr, ek.astype(mx.float32)], 2),
                                               mx.concatenate([vr, ev.astype(mx.float32)], 2), scale=D ** -0.5, mask=None, sinks=sk)
    out = turboquant.tq_fused_decode(q, kd, vd, n, ek, ev, D ** -0.5, sk, kc, vc, emulate=emulate)
    assert out.dtype == dtype and out.shape == (B, Hkv * rep, 1, D)
    # fp16 products (query, weights, codebook values); the reference's rotations run in TF32 on CUDA
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_tq_fused_decode_is_used_in_generation(tiny_model):
    "turboquant's cache routes decode steps through its fused kernels on CUDA (a prepared `gpu_decode.DecodeStep`, `tq_fused_decode`'s launches)."
    import veloxquant as vq
    import veloxquant.gpu as gpu
    calls = []
    orig = gpu_decode.DecodeStep.__call__
    try:
        gpu_decode.DecodeStep.__call__ = lambda *a, **k: calls.append(1) or orig(*a, **k)
        caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("turboquant", key_bits=3, value_bits=3, window=0))  # no window: the 40 tokens become codes
        tiny_model(mx.array([[5] * 40]), cache=caches)
        mx.eval(tiny_model(mx.array([[7]]), cache=caches))
    finally:
        gpu_decode.DecodeStep.__call__ = orig
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_tq_fwht_queries_in_the_cache(tiny_model, monkeypatch, fused):
    """The cache's decode step (two dispatches; one with `gpu.FUSED_DECODE`) with the queries rotated by butterflies
    (template HAD = 1) gives the logits of R's matrix product (HAD = 0); the kernels ran (no fallback to the reference)."""
    import veloxquant as vq
    import veloxquant.gpu as gpu
    monkeypatch.setattr(gpu, "FUSED_DECODE", fused)
    made, init = [], gpu_decode.DecodeStep.__init__
    def record(self, name, body, inputs, tmpl, *a, **k):
        made.append(dict(tmpl)); init(self, name, body, inputs, tmpl, *a, **k)
    monkeypatch.setattr(gpu_decode.DecodeStep, "__init__", record)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(turboquant, "TQ_FWHT_QUERIES", on)
        caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("turboquant", key_bits=3, value_bits=3, window=0))
        tiny_model(mx.array([[5, 9, 2, 7] * 10]), cache=caches)
        outs.append(tiny_model(mx.array([[7]]), cache=caches).astype(mx.float32))
        assert made and made[-1]["HAD"] == int(on)  # the step was prepared with this template
    assert not gpu.kernel_failed("vq_tq_mma_decode") and not gpu.kernel_failed("vq_tq_mma_decode_fused")
    # the two rotations differ only in float32 rounding before the fp16 MMA operands: far below a flipped channel's effect
    assert float(mx.abs(outs[0] - outs[1]).max()) <= 5e-3 * float(mx.abs(outs[0]).max()) + 1e-3


@pytest.mark.gpu
def test_mma_refuses_unsupported_layouts():
    kd = dict(zip(("w", "scales", "biases"), mx.quantize(mx.zeros((1, 1, 64, 128), mx.float16), group_size=32, bits=4)))
    with pytest.raises(ValueError, match="tensor-core"):
        affine.affine_fused_decode(mx.zeros((1, 4, 1, 128), mx.float16), kd, kd, 10, mx.zeros((1, 1, 1, 128), mx.float16),
                                    mx.zeros((1, 1, 1, 128), mx.float16), 1.0, None, 4, 4, 32, mma=True)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,rep,D,n,E,sinks,dtype,split", [(1, 8, 4, 128, 1000, 1, False, mx.float16, None),
                                                              (2, 3, 3, 64, 700, 17, True, mx.bfloat16, 128),
                                                              (3, 2, 1, 64, 65, 4, True, mx.float32, None),
                                                              (8, 8, 4, 128, 20000, 1, False, mx.float16, None)])
def test_fused_decode_end_to_end_parity(B, Hkv, rep, D, n, E, sinks, dtype, split):
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
    out = affine.affine_fused_decode(q, kd, vd, n, ek, ev, D ** -0.5, sk, 4, 4, 64, split=split)
    assert out.dtype == dtype and out.shape == (B, Hkv * rep, 1, D)
    tc = affine.mma_decode_supported(D, 4, 4, 64, rep)  # the tensor-core kernel rounds the query and the weights to fp16
    tol = 2e-2 if dtype != mx.float32 else 2e-3 if tc else 2e-4
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["affine", "turboquant"])
def test_fused_matches_reference_in_generation(tiny_model, method):
    import veloxquant as vq
    toks = [i % 120 + 3 for i in range(300)]
    opts = dict(key_bits=4, value_bits=4) if method == "affine" else dict(key_bits=3, value_bits=2)
    outs = []
    for uk in (True, False):
        caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig(method, use_kernels=uk, **opts))
        tiny_model(mx.array(toks[:280])[None], cache=caches)
        outs.append(mx.concatenate([tiny_model(mx.array([[t]]), cache=caches) for t in toks[280:]], axis=1))
    tol = 1e-3 if method == "affine" else 3e-2  # turboquant: the reference's rotation matmul runs in TF32 on CUDA
    np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,D,kbits,vbits,gs,dtype", [(1, 8, 1, 128, 4, 4, 64, mx.float16), (2, 3, 37, 64, 2, 8, 32, mx.float32),
                                                          (1, 2, 300, 128, 3, 6, 128, mx.bfloat16), (2, 2, 5, 96, 5, 4, 32, mx.float16)])
def test_affine_append_parity(B, H, T, D, kbits, vbits, gs, dtype):
    mx.random.seed(3)
    k = (mx.random.normal((B, H, T, D)) * 3 + 0.5).astype(dtype); v = mx.random.normal((B, H, T, D)).astype(dtype)
    fk, fv = affine.affine_fused_append(k, v, kbits, vbits, gs)
    for x, f, b in ((k, fk, kbits), (v, fv, vbits)):
        w, s, bi = mx.quantize(x.astype(mx.float16), group_size=gs, bits=b)
        assert f["w"].shape == w.shape and f["scales"].shape == s.shape and f["w"].dtype == mx.uint32 and f["scales"].dtype == mx.float16
        np.testing.assert_allclose(np.array(f["scales"]), np.array(s), rtol=2e-3, atol=1e-6)
        np.testing.assert_allclose(np.array(f["biases"]), np.array(bi), rtol=2e-3, atol=1e-6)
        cf, cr = _codes(f["w"], b, D), _codes(w, b, D)
        assert (cf == cr).mean() > 0.999 and np.abs(cf - cr).max() <= 1
        xf = np.array(x.astype(mx.float16).astype(mx.float32))
        err = lambda w_, s_, b_: np.abs(np.array(mx.dequantize(w_, s_, b_, group_size=gs, bits=b).astype(mx.float32)) - xf).mean()
        assert err(f["w"], f["scales"], f["biases"]) <= err(w, s, bi) * 1.01 + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,D,kbits,vbits,rot", [(1, 8, 1, 128, 3, 3, "hadamard"), (2, 2, 50, 64, 1, 4, "orthogonal"),
                                                     (1, 4, 300, 128, 2, 4, "hadamard")])
def test_tq_append_parity(B, H, T, D, kbits, vbits, rot):
    from veloxquant.methods.turboquant import TurboQuantCodec
    mx.random.seed(4)
    k = mx.random.normal((B, H, T, D)).astype(mx.float16); v = (mx.random.normal((B, H, T, D)) * 0.1).astype(mx.float16)
    ck, cv = TurboQuantCodec(D, kbits, 0, rot), TurboQuantCodec(D, vbits, 0, rot)
    fk, fv = turboquant.tq_fused_append(k, v, ck.R, ck.groups[0][4], cv.groups[0][4])
    R = np.array(ck.R).astype(np.float64)
    for x, f, c, b in ((k, fk, ck, kbits), (v, fv, cv, vbits)):
        ref = c.encode(x)
        assert f.keys() == ref.keys() and all(f[n].shape == ref[n].shape and f[n].dtype == ref[n].dtype for n in f)
        xn = np.array(x.astype(mx.float32)).astype(np.float64)
        nrm = np.linalg.norm(xn, axis=-1, keepdims=True)
        y = (xn / nrm) @ R
        exact = (y[..., None] > np.array(c.groups[0][4]).astype(np.float64)).sum(-1)       # float64 codes
        got = np.array(unpack_bits(f["c0"], b, D))
        assert (got == exact).mean() > 0.999
        np.testing.assert_allclose(np.array(f["norm"].astype(mx.float32)), np.array(ref["norm"].astype(mx.float32)), rtol=1e-3)
        # decoding the fused codes with the codec gives the reference's accuracy
        e_f = np.abs(np.array(c.decode(f)) - xn).mean(); e_r = np.abs(np.array(c.decode(ref)) - xn).mean()
        assert e_f <= e_r * 1.02 + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("B,Hkv,rep,m,n,cap,qb", [(1, 8, 4, 256, 1000, 1024, 8), (2, 2, 1, 128, 77, 256, 4), (1, 3, 8, 512, 3000, 3000, 8)])
def test_sign_scores_parity(B, Hkv, rep, m, n, cap, qb):
    mx.random.seed(5)
    u = mx.random.normal((B, Hkv, rep, m))
    signs = pack_bits((mx.random.normal((B, Hkv, cap, m)) > 0).astype(mx.uint32), 1)
    norms = (mx.random.uniform(shape=(B, Hkv, cap, 1)) * 4).astype(mx.float16)
    out = qjl.sign_scores(u, signs, norms, n, qb)
    assert out.shape == (B, Hkv, rep, n) and out.dtype == mx.float32
    # exact float64 version of the same estimator (the MLX reference's matmul runs in TF32 on CUDA)
    un = np.array(u).astype(np.float64)
    lo, hi = un.min(-1, keepdims=True), un.max(-1, keepdims=True)
    delta = (hi - lo) / ((1 << qb) - 1)
    ut = lo + delta * np.clip(np.round((un - lo) / delta), 0, (1 << qb) - 1)
    z = np.array(unpack_bits(signs[:, :, :n], 1, m)).astype(np.float64) * 2 - 1
    ref = np.einsum("bhrm,bhnm->bhrn", ut, z) * math.sqrt(math.pi / 2) / m * np.array(norms[:, :, :n, 0].astype(mx.float32))[:, :, None]
    np.testing.assert_allclose(np.array(out), ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(qjl.sign_scores_reference(u, signs, norms, n, qb)), ref, atol=2e-2, rtol=2e-2)
