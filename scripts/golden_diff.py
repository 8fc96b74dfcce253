"""How far the current code's decode logits are from the recorded golden ones (tests/golden/<name>.json), per case:
sha equal?, argmax agreement over the 256 teacher-forced steps, largest |Δ| of the per-step max logit.

    LD_PRELOAD=<openblas> PYTHONPATH=. python scripts/golden_diff.py affine-0 turboquant-0 qjl-0
"""
import json, sys
sys.path.insert(0, "tests")
import golden
from veloxquant.models import load_model, eval_tokens
model, tok = load_model(None)
tokens = eval_tokens(tok, golden.PROMPT_TOKENS + golden.DECODE_STEPS)
out = {}
for name in sys.argv[1:]:
    rec = json.loads((golden.GOLDEN / f"{name}.json").read_text())
    got = golden.decode_record(model, tokens, rec["method"], rec["options"])
    r = rec["decode"]
    same_argmax = sum(a == b for a, b in zip(got["argmax"], r["argmax"]))
    dmax = max(abs(a - b) for a, b in zip(got["max_logit"], r["max_logit"]))
    out[name] = dict(sha_equal=got["sha256"] == r["sha256"], argmax_equal=f"{same_argmax}/{len(r['argmax'])}", max_logit_max_abs_diff=dmax)
    print(name, out[name], flush=True)
