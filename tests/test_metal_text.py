"""The Metal text of every kernel body compiles (g++, C++17) against a host emulation of the Metal built-ins it uses
(tests/metal_host.py), for every instantiation the registry lists — the checked-in template and the extra ones nvcc
also compiles. `metal_host.UNVERIFIED` says what this cannot check."""
import shutil, subprocess

import pytest

import veloxquant  # noqa: F401  (imports every method, so all their kernels are registered)
import veloxquant.gpu as gpu
from metal_host import metal_host_source

CASES = [(name, i, t) for name, (_, _, _, tmpl, extra) in sorted(gpu.all_kernels().items()) for i, t in enumerate([tmpl, *extra])]


def test_every_kernel_is_covered():
    assert {"affine_decode", "affine_mma_decode", "affine_append", "decode_merge", "sign_scores", "tq_append",
            "tq_mma_decode"} <= {n for n, _, _ in CASES}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("name, i, template", CASES, ids=[f"{n}-{i}" for n, i, _ in CASES])
def test_metal_body_compiles_on_host(name, i, template):
    kname, body, types, _, _ = gpu.all_kernels()[name]
    src = metal_host_source(kname, body, types, template)
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", "-x", "c++", "-"], input=src,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name} {template}:\n{r.stderr[:4000]}"
