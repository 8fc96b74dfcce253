"""Premise checks of xquant (code agreement of adjacent layers), minicache (direction cosine) and xkv (joint low-rank error)
on a model's real keys and values (one 512-token prefill): python scripts/xlayer_premise.py [MODEL, e.g. gemma3-270m]"""
import sys, mlx.core as mx, numpy as np
from veloxquant.models import load_model, eval_tokens, with_bos
from veloxquant.methods.xquant import XQuantCodec, calibrated_params
from veloxquant.methods.minicache import slerp_merge
from veloxquant.methods.xkv import joint_factors
import veloxquant as vq
model, tok = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
ids = with_bos(tok, eval_tokens(tok, 512))
caches = vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("fp16", reference=True))
KV = {}
from veloxquant.attention import attention_hook
with attention_hook(lambda c, q, k, v, o: KV.setdefault(id(c), (k.astype(mx.float32), v.astype(mx.float32)))):
    model(mx.array(ids)[None], cache=caches)
K = [KV[id(c)][0] for c in caches if id(c) in KV]; V = [KV[id(c)][1] for c in caches if id(c) in KV]
D = K[0].shape[-1]; L = len(K)
rel = lambda a, b: (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()
print(L, "layers", K[0].shape)
for name, X in (("keys", K), ("values", V)):
    agree, own, cross, cos = [], [], [], []
    for l in range(0, L - 1, 2):
        q0 = calibrated_params(X[l], 2, 32, 0.125)[0]; q1 = calibrated_params(X[l + 1], 2, 32, 0.125)[0]
        agree.append(mx.mean(q0 == q1).item())
        lo, up = XQuantCodec(D, 2, 32, 0.125), XQuantCodec(D, 2, 32, 0.125, own_codes=False)
        own.append(rel(lo.decode(lo.encode(X[l + 1])), X[l + 1]))
        cross.append(rel(up.decode({**up.encode(X[l + 1]), "w": lo.encode(X[l])["w"]}), X[l + 1]))
    for l in range(L - 1):
        ea, eb = (x / mx.linalg.norm(x, axis=-1, keepdims=True) for x in (X[l], X[l + 1]))
        cos.append(mx.mean((ea * eb).sum(-1)).item())
    print(f"{name}: xquant 2-bit code agreement {np.mean(agree):.3f}; upper rel err own codes {np.mean(own):.3f}, lower's codes {np.mean(cross):.3f}")
    print(f"{name}: minicache adjacent-layer cosine:", " ".join(f"{c:+.2f}" for c in cos))
    for G in (1, 2, 4):
        row = []
        for r in (16, 64, 128):
            errs = []
            for s in range(0, L - G + 1, G):
                A, Bs = joint_factors(X[s:s + G], r); errs += [rel(A @ b, x) for b, x in zip(Bs, X[s:s + G])]
            row.append(np.mean(errs))
        print(f"{name}: xkv groups of {G}: rel err at rank 16, 64, 128:", " ".join(f"{v:.3f}" for v in row), flush=True)
