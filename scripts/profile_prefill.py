"""Where end-to-end prefill and decode time goes through `generate_step`'s own loop (GPU).

Usage: python scripts/profile_prefill.py OUT_JSON [contexts] [specs separated by ';']

For each context and spec (stock mlx-lm or a method), on the random-weight Llama-3.1-8B-shaped model (fp16, 32 layers):
the prefill is run as `mlx_lm.generate.generate_step` runs it (chunks of 2048 tokens, `mx.eval([c.state for c in
cache])`, `mx.clear_cache()`), twice: a first pass (one-off costs: kernel compilation, new shapes) and a second on fresh
caches. Per chunk: seconds of the model call + state eval and the peak memory so far (GB); the seconds of evaluating
the sealed `state` (checksum) of a filled cache. Then 48 pipelined decode steps (tok/s), the decode's own peak memory
over the active memory the prefill left, and a cProfile of the host side of 8 steps."""
import cProfile, io, json, pstats, sys, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from veloxquant.bench import STOCK, _generate_model
from mlx_lm.models.cache import make_prompt_cache

out_path = sys.argv[1]
contexts = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8192,32768").split(",")]
specs = (sys.argv[3] if len(sys.argv) > 3 else "stock;affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3").split(";")
model, prompt_fn, label = _generate_model(None, 32)
res = {"device": str(mx.default_device()), "mlx": mx.__version__, "model": label, "runs": []}
STEP = 2048


def arrays_of(c):
    st = c.state
    out = []
    def walk(x):
        if isinstance(x, mx.array): out.append(x)
        elif isinstance(x, dict): [walk(v) for v in x.values()]
        elif isinstance(x, (list, tuple)): [walk(v) for v in x]
    walk(st)
    return out


def prefill(caches, prompt, profile=False):
    chunks = []
    pr = cProfile.Profile() if profile else None
    for s0 in range(0, len(prompt) - 1, STEP):
        s1 = min(len(prompt) - 1, s0 + STEP)
        mx.synchronize(); t0 = time.perf_counter()
        if pr: pr.enable()
        model(prompt[s0:s1][None], cache=caches)
        t1 = time.perf_counter()
        mx.eval([c.state for c in caches])
        if pr: pr.disable()
        t2 = time.perf_counter()
        mx.clear_cache()
        chunks.append(dict(start=s0, build_s=t1 - t0, total_s=t2 - t0, peak_gb=mx.get_peak_memory() / 1e9))
    prof = ""
    if pr:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30); prof = s.getvalue()
    return chunks, prof


def state_cost(caches):
    "Seconds to evaluate `state` (sealed, with checksum) of every layer, vs the arrays alone, on a filled cache."
    mx.synchronize(); t0 = time.perf_counter(); mx.eval([c.state for c in caches]); t1 = time.perf_counter()
    return t1 - t0


for ctx in contexts:
    prompt = mx.array(prompt_fn(ctx, 1)[0])
    for spec in specs:
        mk = (lambda: make_prompt_cache(model)) if spec == STOCK else (lambda: KVCacheBuilder.for_model(model, parse_method(spec)))
        r = dict(ctx=ctx, spec=spec)
        mx.clear_cache(); mx.reset_peak_memory()
        c1 = mk(); first, _ = prefill(c1, prompt); del c1
        mx.clear_cache(); mx.reset_peak_memory()
        caches = mk(); second, prof = prefill(caches, prompt, profile=(ctx == contexts[-1]))
        r.update(first_s=sum(c["total_s"] for c in first), second_s=sum(c["total_s"] for c in second),
                 first_chunks=[round(c["total_s"], 4) for c in first], second_chunks=[round(c["total_s"], 4) for c in second],
                 second_build=[round(c["build_s"], 4) for c in second], peak_prefill_gb=mx.get_peak_memory() / 1e9,
                 state_s=[state_cost(caches) for _ in range(3)])
        r["prefill_tps_second"] = (len(prompt) - 1) / r["second_s"]
        # decode: generate_step-style pipelining (peak memory of the decode alone, over what the prefill left)
        r["active_after_prefill_gb"] = mx.get_active_memory() / 1e9; mx.reset_peak_memory()
        y = prompt[-1:][None]
        tok = mx.argmax(model(y, cache=caches)[:, -1], axis=-1); mx.eval(tok)
        for _ in range(8):
            tok = mx.argmax(model(tok[None], cache=caches)[:, -1], axis=-1); mx.eval(tok)
        steps = 48; t0 = time.perf_counter()
        nxt = mx.argmax(model(tok[None], cache=caches)[:, -1], axis=-1); mx.async_eval(nxt)
        for _ in range(steps):
            cur = nxt
            nxt = mx.argmax(model(cur[None], cache=caches)[:, -1], axis=-1); mx.async_eval(nxt)
            cur.item()
        nxt.item(); r["decode_tps"] = (steps + 1) / (time.perf_counter() - t0)
        pr = cProfile.Profile(); pr.enable()
        for _ in range(8): t = time.perf_counter(); lg = model(tok[None], cache=caches)
        pr.disable(); mx.eval(lg)
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        t0 = time.perf_counter(); lg = model(tok[None], cache=caches); r["decode_build_ms"] = (time.perf_counter() - t0) * 1e3; mx.eval(lg)
        r["decode_peak_gb"] = mx.get_peak_memory() / 1e9
        r["kv_bytes"] = sum(c.nbytes for c in caches)
        print(json.dumps(r), flush=True)
        if spec != STOCK and ctx == contexts[0]: print(s.getvalue()[:5000], flush=True)
        if prof and spec != STOCK: print(prof[:6000], flush=True); r["prefill_profile"] = prof
        res["runs"].append(r)
        del caches
json.dump(res, open(out_path, "w"), indent=1)
print("| ctx | spec | prefill 1st s | prefill 2nd s | tok/s 2nd | state s | decode tok/s |")
for r in res["runs"]:
    print(f"| {r['ctx']} | {r['spec']} | {r['first_s']:.2f} | {r['second_s']:.2f} | {r['prefill_tps_second']:.0f} | "
          f"{min(r['state_s']):.4f} | {r['decode_tps']:.1f} |")
