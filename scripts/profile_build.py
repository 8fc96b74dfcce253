"""Where a B = 1 decode token's graph build goes on a GPU host: a 32-layer Llama-shaped model with small matrices (the
build cost per op does not depend on their size), stock mlx-lm's caches and each method's, filled with random K/V; the
model call's build time per token (no evaluation), medians of `--reps`, the specs interleaved; then cProfile of `--prof`
builds per spec, the functions by own time (MLX's nanobind calls count in their Python caller's own time).

    python scripts/profile_build.py OUT.json --context 8192 --specs "stock;affine:key_bits=4,value_bits=4"
"""
import argparse, cProfile, io, json, pstats, time
import mlx.core as mx
import veloxquant  # noqa: F401
from veloxquant.core import parse_method
from veloxquant.builder import KVCacheBuilder
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

ap = argparse.ArgumentParser(); ap.add_argument("out"); ap.add_argument("--context", type=int, default=8192)
ap.add_argument("--specs", default="stock;affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3")
ap.add_argument("--reps", type=int, default=60); ap.add_argument("--prof", type=int, default=40)
a = ap.parse_args()
args = llama.ModelArgs(model_type="llama", hidden_size=1024, num_hidden_layers=32, intermediate_size=2048, num_attention_heads=32,
                       num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=32000, rope_theta=500000.0, tie_word_embeddings=False, head_dim=128)
m = llama.Model(args); m.set_dtype(mx.float16); mx.eval(m.parameters())
sets = {}
for s in a.specs.split(";"):
    caches = make_prompt_cache(m) if s == "stock" else KVCacheBuilder.for_model(m, parse_method(s))
    for c in caches:
        kk = mx.random.normal((1, 8, a.context, 128)).astype(mx.float16); c.update_and_fetch(kk, kk)
        if hasattr(c, "_flush"): c._flush()
        mx.eval(c.state)
    sets[s] = caches
y = mx.array([[1]])
for caches in sets.values():
    for _ in range(20): mx.eval(m(y, cache=caches))
T = {k: [] for k in sets}
for _ in range(a.reps):
    for k, caches in sets.items():
        t0 = time.perf_counter(); lg = m(y, cache=caches); T[k].append(time.perf_counter() - t0); mx.eval(lg)
res = dict(device=str(mx.default_device()), mlx=mx.__version__, context=a.context, build_ms={}, profile={})
for k, v in T.items():
    v.sort(); res["build_ms"][k] = v[len(v) // 2] * 1e3; print(f"{k:40s} build {res['build_ms'][k]:.3f} ms per token", flush=True)
for k, caches in sets.items():
    pr = cProfile.Profile()
    for _ in range(a.prof):
        pr.enable(); lg = m(y, cache=caches); pr.disable(); mx.eval(lg)
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    txt = "\n".join(l for l in s.getvalue().splitlines() if l.strip())
    res["profile"][k] = txt; print(f"## {k} ({a.prof} tokens)\n" + "\n".join(l[:170] for l in txt.splitlines()[3:]), flush=True)
json.dump(res, open(a.out, "w"), indent=1)
