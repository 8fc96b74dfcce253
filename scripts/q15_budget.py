"""Fisher-weighted error budget (KVQuant's sensitivity, arXiv 2401.18079 §3.3, used as a loss estimate): for each
layer and for keys / values, dL ≈ ½ Σ F·(x − x̂)² / T over the calibration window collected by q15_collect.py,
for the per-channel family's codecs at several settings. The first `sinks` tokens are exact. Writes a JSON."""
import sys, json, itertools, numpy as np, mlx.core as mx
from types import SimpleNamespace as NS
import veloxquant.methods.kvquant as kq
from veloxquant.channel import ChannelCodec
from veloxquant.methods.affine import AffineCodec
from veloxquant.methods.kitty import KittyKeyCodec
S = np.load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/q15/samples.npz")
out = sys.argv[2] if len(sys.argv) > 2 else "nbs/quality15_fisher.json"
L = len({k.split("/")[0] for k in S.files})
T = S["0/keys"].shape[1]
def samp(i): return {k: S[f"{i}/{k}"] for k in ("keys", "values", "pre_rope_keys", "key_fisher", "value_fisher", "pre_rope_key_fisher")}
samples = [samp(i) for i in range(L)]
def dl(x, xh, f, sinks):
    e = (x - xh) ** 2 * f
    return float(0.5 * e[:, sinks:].sum() / (T - 1))
def roundtrip(codec, x):  # x [H, T, D] numpy → decoded numpy (whole groups only: T is a multiple of 128 here)
    blk = codec.encode(mx.array(x)[None].astype(mx.float16 if not isinstance(codec, (kq.KVQuantKeyCodec,)) else mx.float32))
    return np.array(codec.decode(blk)[0].astype(mx.float32))
res = {"tokens": T, "layers": L, "rows": []}
def add(kind, name, per_layer, bits):
    res["rows"].append(dict(kind=kind, codec=name, bits=bits, dl=per_layer, total=float(sum(per_layer))))
    print(f"{kind:5s} {name:34s} bits {bits:.3f} total dL {sum(per_layer):.4f}  max layer {int(np.argmax(per_layer))}", flush=True)
# kvquant keys / values (levels fitted in-sample, as the calibration does on its own text)
for kb, ko in [(2, 1), (3, 1), (4, 1), (3, 0), (2, 2)]:
    t = kq.kvquant_calibration(samples, NS(key_bits=kb, value_bits=2, key_outliers=ko, value_outliers=0, fisher=True, qnorm=True))
    for sinks in (1, 4):
        per = []
        for i, s in enumerate(samples):
            c = kq.KVQuantKeyCodec(64, kb, ko, t[f"layer{i}/key_center"], t[f"layer{i}/key_radius"], t[f"layer{i}/key_levels"])
            per.append(dl(s["pre_rope_keys"], roundtrip(c, s["pre_rope_keys"]), s["pre_rope_key_fisher"], sinks))
        add("key", f"kvquant k{kb} ko{ko} sinks{sinks}", per, kb + 24 * ko / 64)
for vb, vo in [(2, 0), (3, 0), (4, 0), (2, 1), (3, 1)]:
    t = kq.kvquant_calibration(samples, NS(key_bits=2, value_bits=vb, key_outliers=0, value_outliers=vo, fisher=True, qnorm=True))
    for sinks in (1, 4):
        per = []
        for i, s in enumerate(samples):
            c = kq.KVQuantValueCodec(64, vb, vo, t[f"layer{i}/value_levels"])
            per.append(dl(s["values"], roundtrip(c, s["values"]), s["value_fisher"], sinks))
        add("value", f"kvquant v{vb} vo{vo} sinks{sinks}", per, vb + (32 + 24 * vo) / 64)
# KIVI keys per channel (post-RoPE), values per token; Kitty keys
for kb, G in [(2, 128), (3, 128), (4, 128), (3, 64), (2, 32)]:
    for sinks in (0, 4):
        c = ChannelCodec(64, kb, G)
        per = [dl(s["keys"], roundtrip(c, s["keys"]), s["key_fisher"], sinks) for s in samples]
        add("key", f"kivi k{kb} g{G} sinks{sinks}", per, kb + 32 / G)
for boost in (8, 16):
    c = KittyKeyCodec(64, 128, boost)
    per = [dl(s["keys"], roundtrip(c, s["keys"]), s["key_fisher"], 4) for s in samples]
    add("key", f"kitty boost{boost} g128 sinks4", per, 2 + 2 * boost / 64 + (32 + 24 * boost / 64) / 128)
for vb, vg in [(2, 64), (3, 64), (4, 64), (2, 32)]:
    for sinks in (0, 4):
        c = AffineCodec(64, vb, vg)
        per = [dl(s["values"], roundtrip(c, s["values"]), s["value_fisher"], sinks) for s in samples]
        add("value", f"kivi v{vb} vg{vg} sinks{sinks}", per, vb + 32 / vg)
json.dump(res, open(out, "w"), indent=1); print("wrote", out)
