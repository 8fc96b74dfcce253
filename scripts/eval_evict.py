"""Eviction methods on the default model (CPU): KL / ΔPPL to fp16 over decode-scored tokens at 25/50/75 % kept, with
fp16 and a quantizer underneath, bytes from `nbytes`; optional NIAH. Writes JSON records (the `veloxquant eval`
harness: `veloxquant.eval.evaluate`). Usage:
  python scripts/eval_evict.py OUT.json [--specs 'h2o:budget=0.5;snapkv:budget=0.25'] --methods h2o,tova --budgets 0.25,0.5,0.75 [--quantizer SPEC] [--tasks kl,ppl]
     [--context 1536] [--n-scored 512] [--niah 1024,2048]"""
import argparse, json, sys
import veloxquant as vq
from veloxquant.eval import evaluate, save_results
from veloxquant.models import load_model

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("--methods", default=""); p.add_argument("--budgets", default="0.25,0.5,0.75")
p.add_argument("--specs", default="", help="';'-separated method specs (quantizer options joined by '+')")
p.add_argument("--quantizer", default="fp16"); p.add_argument("--tasks", default="ppl,kl")
p.add_argument("--context", type=int, default=1536); p.add_argument("--n-scored", type=int, default=512)
p.add_argument("--niah", default="1024,2048"); p.add_argument("--baseline", action="store_true", help="also the quantizer alone")
a = p.parse_args()
model, tok = load_model()[:2]
cfgs = [vq.KVCacheConfig(m, budget=float(b), quantizer=a.quantizer) for m in a.methods.split(",") if m for b in a.budgets.split(",")]
cfgs += [vq.parse_method(s) for s in a.specs.split(";") if s]
if a.baseline: cfgs.insert(0, vq.parse_method(a.quantizer))
recs = evaluate(model, tok, cfgs, tasks=a.tasks, context=a.context, n_scored=a.n_scored,
                niah_lengths=[int(x) for x in a.niah.split(",")], attn_probe=0, progress=False)
for r in recs:
    r.pop("layer_nbytes", None)
    print(r["label"], {k: r.get(k) for k in ("kl_mean", "delta_ppl_pct", "top1_agreement", "nbytes", "bits_per_element", "niah_accuracy", "decode_tps")}, flush=True)
save_results(recs, a.out, meta=dict(argv=sys.argv[1:]))
