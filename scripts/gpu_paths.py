"""Which GPU path breaks a method: each config through the harness (`decode_run` + `compare_to_reference`, KL to the
fp16 reference over decode-scored tokens) with the cache's GPU paths on (auto), then with each one switched off in
turn (`VQCache.decoded_prefill`, `tiled_decode`, `compiled_decode`, the fused kernels through `use_kernels` where a
config has it). A config whose KL or error changes with a switch points at that path. Records as JSON lines, each
with the full traceback of a failure.

Usage: python scripts/gpu_paths.py OUT.jsonl --specs "qjl;kivi_sink:key_bits=2,value_bits=2" [--context 2304]
       [--n-scored 256] [--chunk 16] [--variants all|auto]"""
import argparse, json, time, traceback
import mlx.core as mx
import veloxquant as vq
import veloxquant.cache as cache_mod
import veloxquant.calibrate as calibrate
from veloxquant.eval import decode_run, compare_to_reference, config_label, fp16_reference
from veloxquant.models import load_model, eval_tokens, with_bos, default_dtype

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("--specs", required=True)
p.add_argument("--context", type=int, default=2304); p.add_argument("--n-scored", type=int, default=256)
p.add_argument("--chunk", type=int, default=16); p.add_argument("--variants", default="all")
a = p.parse_args()
model, tok = load_model()[:2]
tokens = with_bos(tok, eval_tokens(tok, a.context))
ref = fp16_reference(model, tokens, a.n_scored, chunk=a.chunk)
env = dict(device=str(mx.default_device()), dtype=default_dtype(), mlx=mx.__version__, context=a.context,
           n_scored=a.n_scored, chunk=a.chunk)
SWITCHES = ("decoded_prefill", "tiled_decode", "compiled_decode")

def write(rec):
    with open(a.out, "a") as f: f.write(json.dumps({**rec, **env}, default=float) + "\n")
    print({k: rec.get(k) for k in ("label", "variant", "kl_mean", "delta_ppl_pct", "error")}, flush=True)

def one(cfg, variant):
    saved = {s: getattr(cache_mod.VQCache, s) for s in SWITCHES}
    try:
        if variant in SWITCHES: setattr(cache_mod.VQCache, variant, False)
        if variant == "cpu_paths":
            for s in SWITCHES: setattr(cache_mod.VQCache, s, False)
        t0 = time.perf_counter()
        run = decode_run(model, cfg, tokens, a.n_scored, chunk=a.chunk, tokenizer=tok)
        q = compare_to_reference(ref, run)
        write(dict(label=config_label(cfg), variant=variant, kl_mean=q["kl_mean"], delta_ppl_pct=q["delta_ppl_pct"],
                   bits_per_element=run["report"]["bits_per_element"], seconds=time.perf_counter() - t0))
    except Exception as e:
        write(dict(label=config_label(cfg), variant=variant, error=f"{type(e).__name__}: {e}"[:2000],
                   trace=traceback.format_exc()[-6000:]))
    finally:
        for s, v in saved.items(): setattr(cache_mod.VQCache, s, v)

for spec in [s for s in a.specs.split(";") if s.strip()]:
    cfg = vq.parse_method(spec)
    if calibrate.calibration_of(cfg.method) is not None:
        try: calibrate.calibrate(cfg, model, tokens=4096, progress=False, tokenizer=tok)
        except Exception as e: write(dict(label=config_label(cfg), variant="calibrate", error=f"{type(e).__name__}: {e}")); continue
    variants = ["auto"] + ([*SWITCHES, "cpu_paths"] if a.variants == "all" else [])
    for v in variants: one(cfg, v)
    if a.variants == "all" and "use_kernels" in (cfg.to_dict() or {}):
        one(vq.parse_method(spec + ("," if ":" in spec else ":") + "use_kernels=False"), "use_kernels=False")
