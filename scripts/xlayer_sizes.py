"""Sizes of the cross-layer and entropy-coded caches on a real model: resident bytes (`nbytes`) per layer and in total,
and the bytes of the file `save_prompt_cache` writes, after one prompt of real text and one decode step.

    python scripts/xlayer_sizes.py [--model gemma3-270m] [--tokens 1024] --methods "cachegen;xquant" --out nbs/x.json
"""
import argparse, json, os, tempfile
import mlx.core as mx
from mlx_lm.models.cache import save_prompt_cache, KVCache
import veloxquant as vq
from veloxquant.core import parse_method
from veloxquant.group import layer_report
from veloxquant.models import load_model, eval_tokens, with_bos

p = argparse.ArgumentParser()
p.add_argument("--model", default=None); p.add_argument("--tokens", type=int, default=1024)
p.add_argument("--methods", default="fp16;affine:key_bits=4,value_bits=4;cachegen"); p.add_argument("--out", default=None)
a = p.parse_args()
model, tok = load_model(a.model)
ids = with_bos(tok, eval_tokens(tok, a.tokens + 1))
rows = []
for spec in [s for s in a.methods.split(";") if s.strip()]:
    cfg = parse_method(spec)
    caches = vq.KVCacheBuilder.for_model(model, cfg)
    model(mx.array(ids[:a.tokens])[None], cache=caches)
    model(mx.array(ids[a.tokens:a.tokens + 1])[None], cache=caches)  # one decode step: blocks that left the window become codes
    mx.eval([c.state for c in caches])
    rep = vq.cache_report(caches)
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "c.safetensors"); save_prompt_cache(f, caches); saved = os.path.getsize(f)
    fp16 = rep["elements"] * 2
    rows.append(dict(spec=spec, tokens=a.tokens + 1, resident_bytes=rep["nbytes"], saved_file_bytes=saved, fp16_bytes=fp16,
                     resident_bits_per_element=rep["bits_per_element"], saved_bits_per_element=8 * saved / rep["elements"],
                     layers=[{k: r[k] for k in ("layer", "nbytes", "shared_bytes", "bits_per_element")} for r in layer_report(caches)]))
    print(f"{spec:55s} resident {rep['nbytes']:>10,d} B ({rep['bits_per_element']:.2f} bits/elt)  saved file {saved:>10,d} B "
          f"({8 * saved / rep['elements']:.2f} bits/elt)  fp16 {fp16:,d} B", flush=True)
if a.out:
    with open(a.out, "w") as f: json.dump(dict(model=str(a.model or "SmolLM2-135M-Instruct"), rows=rows), f, indent=1)
