"""The prompt of the kvpress comparison, written from the veloxquant (MLX) side.

Runs in veloxquant's own environment (it imports mlx). Writes `tests/kvpress_reference/prompt.json`: the token ids of
one window of the evaluation text (`veloxquant.models.eval_tokens`, no special tokens), the default model's folder,
and, with `--logits FILE.npy`, the float32 logits mlx-lm gives for the first `--logit-tokens` of them (one forward
pass, no cache compression), so that `scripts/kvpress_reference.py --check-logits FILE.npy` can check that the
PyTorch/transformers model in the kvpress environment computes the same function.

Usage: python scripts/kvpress_prompt.py [--tokens 512] [--offset 0] [--out tests/kvpress_reference/prompt.json]
                                        [--logits /tmp/mlx_logits.npy] [--logit-tokens 64]
"""
import argparse
import json
from pathlib import Path

import numpy as np

import veloxquant.models as models


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/kvpress_reference/prompt.json"))
    ap.add_argument("--logits", default=None, help="also write mlx-lm's float32 logits of the first tokens (.npy)")
    ap.add_argument("--logit-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    model, tokenizer = models.load_model()
    ids = models.eval_tokens(tokenizer, a.tokens, a.offset)
    out = {"source": f"veloxquant.models.eval_tokens(tokenizer, {a.tokens}, offset={a.offset}) (split 'eval')",
           "model_path": str(models.default_model_path()), "token_ids": ids,
           "text_head": tokenizer.decode(ids[:40])}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({k: v for k, v in out.items() if k != "token_ids"}, indent=1)[:-2]
    Path(a.out).write_text(text + ',\n "token_ids": ' + json.dumps(ids) + "\n}\n")
    print(f"wrote {a.out}: {len(ids)} tokens from {out['model_path']}")
    if a.logits:
        import mlx.core as mx
        logits = model(mx.array([ids[:a.logit_tokens]]))
        np.save(a.logits, np.array(logits[0].astype(mx.float32)))
        print(f"wrote {a.logits}: logits {tuple(logits.shape)}")


if __name__ == "__main__":
    main()
