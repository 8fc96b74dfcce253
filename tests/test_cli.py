"""The command line, end to end on the real default model (small sizes)."""
import json, os, subprocess, sys

import pytest

from veloxquant.core import parse_method


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-c", "import sys; from veloxquant.cli import main; main(sys.argv[1:])", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_demo_small(tmp_path):
    out = tmp_path / "demo.json"
    r = run("demo", "--method", "affine:key_bits=8,value_bits=8", "--prompt-tokens", "300", "--max-tokens", "4",
            "--heldout-tokens", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "held-out ppl" in r.stdout and "affine key_bits=8" in r.stdout
    rows = json.loads(out.read_text())
    assert [r_["method"] for r_ in rows] == ["fp16", "affine"]
    fp16, aff = rows
    assert fp16["prompt_tokens"] == aff["prompt_tokens"] == 300
    assert aff["kv_bytes"] < fp16["kv_bytes"] and aff["bits_per_element"] < 16
    assert abs(aff["heldout_ppl"] / fp16["heldout_ppl"] - 1) < 0.05  # 8-bit: nearly unchanged


def test_demo_bad_method_is_a_clear_error():
    r = run("demo", "--method", "affine:key_bits=7")
    assert r.returncode == 2 and "key_bits=7 is not allowed" in r.stderr


def test_generate_with_method():
    r = run("generate", "--method", "affine:key_bits=8,value_bits=8", "--prompt", "What is the capital of France?",
            "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_help_is_veloxquants():
    "`veloxquant generate --help`: veloxquant's default model, --method, and mlx-lm's KV flags hidden and named as refused."
    r = run("generate", "--help")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "usage: veloxquant generate" in text and "SmolLM2-135M-Instruct" in text and "--method" in text
    assert "Llama-3.2" not in text and "If no model is specified" not in text
    options, _, epilog = text.partition("Refused")
    for flag in ("--kv-bits", "--kv-group-size", "--quantized-kv-start", "--max-kv-size"):
        assert flag not in options and flag in epilog


def test_generate_refuses_an_unservable_model(tmp_path):
    "A model family veloxquant cannot serve: a clear error and exit status 2 before any token (no traceback)."
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma2
    cfg = dict(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
               head_dim=32, rms_norm_eps=1e-5, vocab_size=300, num_key_value_heads=1)
    model = gemma2.Model(gemma2.ModelArgs(**cfg))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from veloxquant.models import default_model_path
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = default_model_path() / f
        if src.exists(): (tmp_path / f).write_text(src.read_text())
    r = run("generate", "--model", str(tmp_path), "--prompt", "hello", "--max-tokens", "4")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "veloxquant generate: error: veloxquant cannot serve model family 'mlx_lm.models.gemma2'" in r.stderr
    assert "Traceback" not in r.stderr


def test_parse_method_values():
    assert parse_method("fp16:reference=true").options.reference is True
    with pytest.raises(ValueError, match="unknown option"):
        parse_method("affine:bitz=3")


def test_benchmark_cli_exit_codes():
    "`veloxquant benchmark`: a tiny run exits 0 (no records dumped by sys.exit); malformed or out-of-range lists exit 2."
    import subprocess, sys
    run = lambda *a: subprocess.run([sys.executable, "-c", "import sys; from veloxquant.cli import main; sys.exit(main())", "benchmark", *a],
                                    capture_output=True, text=True, timeout=300)
    ok = run("--seq-lens", "64", "--batches", "1", "--head-dims", "64", "--repeats", "2")
    assert ok.returncode == 0 and "'decode'" not in ok.stderr, ok.stderr[-500:]
    for args, msg in ((["--seq-lens", "abc"], "expected comma-separated integers"), (["--batches", "0"], "out of range")):
        p = run(*args)
        assert p.returncode == 2 and msg in p.stderr, p.stderr[-500:]
