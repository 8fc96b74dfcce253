"""Decode attention through an evicting cache against what it keeps (one layer of the default model's shape:
3 KV heads, 9 query heads, head_dim 64, float32 as on CPU). Prefills S random post-RoPE-like tokens through the
cache (chunks of 2048), ends the prompt, then times (a) `attend` of one decode query over the held tokens and
(b) a whole decode step (`update_and_fetch` + the dispatcher, statistics included), the fastest of `reps` runs
(the minimum: on a shared machine preemption inflates medians), and stock `mx.fast` SDPA over as many tokens.
Writes JSON rows. Usage: python scripts/bench_evict.py OUT.json [--tokens 4096] [--reps 30]
[--kv-heads 3 --rep 3 --head-dim 64 --dtype float32] (another layer shape / dtype, e.g. a GPU run:
--tokens 32768 --kv-heads 8 --rep 4 --head-dim 128 --dtype float16)"""
import argparse, json, time, statistics
import mlx.core as mx
import veloxquant as vq
from veloxquant.evict import run_layer
from veloxquant.attention import dispatch

p = argparse.ArgumentParser(); p.add_argument("out"); p.add_argument("--tokens", type=int, default=4096); p.add_argument("--reps", type=int, default=30)
p.add_argument("--kv-heads", type=int, default=3); p.add_argument("--rep", type=int, default=3); p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
a = p.parse_args()
S, Hkv, rep, D, dt = a.tokens, a.kv_heads, a.rep, a.head_dim, getattr(mx, a.dtype)
mx.random.seed(0)
q, k, v = (mx.random.normal((1, h, S + a.reps + 8, D)).astype(dt) for h in (Hkv * rep, Hkv, Hkv))
mx.eval(q, k, v)

def med(f):
    ts = []
    for _ in range(a.reps):
        t = time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter() - t)
    return min(ts) * 1e3

rows = []
# stock fp16 SDPA over all S tokens (the reference point)
kk, vv = k[:, :, :S + 1], v[:, :, :S + 1]
rows.append(dict(method="mx.fast SDPA (all tokens)", budget=1.0, held=S, attend_ms=med(lambda: mx.fast.scaled_dot_product_attention(q[:, :, S:S + 1], kk, vv, scale=D ** -0.5)), step_ms=None, layer_nbytes=kk.nbytes + vv.nbytes))
for spec in ["knorm:budget={b}", "knorm:budget={b},quantizer=turboquant:key_bits=3+value_bits=3", "h2o:budget={b}", "snapkv:budget={b}"]:
    for b in (1.0, 0.75, 0.5, 0.25):
        c = vq.parse_method(spec.format(b=b)).make_cache()
        chunks = [2048] * (S // 2048) + ([S % 2048] if S % 2048 else [])
        run_layer(c, q[:, :, :S], k[:, :, :S], v[:, :, :S], chunks)
        run_layer(c, q[:, :, S:S + 1], k[:, :, S:S + 1], v[:, :, S:S + 1], [1])  # the prompt ends: eviction
        mx.eval(c.state)
        qs, ks, vs = q[:, :, S + 1:S + 2], k[:, :, S + 1:S + 2], v[:, :, S + 1:S + 2]
        att = med(lambda: c.attend(qs, ks, vs, D ** -0.5, None))
        i = [S + 1]
        def step():
            j = i[0]; i[0] += 1
            kk_, vv_ = c.update_and_fetch(k[:, :, j:j + 1], v[:, :, j:j + 1])
            return dispatch(q[:, :, j:j + 1], kk_, vv_, c, D ** -0.5, None), c.pos
        stp = med(step)
        kh, vh = k[:, :, :c.n], v[:, :, :c.n]
        sd = med(lambda: mx.fast.scaled_dot_product_attention(qs, kh, vh, scale=D ** -0.5))
        rows.append(dict(method=spec.split(":")[0] + (" + turboquant 3/3" if "turboquant" in spec else ""), budget=b, held=c.n,
                         attend_ms=att, step_ms=stp, sdpa_same_tokens_ms=sd, layer_nbytes=c.nbytes))
        print(rows[-1], flush=True)
json.dump(dict(tokens=S, reps=a.reps, shape=dict(n_kv_heads=Hkv, n_heads=Hkv * rep, head_dim=D, dtype=a.dtype), device=str(mx.default_device()), rows=rows), open(a.out, "w"), indent=1)
