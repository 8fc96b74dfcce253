"""Run a `veloxquant.tiles.TileReader` on the host: its code (the Metal text, as `coded_body` splices it into the kernel)
compiled by g++ against `metal_host`'s emulation of the Metal built-ins into a loop over rows, tokens and the 32 lanes,
and called through ctypes on a store's arrays. This checks what the GPU kernel's decode of one token computes (the
arithmetic, the bit and byte offsets, the layout of every field) on a machine without a GPU; the kernel around it (the
online softmax, the merge) is parity-tested on a GPU (`-m gpu`)."""
import ctypes, hashlib, subprocess, tempfile
from pathlib import Path

import numpy as np
import mlx.core as mx

from metal_host import HOST_PRELUDE

_C = {"uint32": "uint", "float16": "half", "uint8": "uchar", "float32": "float"}
_NP = {"uint32": np.uint32, "float16": np.float16, "uint8": np.uint8, "float32": np.float32}
_LIBS: dict = {}


def host_source(reader) -> str:
    import veloxquant.gpu as gpu
    import veloxquant.tiles as tiles
    pl = reader.dims // 32
    args = [f"const {_C[d]}* {n}" for n, d in reader.types("k_")]
    return (HOST_PRELUDE + gpu.COMPAT_METAL + tiles._FIELD_DEFINE + f"\nconstexpr int PLV = {pl};\n"
            + 'extern "C" void run(' + ", ".join(args + ["int BH", "int CAP", "int n", "float* out"]) + ") {\n"
            + "  const int k_CAP = CAP;\n"
            + "  for (int bh = 0; bh < BH; bh++) for (int tok = 0; tok < n; tok++) for (uint vq_lane = 0; vq_lane < 32; vq_lane++) {\n"
            + "    float o_[PLV];\n" + reader.text("k_", "PLV", "o_") + "\n"
            + "    for (int j = 0; j < PLV; j++) out[((long)bh * n + tok) * (32 * PLV) + vq_lane * PLV + j] = o_[j];\n  }\n}\n")


def _lib(reader):
    src = host_source(reader)
    key = hashlib.sha1(src.encode()).hexdigest()
    if key not in _LIBS:
        d = Path(tempfile.mkdtemp(prefix="vq_reader_"))
        (d / "r.cpp").write_text(src)
        r = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas", "-o", str(d / "r.so"), str(d / "r.cpp")],
                           capture_output=True, text=True, timeout=300)
        if r.returncode: raise RuntimeError(f"g++ failed on the reader:\n{r.stderr[:4000]}")
        _LIBS[key] = ctypes.CDLL(str(d / "r.so"))
    return _LIBS[key]


def run_reader(reader, arrays: dict, n: int) -> np.ndarray:
    """The reader's decode of tokens [0, n) of a store's `arrays` [B, H, CAP, ...]: float32 [B, H, n, dims]."""
    lib = _lib(reader)
    a0 = arrays[next(iter(reader.fields))]
    B, H, CAP = a0.shape[:3]
    ins = []
    for (name, dt), arr in zip(reader.types(""), reader.inputs(arrays)):
        x = np.ascontiguousarray(np.array(arr.astype(mx.float32) if dt == "float32" else arr)).astype(_NP[dt], copy=False)
        assert x.dtype == _NP[dt], (name, x.dtype, dt)
        ins.append(x)
    out = np.zeros((B * H * n * reader.dims,), np.float32)
    ptrs = [x.ctypes.data_as(ctypes.c_void_p) for x in ins]
    lib.run(*ptrs, ctypes.c_int(B * H), ctypes.c_int(CAP), ctypes.c_int(n), out.ctypes.data_as(ctypes.c_void_p))
    return out.reshape(B, H, n, reader.dims)
