"""Tests of veloxquant.eval (the evaluation harness) on the real default model (SmolLM2-135M-Instruct)
and real Wikipedia text, at small sizes so they run in well under two minutes on a 2-core CPU."""
import importlib.util, json, subprocess, sys

import numpy as np
import pytest

from veloxquant.core import KVCacheConfig, method_ids
from veloxquant import eval as ve

N_CTX, N_SCORED, CHUNK, PROBE = 256, 24, 4, 3


@pytest.fixture(scope="module")
def ref(real):
    model, _, toks = real
    return ve.fp16_reference(model, toks[:N_CTX], N_SCORED, chunk=CHUNK, attn_probe=PROBE)


def test_fp16_is_exact(real, ref):
    "An independent fp16 run: ΔPPL = 0, KL = 0 and 100 % top-1 exactly; attention fidelity exactly 0 in every layer."
    model, _, toks = real
    run = ve.decode_run(model, KVCacheConfig("fp16"), toks[:N_CTX], N_SCORED, chunk=CHUNK, attn_probe=PROBE)
    q = ve.compare_to_reference(ref, run)
    assert (q["delta_ppl_pct"], q["kl_mean"], q["kl_p99"], q["top1_agreement"]) == (0.0, 0.0, 0.0, 1.0)
    assert q["ppl"] == ref.ppl and 5 < ref.ppl < 100
    assert len(run["attn"]) == len(model.layers)
    assert all(a["out_rel_err"] == 0.0 and a["score_rel_err"] == 0.0 for a in run["attn"])
    assert run["logprobs"].shape == (N_SCORED, 49152)
    rep = run["report"]
    assert rep["nbytes"] == sum(run["layer_nbytes"]) and rep["bits_per_element"] >= 32  # float32 buffer on CPU
    assert run["prefill_tps"] > 0 and run["scoring_tps"] > 0 and np.isnan(run["decode_tps"]) and run["peak_memory_mb"] > run["kv_peak_mb"] > 0


def test_affine_kl_ordering(real, ref):
    "On the real model: KL and attention error grow as affine goes 8 → 4 → 2 bits; sizes shrink."
    model, _, toks = real
    res = {}
    for b in (8, 4, 2):
        run = ve.decode_run(model, KVCacheConfig("affine", key_bits=b, value_bits=b), toks[:N_CTX], N_SCORED,
                            chunk=CHUNK, attn_probe=PROBE)
        res[b] = (ve.compare_to_reference(ref, run), run)
    kl = {b: r[0]["kl_mean"] for b, r in res.items()}
    assert 0 < kl[8] < kl[4] < kl[2], kl
    err = {b: np.mean([a["out_rel_err"] for a in r[1]["attn"]]) for b, r in res.items()}
    assert 0 < err[8] < err[4] < err[2], err
    bits = {b: r[1]["report"]["bits_per_element"] for b, r in res.items()}
    assert bits[8] > bits[4] > bits[2], bits
    assert res[8][0]["top1_agreement"] >= res[2][0]["top1_agreement"]


def test_compare_refuses_different_windows(real, ref):
    model, _, toks = real
    run = dict(ref.run, logprobs=ref.run["logprobs"][:-1])
    with pytest.raises(ValueError, match="not the same tokens"):
        ve.compare_to_reference(ref, run)
    with pytest.raises(ValueError, match="n_scored=0"):
        ve.decode_run(model, KVCacheConfig("fp16"), toks[:32], 0)


@pytest.mark.parametrize("answer,expected,ok", [
    ("The secret passcode is 4821.", "4821", True),
    (" 4821", "4821", True),
    ("4821\n", "4821", True),
    ("48210", "4821", False),               # inside a longer number
    ("14821", "4821", False),
    ("The passcode is 482", "4821", False),
    ("I don't know the passcode.", "4821", False),
    ("", "4821", False),
    ("  The Blue\n house", "blue house", True),
])
def test_niah_score(answer, expected, ok):
    assert ve.niah_score(answer, expected) is ok


def test_niah_score_refuses_empty():
    with pytest.raises(ValueError, match="non-empty"):
        ve.niah_score("anything", "  ")


def test_niah_prompt(real):
    _, tok, _ = real
    for depth in (0.1, 0.9):
        ids, actual = ve.niah_prompt(tok, 300, depth, "7312")
        text = tok.decode(ids)
        assert abs(len(ids) - 300) <= 8 and abs(actual - depth) < 0.15
        assert "The secret passcode is 7312." in text and text.rstrip().endswith(ve.NIAH_ANSWER_PREFIX)
        assert "<|im_start|>user" in text and "<|im_start|>assistant" in text
    with pytest.raises(ValueError, match="length=40"):
        ve.niah_prompt(tok, 40, 0.5, "1")
    with pytest.raises(ValueError, match="depth=1.5"):
        ve.niah_prompt(tok, 300, 1.5, "1")


def test_registry_drives_standard_configs():
    cfgs = ve.standard_configs()
    assert {c.method for c in cfgs} == set(method_ids()) and cfgs[0] == KVCacheConfig("fp16")
    assert len({c.to_json() for c in cfgs}) == len(cfgs)
    assert ve.parse_tasks("ppl, kl") == ("ppl", "kl")
    with pytest.raises(ValueError, match="allowed tasks"):
        ve.parse_tasks("ppl,rouge")


def test_pareto_front():
    assert ve.pareto_front([(32, 0.0), (4.5, 7.0), (8.5, -0.2), (2.5, 1700.0), (4.6, 9.0)]) == [3, 1, 2]
    assert ve.pareto_front([]) == []


def test_cli_eval_end_to_end(tmp_path):
    "`veloxquant eval` at a tiny size: table on stdout, JSON with both records, charts next to it."
    charts = all(importlib.util.find_spec(m) for m in ("altair", "vl_convert"))
    out = tmp_path / "res" / "results.json"
    cmd = [sys.executable, "-c", "from veloxquant.cli import main; main()", "eval",
           "--methods", "fp16;affine:key_bits=4,value_bits=4,window=0", "--tasks", "ppl,kl,niah,attn", "--context", "160",
           "--scored", "8", "--niah-lengths", "160", "--niah-depths", "0.5", "--out", str(out)] + ([] if charts else ["--no-charts"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "affine k4 v4" in r.stdout and "ΔPPL" in r.stdout
    d = json.loads(out.read_text())
    recs = d["records"]
    assert [x["label"] for x in recs] == ["fp16", "affine k4 v4 w0"] and d["meta"]["context"] == 160
    assert recs[0]["delta_ppl_pct"] == 0 and recs[0]["kl_mean"] == 0 and recs[0]["top1_agreement"] == 1
    assert recs[0]["attn_out_err"] == 0 and recs[1]["kl_mean"] > 0 and recs[1]["bits_per_element"] < 8
    assert len(recs[1]["niah"]) == 1 and isinstance(recs[1]["niah"][0]["correct"], bool)
    if charts:
        for name in ("pareto", "niah"):
            for ext in ("html", "png"):
                assert (out.parent / f"results_{name}.{ext}").stat().st_size > 1000
            page = (out.parent / f"results_{name}.html").read_text()
            assert "vegaEmbed" in page and "<script src=" not in page and 'src="http' not in page  # offline: no CDN
    bad = subprocess.run(cmd[:4] + ["--methods", "affine:key_bits=9", "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "key_bits=9" in bad.stderr


def test_refused_config_is_a_row_not_the_end(real, tmp_path):
    "A config the builder refuses (here: a calibrated method pointed at a missing artifact) is recorded as refused; the rest run."
    model, tok, _ = real
    bad = KVCacheConfig("spectral", path=str(tmp_path / "missing.safetensors"))
    recs = ve.evaluate(model, tok, [bad, KVCacheConfig("affine")], tasks=("ppl",), context=96, n_scored=8, progress=False)
    assert [("refused" in r) for r in recs] == [True, False]
    assert "missing.safetensors" in recs[0]["refused"] and "ppl" not in recs[0] and recs[1]["ppl"] > 1
    table = ve.results_table(recs)
    assert "refused at build time: spectral" in table and table.count("\n") >= 3


def test_niah_runs_prompt_passes(real, recwarn):
    "KVzip's caches in the NIAH task are prefilled and passed by the harness before generation (no 'kept whole' warning)."
    from veloxquant.eval import niah
    model, tok, _ = real
    from veloxquant.core import parse_method
    rows = niah(model, tok, parse_method("kvzip:budget=0.5"), lengths=(256,), depths=(0.5,), max_tokens=2)
    assert len(rows) == 1 and abs(rows[0]["prompt_tokens"] - 256) <= 8
    assert not [w for w in recwarn if "kept whole" in str(w.message)]
