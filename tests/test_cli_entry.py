"""`veloxquant generate --prompt-cache-file` refuses files of mlx-lm's own caches; `python -m veloxquant.cli` runs the CLI."""
import subprocess, sys
import mlx.core as mx
from mlx_lm.models.cache import KVCache, save_prompt_cache
import veloxquant as vq
from veloxquant.cli import prompt_cache_file_refusal


def _filled(c):
    c.update_and_fetch(mx.ones((1, 2, 5, 64), mx.float16), mx.ones((1, 2, 5, 64), mx.float16))
    return c


def test_stock_prompt_cache_file_is_refused(tmp_path):
    stock, ours = tmp_path / "stock.safetensors", tmp_path / "ours.safetensors"
    save_prompt_cache(str(stock), [_filled(KVCache()) for _ in range(2)])
    save_prompt_cache(str(ours), [_filled(vq.KVCacheConfig("affine").make_cache()) for _ in range(2)])
    assert "uncompressed caches (KVCache)" in prompt_cache_file_refusal(["--prompt-cache-file", str(stock), "--prompt", "x"])
    assert "uncompressed" in prompt_cache_file_refusal([f"--prompt-cache-file={stock}"])
    assert prompt_cache_file_refusal(["--prompt-cache-file", str(ours)]) is None
    assert "cannot load it" in prompt_cache_file_refusal(["--prompt-cache-file", str(tmp_path / "nope.safetensors")])
    assert prompt_cache_file_refusal(["--prompt", "x"]) is None


def test_generate_cli_refuses_before_loading_the_model(tmp_path):
    stock = tmp_path / "stock.safetensors"
    save_prompt_cache(str(stock), [_filled(KVCache())])
    r = subprocess.run([sys.executable, "-m", "veloxquant.cli", "generate", "--prompt-cache-file", str(stock), "--prompt", "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "uncompressed caches" in r.stderr


def test_python_m_cli_help():
    r = subprocess.run([sys.executable, "-m", "veloxquant.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage: veloxquant" in r.stdout


def test_prompt_cache_file_abbreviated_repeated_or_other_method(tmp_path):
    stock, ours = tmp_path / "stock.safetensors", tmp_path / "ours.safetensors"
    save_prompt_cache(str(stock), [_filled(KVCache()) for _ in range(2)])
    save_prompt_cache(str(ours), [_filled(vq.KVCacheConfig("affine").make_cache()) for _ in range(2)])
    affine, turbo = vq.KVCacheConfig("affine"), vq.KVCacheConfig("turboquant")
    for flag in ("--prompt-cache", "--prompt-cache-f", "--prompt-c"):   # argparse's abbreviations
        assert "uncompressed" in prompt_cache_file_refusal([flag, str(stock)], affine)
    assert "uncompressed" in prompt_cache_file_refusal(["--prompt-cache-file", str(ours), "--prompt-cache-file", str(stock)], affine)
    assert prompt_cache_file_refusal(["--prompt-cache-file", str(ours)], affine) is None
    assert "not of --method" in prompt_cache_file_refusal(["--prompt-cache-file", str(ours)], turbo)
    assert prompt_cache_file_refusal(["--prompt-cache-file", str(stock)], vq.KVCacheConfig("fp16")) is None  # fp16: nothing to compress


def test_methods_with_a_prompt_pass_are_refused_only_with_a_saved_prompt_cache_or_a_draft_model():
    from veloxquant.cli import prompt_pass_refusal
    kz = vq.parse_method("kvzip:budget=0.5")
    assert prompt_pass_refusal(kz) is None and prompt_pass_refusal(kz, ["--prompt", "x", "--max-tokens", "4"]) is None
    assert "--prompt-cache-file" in prompt_pass_refusal(kz, ["--prompt-cache-file", "p.safetensors"])
    assert "--prompt-c" in prompt_pass_refusal(kz, ["--prompt-c=p.safetensors"])
    assert "--draft-model" in prompt_pass_refusal(kz, ["--draft-model", "m"])
    assert prompt_pass_refusal(vq.KVCacheConfig("affine"), ["--prompt-cache-file", "p"]) is None
    assert prompt_pass_refusal(vq.parse_method("snapkv:budget=0.5"), ["--draft-model", "m"]) is None


def test_generate_runs_kvzip_prompt_pass_before_the_first_token(real, monkeypatch, recwarn):
    "Stock mlx-lm generation with the wrapped generate_step: KVzip's caches are zipped, no 'kept whole' warning."
    import importlib, mlx_lm
    g = importlib.import_module("mlx_lm.generate")  # the module (the package re-exports a function of that name)
    from veloxquant.cli import with_prompt_passes
    model, tok, toks = real
    monkeypatch.setattr(g, "generate_step", with_prompt_passes(g.generate_step, tok))
    caches = vq.KVCacheBuilder.for_model(model, vq.parse_method("kvzip:budget=0.5"))
    out = mlx_lm.generate(model, tok, toks[:200], max_tokens=3, prompt_cache=caches, verbose=False)
    assert isinstance(out, str)
    assert not [w for w in recwarn if "kept whole" in str(w.message)]
    assert all(c.zipped and c.offset >= 201 for c in caches)
    kept = [len([p for p in head if p < 199]) for c in caches for head in c.kept_positions()[0]]
    assert 0.45 * 199 * len(kept) <= sum(kept) <= 0.5 * 199 * len(kept) + len(kept)  # half of the 199 passed tokens, pooled over layers and heads
