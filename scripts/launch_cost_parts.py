"""Where the host cost of one custom-kernel launch goes on a GPU back-end: the build (the Python call that makes the
graph node; MLX writes the kernel's source per call) and the enqueue (`mx.async_eval`: MLX hashes the source to find the
compiled module, then launches), for turboquant's decode body as launched (11 inputs, 3 outputs, 11 template values),
with its template values written into the source instead (one kernel object per template: no template per call), with
comments and indentation stripped, and for a tiny body with 1 or 11 inputs, 1 or 3 outputs, 0 or 11 template values.
µs per call, medians of `--reps`, the variants interleaved.

    python scripts/launch_cost_parts.py OUT.json
"""
import argparse, json, re, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant import gpu
from veloxquant.methods import turboquant as tq

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--reps", type=int, default=300)
a = ap.parse_args()

def lean(src):
    "Comments, indentation and blank lines removed (no string literal in these bodies holds //)."
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return "\n".join(l for l in (re.sub(r"//.*", "", x).strip() for x in src.split("\n")) if l) + "\n"

n = 4096
ins = [mx.zeros((32, 128), mx.float16), mx.zeros((1, 8, n, 12), mx.uint32), mx.zeros((1, 8, n, 1), mx.float16), mx.zeros((1, 8, n, 12), mx.uint32),
       mx.zeros((1, 8, n, 1), mx.float16), mx.zeros((64,), mx.uint32), mx.zeros((64,), mx.uint32), mx.eye(128), mx.zeros((n,), mx.uint8),
       mx.zeros((512,), mx.uint8), mx.zeros((1, 3), mx.int32)]
mx.eval(ins)
tmpl = [("D", 128), ("KB", 3), ("VB", 3), ("REP", 4), ("NW", 4), ("U", 2), ("EMU", 0), ("LC", 1), ("HAD", 0), ("SCALE", gpu._float_bits(0.088)), ("PR", 0)]
baked = "".join(f"constexpr int {k} = {v};\n" for k, v in tmpl)
kw = dict(grid=(128 * 8, 8, 1), threadgroup=(128, 1, 1), output_shapes=[(32, 8), (32, 8), (32, 8, 128)], output_dtypes=[mx.float32] * 3)
mk = lambda name, src, hdr: mx.fast.cuda_kernel(name=name, input_names=list(tq.TQ_DECODE_INPUTS), output_names=list(gpu.DECODE_PARTIAL_OUTPUTS),
                                                 source=src, header=hdr)
full = mk("vq_tq_p0", gpu.PROLOGUE_CUDA + tq.TQ_MMA_DECODE_BODY, gpu.COMPAT_CUDA)
bake = mk("vq_tq_p1", baked + gpu.PROLOGUE_CUDA + tq.TQ_MMA_DECODE_BODY, gpu.COMPAT_CUDA)
thin = mk("vq_tq_p2", lean(baked + gpu.PROLOGUE_CUDA + tq.TQ_MMA_DECODE_BODY), lean(gpu.COMPAT_CUDA))
names = [f"a{i}" for i in range(11)]
t1 = mx.zeros((1,)); mx.eval(t1)
tiny1 = mx.fast.cuda_kernel(name="vq_t1", input_names=["a0"], output_names=["o"], source="o[0] = a0[0];")
tiny11 = mx.fast.cuda_kernel(name="vq_t11", input_names=names, output_names=["o"], source="o[0] = 1.0f;")
tiny3 = mx.fast.cuda_kernel(name="vq_t3", input_names=["a0"], output_names=["o", "p", "r"], source="o[0] = a0[0]; p[0] = 0.0f; r[0] = 0.0f;")
one = dict(grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])
q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16); K = mx.random.normal((1, 8, 8192, 128)).astype(mx.float16); mx.eval(q, K)
rows = {
    "tq decode, as launched (11 template values)": lambda: full(inputs=ins, template=tmpl, **kw)[2],
    "tq decode, template written into the source": lambda: bake(inputs=ins, **kw)[2],
    "tq decode, template written in, source stripped": lambda: thin(inputs=ins, **kw)[2],
    "tiny, 1 input": lambda: tiny1(inputs=[t1], **one)[0],
    "tiny, 11 inputs": lambda: tiny11(inputs=ins, **one)[0],
    "tiny, 1 input, 11 template values": lambda: tiny1(inputs=[t1], template=tmpl, **one)[0],
    "tiny, 1 input, 3 outputs": lambda: tiny3(inputs=[t1], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)] * 3, output_dtypes=[mx.float32] * 3)[0],
    "fp16 SDPA 8k": lambda: mx.fast.scaled_dot_product_attention(q, K, K, scale=0.088),
}
res = dict(device=str(mx.default_device()), mlx=mx.__version__, source_chars=dict(full=len(gpu.PROLOGUE_CUDA + tq.TQ_MMA_DECODE_BODY) + len(gpu.COMPAT_CUDA),
           stripped=len(lean(baked + gpu.PROLOGUE_CUDA + tq.TQ_MMA_DECODE_BODY)) + len(lean(gpu.COMPAT_CUDA))), us={})
for fn in rows.values(): mx.eval(fn()); mx.eval(fn())
b = {k: [] for k in rows}; e = {k: [] for k in rows}
for _ in range(a.reps):
    for k, fn in rows.items():
        t0 = time.perf_counter(); o = fn(); t1_ = time.perf_counter(); mx.async_eval(o); t2 = time.perf_counter()
        b[k].append(t1_ - t0); e[k].append(t2 - t1_); mx.eval(o)
med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6
print(f"{res['device']}, MLX {mx.__version__}; source chars {res['source_chars']}; µs, medians of {a.reps}, rows interleaved")
for k in rows:
    res["us"][k] = dict(build=med(b[k]), enqueue=med(e[k])); print(f"{k:50s} build {med(b[k]):6.1f}  enqueue {med(e[k]):6.1f}")
json.dump(res, open(a.out, "w"), indent=1)
