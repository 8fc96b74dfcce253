"""Small user-facing errors of the command line and the API: one clear line, a non-zero exit, nothing half-done."""
import pytest
from veloxquant.cli import main, draft_model_refusal
from veloxquant.core import cache_report, parse_method


def test_version(capsys):
    with pytest.raises(SystemExit) as e: main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("veloxquant ")


def test_benchmark_with_nothing_to_run_is_an_error(capsys):
    with pytest.raises(SystemExit) as e: main(["benchmark", "--skip-decode"])
    assert e.value.code == 2 and "nothing to run" in capsys.readouterr().err


def test_cache_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    f = tmp_path / "a_file"; f.write_text("x")
    monkeypatch.setenv("VELOXQUANT_CACHE", str(f))
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "VELOXQUANT_CACHE" in err and "not a directory" in err and "Traceback" not in err


def test_cache_report_refuses_what_is_not_a_list_of_caches():
    for bad in (None, [1], "affine"):
        with pytest.raises(ValueError, match="must be a list of per-layer caches"): cache_report(bad)
    r = cache_report([parse_method("affine").make_cache()])  # fresh caches: nothing stored, NaN bits
    assert r["nbytes"] >= 0 and r["elements"] == 0


def test_draft_refusal_names_the_method_once():
    msg = draft_model_refusal(parse_method("snapkv"), ["--draft-model", "x"])
    assert msg is not None and "'snapkv'" in msg and "''" not in msg


def test_eval_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--methods", "fp16", "--tasks", "kl", "--context", "256", "--scored", "250", "--no-charts", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--scored=250" in err and "n_scored" not in err


def test_benchmark_layer_depth_messages(capsys):
    with pytest.raises(SystemExit) as e: main(["benchmark", "--layer-depth", "1.5"])
    assert e.value.code == 2 and "expected an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e: main(["benchmark", "--skip-decode", "--layer-depth", "4"])  # nothing to run, said first
    out = capsys.readouterr()
    assert e.value.code == 2 and "applies to --layer only" in out.out and "nothing to run" in out.err


def test_usage_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e: main([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "{demo,generate,benchmark,serve,precompute,calibrate,eval}" in err
