"""Behaviour did not change: every method at its standard settings (and the EXTRA settings of tests/golden.py)
computes what was recorded in tests/golden/ (greedy tokens through stock mlx_lm.stream_generate, the float32 logits
of 256 decode steps on the default model, and a saved prompt cache of the recording commit loaded and continued).

Bit for bit on a kind of machine that has a recording. Float32 results are not bit-identical across CPU kinds
(OpenBLAS and MLX pick other kernels on, e.g., AMD Zen 4 and Zen 5: fp16's logits move by ~4e-5, and a moved rounding
boundary flips quantization codes, which moves a quantizing method's logits by up to ~0.1, and far more for settings
that are themselves far from fp16, such as qjl's 1-bit keys). So each recording holds the primary bits and, under
`machines`, those of other kinds of machine for the same code (`python tests/golden.py record-machine`): on a kind
that has its own entry the check is bit for bit. On a kind with none, where the primary bits differ, it falls back
to tolerances scaled by each setting's own distance from fp16 (`_tolerances`), the saved cache's logits close to
`saved_cache_logits`, and the first `GEN_PREFIX` greedy tokens equal, and warns. Re-record with
`python tests/golden.py record` only when a change of behaviour is meant."""
import json
import warnings
import numpy as np
import pytest
import golden

CASES = sorted(p.stem for p in golden.GOLDEN.glob("*.json"))
GEN_PREFIX, SAVED_RTOL = 12, 0.02


def test_every_configuration_has_a_recording():
    assert {n for n, _, _ in golden.configs()} <= set(CASES)


@pytest.fixture(scope="module")
def real_model():
    from veloxquant.models import load_model, eval_tokens
    model, tokenizer = load_model()
    return model, tokenizer, eval_tokens(tokenizer, golden.PROMPT_TOKENS + golden.DECODE_STEPS)


def _tolerances(rec) -> tuple[float, float, int]:
    """(max, mean |diff| of the per-step max logit, argmaxes allowed to move) for a machine without its own bits: 4× / 0.6×
    the setting's own mean distance from fp16's recording and its own argmax disagreement with fp16, with floors for float noise."""
    fp = json.loads((golden.GOLDEN / "fp16-0.json").read_text())["decode"]
    own = np.abs(np.array(rec["decode"]["max_logit"]) - np.array(fp["max_logit"])).mean()
    moved = sum(a != b for a, b in zip(rec["decode"]["argmax"], fp["argmax"]))
    return max(0.5, 4 * own), max(0.02, 0.6 * own), max(3, moved)


@pytest.mark.parametrize("name", CASES)
def test_golden(name, real_model):
    model, tokenizer, tokens = real_model
    rec = json.loads((golden.GOLDEN / f"{name}.json").read_text())
    mid, opts, fp = rec["method"], rec["options"], golden.machine()
    mine = rec.get("machines", {}).get(fp)  # this kind of machine's own bits: checked bit for bit
    want = dict(generate=rec["generate"], decode_sha256=rec["decode"]["sha256"], saved_cache=rec["saved_cache"]) | (mine or {})
    lg = np.asarray(golden.saved_cache_logits(name, mid, opts))
    gen = golden.generate_record(model, tokenizer, mid, opts)
    got = golden.decode_record(model, tokens, mid, opts)
    bits = dict(saved_cache=golden._sha(golden.mx.array(lg)), generate=gen, decode_sha256=got["sha256"])
    if mine is not None or all(bits[k] == want[k] for k in bits):
        assert bits["saved_cache"] == want["saved_cache"], f"{name}: a saved cache of the recording commit continues differently"
        assert bits["generate"] == want["generate"], f"{name}: greedy tokens differ: {gen} vs {want['generate']}"
        if bits["decode_sha256"] != want["decode_sha256"]:
            first = next((i for i, (a, b) in enumerate(zip(got["max_logit"], rec["decode"]["max_logit"])) if a != b), None)
            pytest.fail(f"{name}: decode logits differ from the recording (first differing max logit at step {first})")
        return
    # a kind of machine without its own recording: tolerances
    notes = []
    if bits["saved_cache"] != want["saved_cache"]:
        ref = np.asarray(rec["saved_cache_logits"], np.float32)
        scale = max(1.0, float(np.abs(ref).max()))
        assert np.abs(lg - ref).max() <= SAVED_RTOL * scale and lg.argmax() == ref.argmax(), \
            f"{name}: a saved cache of the recording commit continues differently (max |diff| {np.abs(lg - ref).max():.4f})"
        notes.append("saved cache")
    if gen != want["generate"]:
        n = next(i for i, (a, b) in enumerate(zip(gen + [None], want["generate"] + [None])) if a != b)
        assert n >= GEN_PREFIX, f"{name}: greedy tokens part from the recording at token {n}: {gen} vs {want['generate']}"
        notes.append(f"greedy tokens from token {n}")
    if got["sha256"] != want["decode_sha256"]:
        tmax, tmean, tmoved = _tolerances(rec)
        d = np.abs(np.array(got["max_logit"]) - np.array(rec["decode"]["max_logit"]))
        moved = sum(a != b for a, b in zip(got["argmax"], rec["decode"]["argmax"]))
        assert d.max() <= tmax and d.mean() <= tmean and moved <= tmoved, \
            (f"{name}: decode logits differ from the recording beyond this setting's float noise: max-logit |diff| max "
             f"{d.max():.4f} (allowed {tmax:.3f}), mean {d.mean():.5f} (allowed {tmean:.4f}); {moved} argmaxes moved (allowed {tmoved})")
        notes.append(f"decode (max-logit |diff| max {d.max():.4f}, mean {d.mean():.5f}, {moved} argmaxes moved)")
    warnings.warn(f"{name}: no recording for this kind of machine ({fp}); within tolerance: {'; '.join(notes)}. "
                  "Add one with `python tests/golden.py record-machine` on code that passes here.")
