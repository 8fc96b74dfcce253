"""The pieces of a prefill chunk's attention over a compressed history on a GPU (one layer of the Llama-3.1-8B shape:
8 KV heads, 32 query heads, head_dim 128, B = 1): decoding N coded tokens to fp16 (`Codec.decode_as`, keys and values)
against the fused SDPA of a 2048-query chunk over N + 2048 fp16 tokens (what stock mlx-lm pays per layer and chunk).
Median of `--reps` synchronous evaluations, milliseconds.

    python scripts/profile_prefill_pieces.py OUT.json --n 8192,30720
"""
import argparse, json, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.methods.turboquant import TurboQuantCodec
from veloxquant.methods.affine import AffineCodec

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--n", default="8192,30720"); ap.add_argument("--reps", type=int, default=9)
a = ap.parse_args()

def med(fn, reps):
    for _ in range(2): mx.eval(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); mx.eval(fn()); ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[reps // 2]

H, Hq, D, L = 8, 32, 128, 2048
rows = []
for N in [int(x) for x in a.n.split(",")]:
    mx.random.seed(0)
    x = mx.random.normal((1, H, N, D)).astype(mx.float16); q = mx.random.normal((1, Hq, L, D)).astype(mx.float16)
    K = mx.random.normal((1, H, N + L, D)).astype(mx.float16); mx.eval(x, q, K)
    rows.append(dict(N=N, piece="sdpa 2048 queries over N+2048 fp16 (causal)", ms=med(lambda: mx.fast.scaled_dot_product_attention(q, K, K, scale=D ** -0.5, mask="causal"), a.reps)))
    for name, codec in (("turboquant 3", TurboQuantCodec(D, 3)), ("affine 4", AffineCodec(D, 4, 64))):
        enc = codec.encode(x); mx.eval(enc)
        rows.append(dict(N=N, piece=f"{name} decode_as fp16 (one side)", ms=med(lambda: codec.decode_as(enc, mx.float16), a.reps)))
        f = mx.compile(lambda e: codec.decode_as(e, mx.float16))
        rows.append(dict(N=N, piece=f"{name} decode_as fp16, mx.compile", ms=med(lambda: f(enc), a.reps)))
        if name.startswith("turboquant"):
            RT16 = mx.contiguous(codec.R.T.astype(mx.float16)); mx.eval(RT16)
            rows.append(dict(N=N, piece=f"{name} rotated_unit only (float32)", ms=med(lambda: codec.rotated_unit(enc), a.reps)))
            rows.append(dict(N=N, piece=f"{name} matmul float32 [N, D] @ Rt only", ms=med(lambda: x.astype(mx.float32) @ codec.R.T, a.reps)))
            rows.append(dict(N=N, piece=f"{name} decode in fp16: (y16 * norm) @ Rt16", ms=med(
                lambda: (codec.rotated_unit(enc).astype(mx.float16) * enc["norm"]) @ RT16, a.reps)))
    for r in rows: 
        if r["N"] == N: print(json.dumps(r), flush=True)
json.dump(dict(device=str(mx.default_device()), mlx=mx.__version__, rows=rows), open(a.out, "w"), indent=1)
