"""Collect calibration-split K/V (post- and pre-RoPE) and their diagonal Fisher information for the default model
(the same pass `veloxquant calibrate` runs), saved to an .npz for the Fisher-weighted error budget of the per-channel
quantizers (nbs/quality15_fisher.json)."""
import sys, time, numpy as np, mlx.core as mx
import veloxquant.calibrate as calibrate, veloxquant.models as models
from veloxquant.attention import install
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/q15/samples.npz"
split = sys.argv[3] if len(sys.argv) > 3 else "calib"   # "eval": the evaluation text, for the out-of-sample check only
model, tok = models.load_model(None)
install()
ids = calibrate.calibration_tokens(tok, n) if split == "calib" else models.eval_tokens(tok, n, 0, split="eval")
collect = ("keys", "values", "pre_rope_keys")
t0 = time.time()
recs = calibrate.recorders(model, collect)
mx.eval(model(mx.array(ids)[None], cache=recs))
fish = calibrate.fisher_pass(model, ids, recs)
arr = {}
for i, (r, f) in enumerate(zip(recs, fish)):
    for c in collect: arr[f"{i}/{c}"] = np.concatenate(r.seen[c], axis=1).astype(np.float32)
    for c in ("key_fisher", "value_fisher", "pre_rope_key_fisher"): arr[f"{i}/{c}"] = f[c].astype(np.float32)
np.savez(out, **arr)
print("layers", len(recs), "tokens", len(ids), "s", round(time.time() - t0, 1))
