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


def test_methods_with_a_prompt_pass_are_refused_by_generate():
    from veloxquant.cli import prompt_pass_refusal
    assert "pass of its own" in prompt_pass_refusal(vq.parse_method("kvzip:budget=0.5"))
    assert prompt_pass_refusal(vq.KVCacheConfig("affine")) is None and prompt_pass_refusal(vq.parse_method("snapkv:budget=0.5")) is None
