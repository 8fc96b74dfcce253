"""Behaviour did not change: every method at its standard settings (and the EXTRA settings of tests/golden.py)
computes bit for bit what was recorded in tests/golden/ (greedy tokens through stock mlx_lm.stream_generate,
the float32 logits of 256 decode steps on the default model, and a saved prompt cache of the recording commit
loaded and continued). Re-record with `python tests/golden.py record` only when a change of behaviour is meant."""
import json
import pytest
import golden

CASES = sorted(p.stem for p in golden.GOLDEN.glob("*.json"))


def test_every_configuration_has_a_recording():
    assert {n for n, _, _ in golden.configs()} <= set(CASES)


@pytest.fixture(scope="module")
def real_model():
    from veloxquant.models import load_model, eval_tokens
    model, tokenizer = load_model()
    return model, tokenizer, eval_tokens(tokenizer, golden.PROMPT_TOKENS + golden.DECODE_STEPS)


@pytest.mark.parametrize("name", CASES)
def test_golden(name, real_model):
    model, tokenizer, tokens = real_model
    rec = json.loads((golden.GOLDEN / f"{name}.json").read_text())
    mid, opts = rec["method"], rec["options"]
    assert golden.saved_cache_record(name, mid, opts, write=False) == rec["saved_cache"], "a saved cache of the recording commit continues differently"
    assert golden.generate_record(model, tokenizer, mid, opts) == rec["generate"]
    got = golden.decode_record(model, tokens, mid, opts)
    if got["sha256"] != rec["decode"]["sha256"]:
        first = next((i for i, (a, b) in enumerate(zip(got["max_logit"], rec["decode"]["max_logit"])) if a != b), None)
        pytest.fail(f"{name}: decode logits differ from the recording (first differing max logit at step {first})")
