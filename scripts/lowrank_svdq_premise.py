"""SVDq's premise on the default model: keys before RoPE are lower-rank than after it. For the keys of the first 2048
tokens of the evaluation text in seven layers: the energy share of the top 16 of 64 directions per head (pre- and
post-RoPE), and the relative key error ||K̂ − K|| / ||K|| (post-RoPE, after re-applying RoPE) of SVDq's quantizer for a
few 1.25-bit schedules (and the default schedule fitted on post-RoPE keys). Writes nbs/lowrank_svdq_premise.json."""
import json, sys
import numpy as np, mlx.core as mx
from mlx_lm.models.cache import KVCache
from veloxquant.models import load_model, eval_tokens
import veloxquant.rope as rope
import veloxquant.lowrank as L

T, LAYERS = 2048, (0, 5, 10, 15, 20, 25, 29)
SCHEDULES = ["8-2-0-0-0-0-0-0", "6-2-1-1-0-0-0-0", "4-4-2-0-0-0-0-0", "4-2-2-1-1-0-0-0", "3-3-2-1-1-0-0-0"]

def rel_error(src, k, spec, sched, pre):
    m, B, s = L.fit_basis(src)
    bits = tuple(int(b) for b in sched.split("-") for _ in range(src.shape[-1] // 8))
    kept = tuple(b for b in bits if b); r = len(kept)
    step = s[..., :r] * mx.array([L.gaussian_step(b) for b in kept])
    z = (src - m[:, :, None]) @ B[..., :r]
    zh = L.dequantize_latent(L.quantize_latent(z, kept, step[:, :, None]), kept, step[:, :, None])
    rec = zh @ B[..., :r].swapaxes(-1, -2) + m[:, :, None]
    if pre: rec = rope.apply_rope(spec, rec, 0)
    return float(mx.linalg.norm(rec - k) / mx.linalg.norm(k))

model, tok = load_model(); ids = eval_tokens(tok, T)
fp = [KVCache() for _ in model.layers]; mx.eval(model(mx.array(ids)[None], cache=fp))
rows = []
for li in LAYERS:
    k = fp[li].state[0][:, :, :T].astype(mx.float32)
    spec = rope.layer_rope(model.layers[li]); kp = rope.invert_rope(spec, k, 0)
    row = {"layer": li}
    for name, x in (("pre", kp), ("post", k)):
        e = np.array(L.fit_basis(x)[2][0]) ** 2; e = e / e.sum(-1, keepdims=True)
        row[f"top16_energy_{name}"] = [round(float(np.cumsum(e[h])[15]), 4) for h in range(e.shape[0])]
    for sched in SCHEDULES: row[f"err_pre_{sched}"] = rel_error(kp, k, spec, sched, True)
    row["err_post_4-2-2-1-1-0-0-0"] = rel_error(k, k, spec, "4-2-2-1-1-0-0-0", False)
    rows.append(row)
out = {"command": "python scripts/lowrank_svdq_premise.py", "tokens": T, "rows": rows}
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "nbs/lowrank_svdq_premise.json", "w"), indent=1)
