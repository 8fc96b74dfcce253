"""Host time (graph building, no evaluation) of one B = 1 decode layer through the GPU path, measured on a machine
without a GPU: MLX's `mx.fast.cuda_kernel` is replaced by a fake whose launches return zero arrays of the output shapes,
and `mx.cuda.is_available` says True, so veloxquant takes its CUDA path (window write, launch plans, the decode and
merge launches, the coded path's readers) and only the Python and the graph ops are timed. MLX's own cost of a real
custom-kernel launch (it writes the kernel's source per call) is not in these numbers. Stock mlx-lm's KVCache + SDPA is
timed beside them. Medians of `--reps` calls, µs, the rows interleaved (one call of each per repetition); `--profile` prints the top functions by own time; `--replay` adds
each spec with `gpu.REPLAY_DECODE` (the decode step's two launches replayed through `mx.compile`).

    python scripts/host_fake_kernels.py --context 8192 --specs "turboquant:key_bits=3,value_bits=3;affine;polar;kivi"
"""
import argparse, cProfile, json, pstats, time
import mlx.core as mx

mx.cuda.is_available = lambda: True
def _fake_cuda_kernel(**_):  # one node per output that depends on the launch (as a real launch's outputs do), nothing computed
    return lambda **a: [mx.broadcast_to(a["inputs"][0].reshape(-1)[:1].astype(d), s) for s, d in zip(a["output_shapes"], a["output_dtypes"])]
mx.fast.cuda_kernel = _fake_cuda_kernel

import veloxquant  # noqa: E402,F401
from veloxquant import gpu  # noqa: E402
from veloxquant.core import parse_method  # noqa: E402
from veloxquant.attention import dispatch  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--context", type=int, default=8192); ap.add_argument("--reps", type=int, default=2000)
ap.add_argument("--specs", default="turboquant:key_bits=3,value_bits=3;affine:key_bits=4,value_bits=4;polar;kivi")
ap.add_argument("--profile", action="store_true"); ap.add_argument("--out")
ap.add_argument("--replay", action="store_true", help="each spec also with gpu.REPLAY_DECODE (the decode step replayed through mx.compile)")
a = ap.parse_args()
assert gpu.backend() == "cuda"
H, Hq, D, C = 8, 32, 128, a.context

mx.random.seed(0)
q = mx.random.normal((1, Hq, 1, D)).astype(mx.float16); k1 = mx.random.normal((1, H, 1, D)).astype(mx.float16); mx.eval(q, k1)
fill = lambda: (mx.random.normal((1, H, C, D)).astype(mx.float16), mx.random.normal((1, H, C, D)).astype(mx.float16))
st = KVCache(); st.update_and_fetch(*fill()); mx.eval(st.keys, st.values)
def stock_layer():
    kk, vv = st.update_and_fetch(k1, k1); st.offset -= 1  # stays at one length
    return scaled_dot_product_attention(q, kk, vv, st, D ** -0.5, None)
layers, states = {"stock (KVCache + SDPA)": stock_layer}, {"stock (KVCache + SDPA)": lambda: [st.keys, st.values]}
for spec, comp in [(s, c) for s in a.specs.split(";") for c in ((False, True) if a.replay else (False,))]:
    gpu.REPLAY_DECODE = comp  # read when the cache prepares its decode step (the first steps below)
    c = parse_method(spec).make_cache(); c.update_and_fetch(*fill())
    if hasattr(c, "_flush"): c._flush()
    mx.eval(c.state)
    def layer(c=c):
        kk, vv = c.update_and_fetch(k1, k1)
        return dispatch(q, kk, vv, c, D ** -0.5, None)
    for _ in range(200): mx.eval(layer())  # the window fills and flushes, plans and probes are made
    name = spec + (" (compiled replay)" if comp else "")
    layers[name] = layer; states[name] = lambda c=c: [x for x in vars(c).values() if isinstance(x, mx.array)]
gpu.REPLAY_DECODE = False
# the rows interleaved (one call of each per repetition: a noisy machine slows them alike); every 16 repetitions the
# outputs and the caches are evaluated, untimed, as a generation loop evaluates each token
ts, outs = {k: [] for k in layers}, []
for r in range(a.reps):
    for k, fn in layers.items():
        t0 = time.perf_counter(); o = fn(); ts[k].append(time.perf_counter() - t0); outs.append(o)
    if r % 16 == 15: mx.eval(outs, *[f() for f in states.values()]); outs = []
rows = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in ts.items()}
if a.profile:
    for k, fn in layers.items():
        pr = cProfile.Profile(); pr.enable()
        for r in range(a.reps):
            outs.append(fn())
            if r % 16 == 15: mx.eval(outs, *states[k]()); outs = []
        pr.disable(); print(f"## {k}"); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
print(f"host time of one B = 1 decode layer, context {C}, GPU kernels faked (µs, median of {a.reps}, rows interleaved); MLX {mx.__version__}")
for k, v in rows.items(): print(f"  {v:7.1f}  {k}")
if a.out: json.dump(dict(context=C, mlx=mx.__version__, us=rows, command="python scripts/host_fake_kernels.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k in ("context", "reps", "specs")) + (" --replay" if a.replay else "")), open(a.out, "w"), indent=1)
