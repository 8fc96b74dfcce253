"""Per-layer widths and sensitivity tables of kvquant `mixed=True` artifacts (verified, from the cache directory) → JSON.
usage: q15_widths.py OUT.json SPEC [SPEC ...]   (SPEC: a kvquant method spec with mixed=true)"""
import json, sys, numpy as np
import veloxquant.calibrate as calibrate, veloxquant.models as models
from veloxquant.core import parse_method
model, _ = models.load_model(None)
fp = calibrate.model_fingerprint(model)
out = {}
for spec in sys.argv[2:]:
    cfg = parse_method(spec)
    path = calibrate.artifact_path("kvquant", cfg.options, fp)
    t, meta = calibrate.load_calibration(path, "kvquant", cfg.options, fp)
    L = int(meta["n_layers"])
    w = [[int(x) for x in t[f"layer{i}/widths"]] for i in range(L)]
    s = [np.nan_to_num(t[f"layer{i}/sensitivity"], nan=-1).tolist() for i in range(L)]
    out[spec] = dict(artifact=path.name, tokens=int(meta["tokens"]), widths=w, sensitivity=s)
json.dump(out, open(sys.argv[1], "w"), indent=1); print("wrote", sys.argv[1])
