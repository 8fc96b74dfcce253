"""The Metal/CUDA safety net on a machine whose kernels cannot run: with the back-end reported as Metal (or CUDA) on the
CPU, every kernel a method launches fails to build, exactly as a kernel that does not compile or launch on a GPU fails
inside `veloxquant.gpu.GuardedKernel`; `gpu.inject_failure` injects a failure through the same path. The method then
falls back to its reference path (the same logits as `use_kernels=False`) with one RuntimeWarning naming the kernel
and the error, however many layers and steps follow."""
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import veloxquant as vq
import veloxquant.gpu as gpu
import veloxquant.gpu_decode as gpu_decode

ARGS = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64, head_dim=64)


@pytest.fixture(scope="module")
def model():
    mx.random.seed(3); m = llama.Model(ARGS); mx.eval(m.parameters()); return m


@pytest.fixture(autouse=True)
def fresh_net():
    gpu.FAILED.clear(); gpu._VERIFIED.clear(); yield; gpu.FAILED.clear(); gpu._VERIFIED.clear()


def run(model, cfg):
    caches = vq.KVCacheBuilder.for_model(model, cfg)
    out = [model(mx.array([list(range(1, 41))]), cache=caches)]
    for t in range(5): out.append(model(mx.array([[t + 2]]), cache=caches))
    return mx.concatenate(out, 1)


CASES = [  # back-end pretended, method options, the kernel whose failure is expected first
    ("metal", dict(method="affine", key_bits=4, value_bits=4, window=0), "vq_affine_decode"),
    ("metal", dict(method="turboquant", key_bits=3, value_bits=3, window=0), "vq_tq_append"),
    ("cuda", dict(method="turboquant", key_bits=3, value_bits=3, window=0), "vq_tq_append"),
    ("metal", dict(method="qjl", sketch_dim=128, window=0), "vq_sign_scores"),
]


# These pretend a GPU back-end on a CPU host (the kernels then fail to build for real); on a host with a real GPU the
# pretended back-end's kernels may build or fail differently (measured on the H200: 5 of them fail there), so they run on CPU hosts only.
cpu_host_only = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="pretends a GPU back-end: meaningful on a CPU host only")


@cpu_host_only
@pytest.mark.parametrize("be, opts, kernel", CASES)
def test_failing_kernel_falls_back(model, monkeypatch, be, opts, kernel):
    monkeypatch.setattr(gpu, "backend", lambda: be)
    ref = run(model, vq.KVCacheConfig(**opts, use_kernels=False))
    gpu.FAILED.clear(); gpu._VERIFIED.clear()  # the reference run may have probed kernels of its own (the generic tile kernel)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = run(model, vq.KVCacheConfig(**opts))
    ours = [x for x in w if "GPU kernel" in str(x.message)]
    names = sorted({str(x.message).split("GPU kernel ")[1].split()[0] for x in ours})
    assert ours and kernel in names, [str(x.message) for x in w]
    assert len(ours) == len(names), "more than one warning for a kernel"
    assert all("failed to compile or launch" in str(x.message) and issubclass(x.category, RuntimeWarning) for x in ours)
    assert set(names) == set(gpu.FAILED)
    assert mx.array_equal(out, ref).item(), "the fallback is not the reference path"


@cpu_host_only
def test_injected_failure_names_kernel_and_error(model, monkeypatch):
    "On a back-end whose kernels would build, `inject_failure` makes the probe of one kernel fail with the given error."
    monkeypatch.setattr(gpu, "backend", lambda: "metal")
    cfg = vq.KVCacheConfig("affine", key_bits=4, value_bits=4, window=0)
    ref = run(model, vq.KVCacheConfig("affine", key_bits=4, value_bits=4, window=0, use_kernels=False))
    with gpu.inject_failure("vq_affine_decode", RuntimeError("[metal::Device] Unable to build metal library: error: boom")):
        with pytest.warns(RuntimeWarning, match=r"GPU kernel vq_affine_decode failed to compile or launch \(RuntimeError: .*boom"):
            out = run(model, cfg)
        assert gpu.kernel_failed("vq_affine_decode")
        with pytest.raises(gpu.KernelFailed, match="vq_affine_decode"):  # later calls refuse at once, without a launch
            gpu._kernel("vq_affine_decode", gpu_decode.DECODE_MERGE_BODY, (), (), "metal")(inputs=[])
    assert mx.array_equal(out, ref).item()
    assert not gpu.kernel_failed("vq_affine_decode")  # the context forgets it


def test_probe_runs_once_per_shape_class():
    "A kernel that works is evaluated eagerly once per shape class, then launched lazily."
    calls = []
    class Fake:
        def __call__(self, **kw): calls.append(kw["template"]); return [mx.zeros((2,))]
    k = gpu.GuardedKernel("vq_fake", Fake)
    for t in ([("D", 64)], [("D", 64)], [("D", 128)]): k(inputs=[mx.zeros((1, 2))], template=t, output_dtypes=[mx.float32])
    assert len(gpu._VERIFIED) == 2 and len(calls) == 3 and not gpu.FAILED


def test_direct_call_only_for_a_built_kernel_without_failure():
    """`GuardedKernel.direct()` (what `DecodeStep` and the coded path call once a layout has been probed) is None before the
    first build and while a failure is injected, so that an injected failure is seen by a cache past its first step too."""
    class Fake:
        def __call__(self, **kw): return [mx.zeros((2,))]
    k = gpu.GuardedKernel("vq_fake_direct", Fake)
    kw = dict(inputs=[mx.zeros((1, 2))], template=[("D", 64)], output_dtypes=[mx.float32])
    assert k.direct() is None
    k(**kw)
    assert k.direct() is not None
    with gpu.inject_failure("vq_fake_direct"):
        assert k.direct() is None
        with pytest.warns(RuntimeWarning, match="vq_fake_direct"), pytest.raises(gpu.KernelFailed):
            k(**kw)
    assert k.direct() is not None and not gpu.FAILED
