"""Eviction methods on the default model (CPU) through the `veloxquant eval` harness's own functions
(`veloxquant.eval.decode_run`, `compare_to_reference`, `niah`): KL / ΔPPL to fp16 over decode-scored tokens, bytes
from `nbytes`, NIAH. The fp16 reference of the token window is computed once and shared through a file (several
processes can run configs in parallel); each record is appended to OUT.jsonl as soon as it is measured.
Usage:
  python scripts/eval_evict.py OUT.jsonl --specs "h2o:budget=0.25;snapkv:budget=0.5,quantizer=turboquant:key_bits=3+value_bits=3"
     [--context 1536] [--n-scored 512] [--ref /tmp/ref.npz] [--niah 1024,2048 --niah-depths 0.5]"""
import argparse, json, os, time
import numpy as np
import mlx.core as mx
import veloxquant as vq
from veloxquant.eval import Reference, decode_run, compare_to_reference, config_label, niah, fp16_reference
from veloxquant.models import load_model, eval_tokens, with_bos

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("--specs", default="", help="';'-separated method specs (quantizer options joined by '+')")
p.add_argument("--context", type=int, default=1536); p.add_argument("--n-scored", type=int, default=512)
p.add_argument("--ref", default="/work/evict_runs/ref_1536_512.npz"); p.add_argument("--niah", default="")
p.add_argument("--niah-depths", default="0.5")
a = p.parse_args()
model, tok = load_model()[:2]
cfgs = [vq.parse_method(s) for s in a.specs.split(";") if s]

def write(rec):
    with open(a.out, "a") as f: f.write(json.dumps(rec, default=float) + "\n")
    print({k: rec.get(k) for k in ("label", "kl_mean", "delta_ppl_pct", "top1_agreement", "nbytes", "bits_per_element", "niah_accuracy")}, flush=True)

if a.niah:
    for cfg in cfgs:
        rows = niah(model, tok, cfg, [int(x) for x in a.niah.split(",")], [float(x) for x in a.niah_depths.split(",")])
        write(dict(method=cfg.method, label=config_label(cfg), config=cfg.to_dict(), niah=rows,
                   niah_accuracy=float(np.mean([r["correct"] for r in rows]))))
    raise SystemExit
tokens = with_bos(tok, eval_tokens(tok, a.context))
lock = a.ref + ".lock"
if not os.path.exists(a.ref):
    try: fd = os.open(lock, os.O_CREAT | os.O_EXCL); os.close(fd); mine = True
    except FileExistsError: mine = False
    if mine:
        ref = fp16_reference(model, tokens, a.n_scored)
        np.savez(a.ref + ".tmp.npz", logprobs=np.array(ref.run["logprobs"]), nll=ref.run["nll"], nbytes=ref.run["report"]["nbytes"],
                 bpe=ref.run["report"]["bits_per_element"])
        os.replace(a.ref + ".tmp.npz", a.ref)
        write(dict(method="fp16", label="fp16", config={"method": "fp16"}, context=a.context, n_scored=a.n_scored,
                   nbytes=ref.run["report"]["nbytes"], bits_per_element=ref.run["report"]["bits_per_element"], kl_mean=0.0,
                   delta_ppl_pct=0.0, top1_agreement=1.0, ppl=ref.ppl))
runs = [(cfg, decode_run(model, cfg, tokens, a.n_scored)) for cfg in cfgs]  # the runs first: the reference may still be computed elsewhere
while not os.path.exists(a.ref): time.sleep(10)
z = np.load(a.ref)
ref = Reference(list(tokens), a.n_scored, 1, dict(logprobs=mx.array(z["logprobs"]), nll=z["nll"]))
for cfg, run in runs:
    q = compare_to_reference(ref, run); rep = run["report"]
    write(dict(method=cfg.method, label=config_label(cfg), config=cfg.to_dict(), context=a.context, n_scored=a.n_scored,
               nbytes=rep["nbytes"], bits_per_element=rep["bits_per_element"], peak_memory_mb=run["peak_memory_mb"],
               kv_peak_mb=run["kv_peak_mb"], decode_tps=run["decode_tps"], **q))
