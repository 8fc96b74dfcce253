"""A stand-in for MLX's CUDA back-end on a machine without one, for tests and host-time measurements of veloxquant's GPU
code path: `install()` makes `mx.cuda.is_available()` say True and replaces `mx.fast.cuda_kernel` with launches computed by
MLX operations on the CPU. Their outputs are not the kernels' results: each output is a value that depends on every
input's values (means) and shapes, on the launch's template values, grid, threadgroup and output shapes, and the decode merge's on the number of exact tokens it reads, `eref`'s shape or, with
template EV = 1, `eref[0]`, over the first E positions of the exact keys/values only. Two paths that launch the same
kernels on the same inputs (e.g. compiled replay and launch-by-launch) therefore give the same outputs, and a stale length
or input shows. `LAUNCHES` counts the Python calls of each kernel by name (a compiled replay makes none). Import and
install before importing veloxquant."""
import collections, re, zlib
import mlx.core as mx

LAUNCHES = collections.Counter()

def _finite(x):
    "x as float32 of moderate size: integer codes modulo 251, non-finite floats 0, the rest clipped to ±100."
    if not mx.issubdtype(x.dtype, mx.floating): return (x.astype(mx.uint32) % 251).astype(mx.float32) / 251
    return mx.clip(mx.nan_to_num(x.astype(mx.float32), nan=0.0, posinf=0.0, neginf=0.0), -100, 100)

def _merge(inputs, shape, dtype, t):
    pm, pl, pacc, q, ek, ev, sinks, eref = inputs[:8]
    f32 = mx.float32
    E = eref[0].astype(f32) if t.get("EV") else mx.array(float(eref.shape[0]))
    pos = (mx.arange(ek.shape[2]).astype(f32) < E).astype(f32).reshape(1, 1, -1, 1)
    s = (_finite(ek) * pos).sum() / (pos.sum() + 1) + 0.5 * (_finite(ev) * pos).sum() / (pos.sum() + 1)  # slots past E: not data
    base = _finite(pm).mean() + _finite(pl).mean() + _finite(pacc).mean() + _finite(q).mean() + _finite(sinks).mean() + s + 0.01 * E
    return [mx.broadcast_to(base, shape).astype(dtype)]

_DT = {"float": mx.float32, "__half": mx.float16, "__nv_bfloat16": mx.bfloat16}

def _written_template(source):
    "The template values a kernel built by `GuardedKernel.baked` has written at the top of its source, as launch values."
    t = {}
    for m in re.finditer(r"^  (?:constexpr (?:int|bool) (\w+) = (-?\w+)|using (\w+) = (\w+));$", source, flags=re.M):
        if m.group(1): t[m.group(1)] = {"true": True, "false": False}.get(m.group(2)) if m.group(2) in ("true", "false") else int(m.group(2))
        else: t[m.group(3)] = _DT[m.group(4)]
    return t

def _fake_cuda_kernel(name, input_names, output_names, source, header="", **_):
    written = _written_template(source)  # a kernel with its template in the source launches as its template-passing twin
    base = re.sub(r"_b[0-9a-f]{8}$", "", name) if written else name
    def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None, **__):
        LAUNCHES[name] += 1
        t = {**written, **dict(template or [])}
        # the launch's settings (template values but EV, which only says how E is read: the count itself is in the merge's
        # output; grid, threadgroup, output shapes) as a number in [0, 1): a replay that launched with other settings than
        # the same step launch by launch would differ
        tag = (zlib.crc32(repr((sorted((k, str(v)) for k, v in t.items() if k != "EV"), tuple(grid), tuple(threadgroup),
                          [tuple(x) for x in output_shapes])).encode()) % 9973) / 9973
        if base == "vq_decode_merge": return [o + tag for o in _merge(inputs, output_shapes[0], output_dtypes[0], t)]
        named = dict(zip(input_names, inputs))
        n = named["nref"].shape[0] if "nref" in named else None  # a decode kernel's coded length: slots past it are not data
        arrays = [x[:, :, :n] if n is not None and x.ndim == 4 and x.shape[2] >= n else x for x in inputs if isinstance(x, mx.array)]
        sig = sum((_finite(x).mean() for x in arrays if x.size), mx.array(0.0)) + 1e-7 * sum(x.size for x in arrays) + tag
        return [mx.broadcast_to(sig * (i + 1), s).astype(d) for i, (s, d) in enumerate(zip(output_shapes, output_dtypes))]
    return launch

def install():
    "Patch MLX (this process): a CUDA back-end that says it is there, and the fake `cuda_kernel`."
    mx.cuda.is_available = lambda: True
    mx.fast.cuda_kernel = _fake_cuda_kernel
