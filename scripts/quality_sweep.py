"""Quality sweep over many method configs in one process, for the leaderboard's frontier and the eviction section.

One fp16 reference on one window of the evaluation text, then every config through the harness's own functions
(`veloxquant.eval.decode_run`, `compare_to_reference`, `niah`): KL to fp16 and ΔPPL over decode-scored tokens, bytes
from `nbytes`. Calibrated methods are calibrated first on the `calib` split (disjoint from the evaluation text). Each
record is appended to OUT (JSON lines) as soon as it is measured, so a run cut short keeps what it measured; a config
that fails is recorded with its error and the sweep goes on. Runs on the CPU or a GPU (MLX CUDA or Metal); the device,
dtype and versions go into every record.

Usage:
  python scripts/quality_sweep.py OUT.jsonl --specs "affine:key_bits=4,value_bits=4;snapkv:budget=0.5" \
      [--standard] [--context 2560] [--n-scored 1024] [--chunk 64] [--niah 1024,2048,4096 --niah-depths 0.5 --niah-specs ...]
(`--standard`: every registered method at its standard settings, or those of `--only id,id`, before the --specs.)"""
import argparse, json, platform, time, traceback
from importlib.metadata import version
import numpy as np
import mlx.core as mx
import veloxquant as vq
import veloxquant.calibrate as calibrate
from veloxquant.eval import decode_run, compare_to_reference, config_label, niah, fp16_reference, standard_configs
from veloxquant.models import load_model, eval_tokens, with_bos, default_dtype

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("--specs", default="", help="';'-separated method specs")
p.add_argument("--standard", action="store_true"); p.add_argument("--context", type=int, default=2560)
p.add_argument("--n-scored", type=int, default=1024); p.add_argument("--chunk", type=int, default=64)
p.add_argument("--niah", default=""); p.add_argument("--niah-depths", default="0.5"); p.add_argument("--niah-specs", default="")
p.add_argument("--calib-tokens", type=int, default=4096)
p.add_argument("--only", default="", help="comma-separated method ids: keep only their standard settings (with --standard)")
p.add_argument("--max-bits", type=float, default=0.0,
               help="a config with a non-zero mixed_width is first fitted to this bit budget: bits per element from nbytes after a "
                    "prefill of the same tokens (the scored run ends at that length), mixed_width lowered and recalibrated until under")
p.add_argument("--niah-scored", action="store_true", help="also run --niah on every scored config (as fitted)")
p.add_argument("--offset", type=int, default=0, help="first token of the evaluation window in the eval split (0: its start)")
p.add_argument("--dtype", default="", help="model dtype (default: the back-end's, float16 on a GPU, float32 on the CPU)")
a = p.parse_args()
model, tok = load_model(dtype=a.dtype or None)[:2]
if a.dtype == "float32":  # the prepared float32 folder; cast anything left (as load_model does on the CPU)
    from mlx.utils import tree_map
    model.update(tree_map(lambda x: x.astype(mx.float32) if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating) else x,
                          model.parameters()))
env = dict(device=str(mx.default_device()), dtype=a.dtype or default_dtype(), mlx=version("mlx"), mlx_lm=version("mlx-lm"),
           host=platform.node(), date=time.strftime("%Y-%m-%d"))

def write(rec):
    with open(a.out, "a") as f: f.write(json.dumps({**rec, **env}, default=float) + "\n")
    print({k: rec.get(k) for k in ("label", "kl_mean", "delta_ppl_pct", "bits_per_element", "niah_accuracy", "error")}, flush=True)

only = [m for m in a.only.split(",") if m]
cfgs = (standard_configs(only or None) if a.standard else []) + [vq.parse_method(s) for s in a.specs.split(";") if s.strip()]
calibrated = set()
def ensure_calibrated(cfg):  # one artifact per method and the settings it is keyed by, made just before its first run
    if calibrate.calibration_of(cfg.method) is None: return
    key = (cfg.method, json.dumps(calibrate.settings_of(cfg.method, cfg.options), sort_keys=True, default=str))
    if key in calibrated: return
    calibrated.add(key)
    try:
        t0 = time.perf_counter(); path = calibrate.calibrate(cfg, model, tokens=a.calib_tokens, progress=False, tokenizer=tok)
        write(dict(method=cfg.method, label=f"calibrate {config_label(cfg)}", calibration_s=time.perf_counter() - t0, artifact=str(path),
                   artifact_bytes=path.stat().st_size))
    except Exception as e: write(dict(method=cfg.method, label=f"calibrate {config_label(cfg)}", error=f"{type(e).__name__}: {e}"))

tokens = with_bos(tok, eval_tokens(tok, a.context, offset=a.offset))
ref = fp16_reference(model, tokens, a.n_scored, chunk=a.chunk)
write(dict(method="fp16", label="fp16", context=a.context, offset=a.offset, n_scored=a.n_scored, chunk=a.chunk,
           nbytes=ref.run["report"]["nbytes"], bits_per_element=ref.run["report"]["bits_per_element"], kl_mean=0.0,
           delta_ppl_pct=0.0, top1_agreement=1.0, ppl=ref.ppl))
def fit_bits(cfg):
    "Lower `mixed_width` (recalibrating) until the bits per element after a prefill of the tokens are <= --max-bits."
    for _ in range(8):
        ensure_calibrated(cfg)
        b = decode_run(model, cfg, tokens, 1, chunk=1, tokenizer=tok)["report"]["bits_per_element"]
        write(dict(method=cfg.method, label=f"fit {config_label(cfg)}", config=cfg.to_dict(), bits_per_element=b))
        if b <= a.max_bits: return cfg
        d = cfg.to_dict(); d["mixed_width"] = round(d["mixed_width"] - max(0.01, 1.02 * (b - a.max_bits)), 3)
        cfg = vq.KVCacheConfig.from_dict(d)
    raise RuntimeError(f"no mixed_width under {a.max_bits} bits in 8 steps")
for cfg in cfgs:
    if cfg.method == "fp16": continue
    try:
        if a.max_bits and getattr(cfg.options, "mixed_width", 0): cfg = fit_bits(cfg)
        ensure_calibrated(cfg)
        run = decode_run(model, cfg, tokens, a.n_scored, chunk=a.chunk, tokenizer=tok)
        q, rep = compare_to_reference(ref, run), run["report"]
        write(dict(method=cfg.method, label=config_label(cfg), config=cfg.to_dict(), context=a.context, offset=a.offset, n_scored=a.n_scored,
                   chunk=a.chunk, nbytes=rep["nbytes"], bits_per_element=rep["bits_per_element"],
                   layer_nbytes=run["layer_nbytes"], peak_memory_mb=run["peak_memory_mb"], scoring_tps=run["scoring_tps"],
                   prefill_tps=run["prefill_tps"], **q))
        if a.niah and a.niah_scored:
            rows = niah(model, tok, cfg, [int(x) for x in a.niah.split(",")], [float(x) for x in a.niah_depths.split(",")])
            write(dict(method=cfg.method, label=config_label(cfg), config=cfg.to_dict(), niah=rows,
                       niah_accuracy=float(np.mean([r["correct"] for r in rows]))))
    except Exception as e:
        write(dict(method=cfg.method, label=config_label(cfg), error=f"{type(e).__name__}: {str(e)[:300]}",
                   trace=traceback.format_exc()[-800:]))
if a.niah:
    for s in [s for s in a.niah_specs.split(";") if s.strip()]:
        cfg = vq.parse_method(s)
        try:
            ensure_calibrated(cfg)
            rows = niah(model, tok, cfg, [int(x) for x in a.niah.split(",")], [float(x) for x in a.niah_depths.split(",")])
            write(dict(method=cfg.method, label=config_label(cfg), config=cfg.to_dict(), niah=rows,
                       niah_accuracy=float(np.mean([r["correct"] for r in rows]))))
        except Exception as e: write(dict(method=cfg.method, label=config_label(cfg), error=f"{type(e).__name__}: {str(e)[:300]}"))
