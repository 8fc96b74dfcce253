"""Where a decode step's time goes on a GPU (host graph building vs device), and what holds prefill memory.

Usage: python scripts/profile_decode.py OUT_JSON [contexts] [specs separated by ';']
Parts: (A) per-op costs of tiny MLX ops / custom kernels; (B) a 32-layer Llama-3.1-8B-shaped random model decoding
through each cache (filled directly with random K/V, no prefill): host build µs per token, synchronous eval µs,
pipelined (generate_step-style async_eval) µs per token, and a cProfile of the host build; (C) prefill of an 8k
prompt in 2048-token chunks: seconds and peak memory per chunk."""
import cProfile, io, json, pstats, sys, time
import mlx.core as mx
import veloxquant  # noqa: F401  (registers the methods, the batch merge, the kernels)
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant.bench import STOCK, _generate_model
from mlx_lm.models.cache import make_prompt_cache

out_path = sys.argv[1]
contexts = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8192,32768").split(",")]
specs = (sys.argv[3] if len(sys.argv) > 3 else
         "stock;affine:key_bits=4,value_bits=4;affine:key_bits=4,value_bits=4,window=0;turboquant:key_bits=3,value_bits=3").split(";")
res = {"device": str(mx.default_device()), "mlx": mx.__version__}
med = lambda xs: sorted(xs)[len(xs) // 2]

# (A) per-op costs
x = mx.zeros((16,), mx.float16); mx.eval(x)
for N in (200, 2000):
    t0 = time.perf_counter(); y = x
    for _ in range(N): y = y + 1
    t1 = time.perf_counter(); mx.eval(y); t2 = time.perf_counter()
    res[f"add_chain_{N}"] = dict(build_us_per_op=(t1 - t0) / N * 1e6, eval_us_per_op=(t2 - t1) / N * 1e6)
buf = mx.zeros((1, 8, 256, 128), mx.float16); tok = mx.ones((1, 8, 1, 128), mx.float16); mx.eval(buf, tok)
t0 = time.perf_counter()
for i in range(200): buf[:, :, i:i + 1] = tok
t1 = time.perf_counter(); mx.eval(buf); t2 = time.perf_counter()
res["slice_update_200"] = dict(build_us_per_op=(t1 - t0) / 200 * 1e6, eval_us_per_op=(t2 - t1) / 200 * 1e6)
import veloxquant.gpu as gpu
k = mx.fast.cuda_kernel(name="vq_tiny", input_names=["a"], output_names=["o"],
                        source="const int i = threadIdx.x; o[i] = a[i] + 1.0f;") if gpu.backend() == "cuda" else None
if k is not None:
    a = mx.zeros((128,), mx.float32); mx.eval(a)
    for N in (1, 200):
        t0 = time.perf_counter(); y = a
        for _ in range(N):
            (y,) = k(inputs=[y], grid=(128, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(128,)], output_dtypes=[mx.float32])
        t1 = time.perf_counter(); mx.eval(y); t2 = time.perf_counter()
        res[f"custom_kernel_chain_{N}"] = dict(build_us_per_op=(t1 - t0) / N * 1e6, eval_us_per_op=(t2 - t1) / N * 1e6)
print(json.dumps({k_: v for k_, v in res.items()}, indent=1), flush=True)

# (B) decode through a 32-layer model
model, prompt_fn, label = _generate_model(None, 32)
res["model"] = label
H, D = 8, 128

def fill(caches, ctx):
    mx.random.seed(1)
    for c in caches:
        kk = mx.random.normal((1, H, ctx, D)).astype(mx.float16); vv = mx.random.normal((1, H, ctx, D)).astype(mx.float16)
        if hasattr(c, "_flush"):
            c.update_and_fetch(kk, vv); c._flush()
            mx.eval(*[a for a in (c.k_exact, c.v_exact) if a is not None], *c.k_store.arrays.values(), *c.v_store.arrays.values())
        else:
            c.update_and_fetch(kk, vv); mx.eval(c.keys, c.values)

rows = []
for ctx in contexts:
    for spec in specs:
        mx.clear_cache(); mx.reset_peak_memory()
        caches = make_prompt_cache(model) if spec == STOCK else KVCacheBuilder.for_model(model, parse_method(spec))
        fill(caches, ctx)
        y = mx.array([[1]])
        for _ in range(4): mx.eval(model(y, cache=caches))  # warm-up: compaction, kernel compilation
        build, sync = [], []
        for _ in range(16):
            t0 = time.perf_counter(); lg = model(y, cache=caches); t1 = time.perf_counter(); mx.eval(lg); t2 = time.perf_counter()
            build.append((t1 - t0) * 1e6); sync.append((t2 - t0) * 1e6)
        # pipelined, as generate_step: the next step's graph is built while the device runs this one
        steps = 48
        t0 = time.perf_counter()
        tok_ = mx.argmax(model(y, cache=caches)[:, -1], axis=-1); mx.async_eval(tok_)
        for _ in range(steps):
            nxt = mx.argmax(model(tok_[None], cache=caches)[:, -1], axis=-1); mx.async_eval(nxt)
            tok_.item(); tok_ = nxt
        tok_.item(); pipe = (time.perf_counter() - t0) / (steps + 1) * 1e6
        prof = ""
        if spec != STOCK and ctx == contexts[0]:
            pr = cProfile.Profile(); pr.enable()
            for _ in range(8): mx.eval(model(y, cache=caches))
            pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); prof = s.getvalue()
        r = dict(ctx=ctx, spec=spec, build_us=med(build), sync_us=med(sync), pipelined_us=pipe, tok_s=1e6 / pipe,
                 peak_gb=mx.get_peak_memory() / 1e9, kv_bytes=sum(c.nbytes for c in caches))
        print(json.dumps(r), flush=True)
        if prof: print(prof[:6000], flush=True); r["profile"] = prof
        rows.append(r)
        del caches
res["decode"] = rows

# (C) prefill of 8k in 2048-token chunks: time and peak memory per chunk
pre = []
if len(sys.argv) > 4 and sys.argv[4] == "noprefill": specs = []
prompt = mx.array(prompt_fn(8192, 1)[0])
for spec in specs:
    mx.clear_cache()
    caches = make_prompt_cache(model) if spec == STOCK else KVCacheBuilder.for_model(model, parse_method(spec))
    chunks = []
    for s0 in range(0, 8192, 2048):
        mx.reset_peak_memory(); base = mx.get_active_memory()
        t0 = time.perf_counter(); model(prompt[s0:s0 + 2048][None], cache=caches); mx.eval([c.state for c in caches]); t1 = time.perf_counter()
        chunks.append(dict(start=s0, s=t1 - t0, peak_gb=mx.get_peak_memory() / 1e9, active_before_gb=base / 1e9,
                           active_after_gb=mx.get_active_memory() / 1e9))
        mx.clear_cache()
    pre.append(dict(spec=spec, chunks=chunks)); print(json.dumps(pre[-1]), flush=True)
    del caches
res["prefill"] = pre
json.dump(res, open(out_path, "w"), indent=1)
print("| ctx | spec | build µs | sync µs | pipelined µs | tok/s |")
for r in rows: print(f"| {r['ctx']} | {r['spec']} | {r['build_us']:.0f} | {r['sync_us']:.0f} | {r['pipelined_us']:.0f} | {r['tok_s']:.1f} |")
