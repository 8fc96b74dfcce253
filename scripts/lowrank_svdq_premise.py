"""SVDq's premise on the default model (the run whose output is nbs/lowrank_svdq_premise.txt): keys of the first 2048
evaluation tokens in seven layers; relative key error ||K_hat - K|| / ||K|| (post-RoPE) of the svdq quantizer for five
1.25-bit schedules fitted on pre-RoPE keys and the default schedule fitted on post-RoPE keys; then per layer the energy
share of the top 16 of 64 directions of each head, pre- and post-RoPE. Run with PYTHONPATH holding veloxquant.lowrank
(the draft of veloxquant/lowrank.py it used is the same code)."""
import numpy as np, mlx.core as mx, json, time
from mlx_lm.models.cache import KVCache
from veloxquant.models import load_model, eval_tokens
import veloxquant.rope as rope
import veloxquant.lowrank as L
t0=time.time()
model, tok = load_model(); ids = eval_tokens(tok, 2048)
fp = [KVCache() for _ in model.layers]; mx.eval(model(mx.array(ids)[None], cache=fp))
print("fwd", time.time()-t0)
scheds = {"8-2-0-0-0-0-0-0":(8,2,0,0,0,0,0,0), "4-4-2-0-0-0-0-0":(4,4,2,0,0,0,0,0), "4-2-2-1-1-0-0-0":(4,2,2,1,1,0,0,0), "6-2-1-1-0-0-0-0":(6,2,1,1,0,0,0,0), "3-3-2-1-1-0-0-0":(3,3,2,1,1,0,0,0)}
res = {s: [] for s in scheds}; res["post_rope_4-2-2-1-1"]=[]; spec_energy=[]
for li in (0, 5, 10, 15, 20, 25, 29):
    k = fp[li].state[0][:, :, :2048].astype(mx.float32)
    spec = rope.layer_rope(model.layers[li])
    kp = rope.invert_rope(spec, k, 0)
    for name, kk in (("pre", kp), ("post", k)):
        m, B, s = L.fit_basis(kk)
        e = np.array(s[0])**2; e = e / e.sum(-1, keepdims=True)
        spec_energy.append((li, name, [round(float(np.cumsum(e[h])[15]),3) for h in range(3)]))
    for sname, sch in list(scheds.items()) + [("post_rope_4-2-2-1-1", (4,2,2,1,1,0,0,0))]:
        src = k if sname.startswith("post") else kp
        m, B, s = L.fit_basis(src)
        bits = tuple(b for b in sch for _ in range(8)); r = sum(1 for b in bits if b)
        step = s[..., :r] * mx.array([L.gaussian_step(b) for b in bits[:r]])
        z = (src - m[:, :, None]) @ B[..., :r]
        zh = L.dequantize_latent(L.quantize_latent(z, bits[:r], step[:, :, None]), bits[:r], step[:, :, None])
        rec = zh @ B[..., :r].swapaxes(-1, -2) + m[:, :, None]
        if not sname.startswith("post"): rec = rope.apply_rope(spec, rec, 0)
        res[sname].append(float(mx.linalg.norm(rec - k) / mx.linalg.norm(k)))
for s, v in res.items(): print(s, np.round(v, 3), round(float(np.mean(v)),3))
for x in spec_energy: print(x)
