"""Greedy continuations of one real prompt under eviction methods, through stock `mlx_lm.generate` (fluency check).

For each method spec: caches built for the default model, the prompt (all but its last token) prefilled, the caches'
own prompt passes run (`veloxquant.evict.prompt_passes`, e.g. KVzip's reconstruction), then `mlx_lm.generate` from the
last prompt token with those caches as `prompt_cache`, greedy. Writes JSON {spec: {"text", "held_tokens_layer0"}}.

  python scripts/generate_samples.py OUT.json --specs "fp16;morphkv:budget=0.5" [--context 1024] [--tokens 48]
"""
import argparse, json
import mlx.core as mx
import mlx_lm
import veloxquant as vq
import veloxquant.evict as evict
import veloxquant.models as models
from veloxquant.core import parse_method

ap = argparse.ArgumentParser()
ap.add_argument("out"); ap.add_argument("--specs", required=True)
ap.add_argument("--context", type=int, default=1024); ap.add_argument("--tokens", type=int, default=48)
a = ap.parse_args()
model, tok = models.load_model()
ids = models.eval_tokens(tok, a.context)
out = {}
for spec in a.specs.split(";"):
    caches = vq.KVCacheBuilder.for_model(model, parse_method(spec))
    for s in range(0, len(ids) - 1, 512):
        model(mx.array(ids[s:min(s + 512, len(ids) - 1)])[None], cache=caches); mx.eval([c.state for c in caches])
    evict.prompt_passes(model, caches, ids[:-1], tok)
    text = mlx_lm.generate(model, tok, prompt=ids[-1:], max_tokens=a.tokens, prompt_cache=caches, verbose=False)
    held = caches[0].kept_positions() if hasattr(caches[0], "kept_positions") else None
    out[spec] = {"text": text, "held_tokens_layer0": [len(h) for h in held[0]] if held else None,
                 "prompt_tail": tok.decode(ids[-40:])}
    print(spec, repr(text), flush=True)
json.dump(out, open(a.out, "w"), indent=1)
