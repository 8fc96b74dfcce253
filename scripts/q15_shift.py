"""Out-of-sample check of the Fisher error estimate: codecs fitted on the calibration window (kvquant's artifact rule on
q15_collect.py's calib samples) applied to a window of the *evaluation* text (its own Fisher information), against
the same estimate in sample. Data-adaptive codecs (KIVI's per-group ranges) need no fit. Writes a JSON."""
import sys, json, numpy as np, mlx.core as mx
from types import SimpleNamespace as NS
import veloxquant.methods.kvquant as kq
from veloxquant.channel import ChannelCodec
from veloxquant.methods.affine import AffineCodec
cal, ev = np.load(sys.argv[1]), np.load(sys.argv[2]); out = sys.argv[3]
L = 30
get = lambda S, i: {k: S[f"{i}/{k}"] for k in ("keys", "values", "pre_rope_keys", "key_fisher", "value_fisher", "pre_rope_key_fisher")}
C = [get(cal, i) for i in range(L)]; E = [get(ev, i) for i in range(L)]
def dl(x, xh, f, sinks=1): return float(0.5 * ((x - xh) ** 2 * f)[:, sinks:].sum() / (x.shape[1] - 1))
def rt(codec, x, dt=mx.float16): return np.array(codec.decode(codec.encode(mx.array(x)[None].astype(dt)))[0].astype(mx.float32))
rows = []
for kb, ko in [(3, 1), (4, 1), (4, 0)]:
    t = kq.kvquant_calibration(C, NS(key_bits=kb, value_bits=3, key_outliers=ko, value_outliers=0, fisher=True, qnorm=True))
    for name, S in (("calib (in sample)", C), ("eval (out of sample)", E)):
        tot = sum(dl(s["pre_rope_keys"], rt(kq.KVQuantKeyCodec(64, kb, ko, t[f"layer{i}/key_center"], t[f"layer{i}/key_radius"], t[f"layer{i}/key_levels"]), s["pre_rope_keys"], mx.float32), s["pre_rope_key_fisher"]) for i, s in enumerate(S))
        rows.append(dict(codec=f"kvquant keys k{kb} ko{ko}", text=name, dl=tot))
    for name, S in (("calib (in sample)", C), ("eval (out of sample)", E)):
        tot = sum(dl(s["values"], rt(kq.KVQuantValueCodec(64, 3, 0, t[f"layer{i}/value_levels"]), s["values"]), s["value_fisher"]) for i, s in enumerate(S))
        rows.append(dict(codec=f"kvquant values v3 vo0 (with k{kb} ko{ko} artifact)", text=name, dl=tot))
for kb in (3, 4):
    for name, S in (("calib (in sample)", C), ("eval (out of sample)", E)):
        rows.append(dict(codec=f"kivi keys k{kb} g128", text=name, dl=sum(dl(s["keys"], rt(ChannelCodec(64, kb, 128), s["keys"]), s["key_fisher"]) for s in S)))
for name, S in (("calib (in sample)", C), ("eval (out of sample)", E)):
    rows.append(dict(codec="kivi values v3 vg64", text=name, dl=sum(dl(s["values"], rt(AffineCodec(64, 3, 64), s["values"]), s["value_fisher"]) for s in S)))
for r in rows: print(f"{r['codec']:48s} {r['text']:22s} {r['dl']:.4f}", flush=True)
json.dump(dict(calib_tokens=int(C[0]["keys"].shape[1]), eval_tokens=int(E[0]["keys"].shape[1]), sinks=1, rows=rows), open(out, "w"), indent=1)
