"""`benchmark_generate(rounds=N)`: the sweep runs N times with the specs in turn; each record gives medians over the
rounds, every round kept, and ratios taken per round against the stock run of the same round (no model is run here:
`_run_one` is replaced by a recorder returning set numbers)."""
import pytest
from veloxquant import bench


def _fake(monkeypatch, speeds):
    calls = []
    def run_one(model, spec, prompts, decode_tokens, warmup_tokens, prefill_step_size):
        i = sum(1 for c in calls if c[0] == spec and c[2] == decode_tokens)
        calls.append((spec, len(prompts[0]), decode_tokens))
        dec, pre, peak = speeds[spec][i % len(speeds[spec])] if decode_tokens == 5 else (1.0, 1.0, 1.0)
        return dict(method=spec, context=len(prompts[0]), batch=len(prompts), prefill_tps=pre, decode_tps=dec,
                    peak_memory_gb=peak, kv_bytes=1000 if spec == bench.STOCK else 250)
    monkeypatch.setattr(bench, "_run_one", run_one)
    monkeypatch.setattr(bench, "_generate_model", lambda model, n: (None, lambda ctx, B: [[1] * ctx] * B, "fake"))
    return calls


def test_rounds_medians_and_paired_ratios(monkeypatch):
    # stock lands in a slow mode in round 2; the method's per-round ratios are 1.2, 2.0, 1.1 -> median 1.2
    speeds = {bench.STOCK: [(100.0, 10.0, 5.0), (60.0, 10.0, 5.0), (100.0, 10.0, 5.2)],
              "affine:key_bits=4,value_bits=4": [(120.0, 5.0, 4.0), (120.0, 6.0, 4.1), (110.0, 7.0, 4.0)]}
    calls = _fake(monkeypatch, speeds)
    rows = bench.benchmark_generate(methods=tuple(speeds), contexts=(64,), decode_tokens=5, rounds=3, progress=False)
    timed = [c[0] for c in calls if c[2] == 5]
    assert timed == [bench.STOCK, "affine:key_bits=4,value_bits=4"] * 3  # the specs in turn, round after round
    st, af = rows
    assert len(rows) == 2 and st["decode_tps"] == 100.0 and st["decode_tps_runs"] == [100.0, 60.0, 100.0]
    assert af["decode_tps"] == 120.0 and af["decode_ratio_runs"] == pytest.approx([1.2, 2.0, 1.1])
    assert af["decode_ratio"] == pytest.approx(1.2) and af["prefill_ratio"] == pytest.approx(0.6)
    assert st["peak_memory_gb"] == 5.2 and af["peak_memory_gb"] == 4.1  # the largest of the rounds
    assert af["peak_target_gb"] == pytest.approx((5.2e9 - 0.7 * 750) / 1e9)
    assert "round" not in af
    bench.print_generate(rows)  # prints the ranges of the per-round ratios


def test_one_round_keeps_the_plain_records(monkeypatch):
    speeds = {bench.STOCK: [(100.0, 10.0, 5.0)], "affine:key_bits=4,value_bits=4": [(50.0, 5.0, 4.0)]}
    _fake(monkeypatch, speeds)
    rows = bench.benchmark_generate(methods=tuple(speeds), contexts=(64, 128), decode_tokens=5, progress=False)
    assert [(r["context"], r["method"]) for r in rows] == [(64, bench.STOCK), (64, "affine:key_bits=4,value_bits=4"),
                                                           (128, bench.STOCK), (128, "affine:key_bits=4,value_bits=4")]
    assert rows[1]["decode_ratio"] == 0.5 and "decode_tps_runs" not in rows[1] and "round" not in rows[1]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_rounds_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="rounds"):
        bench.benchmark_generate(rounds=bad, progress=False)


def test_even_rounds_several_entries_no_stock_and_repeats(monkeypatch):
    # 4 rounds: the median of an even count is the mean of the middle two; two contexts and a repeated spec stay apart
    speeds = {"affine:key_bits=4,value_bits=4": [(10.0, 1.0, 1.0), (20.0, 2.0, 1.0), (40.0, 4.0, 1.0), (30.0, 3.0, 1.0), (50.0, 5.0, 1.0)]}
    _fake(monkeypatch, speeds)
    a = "affine:key_bits=4,value_bits=4"
    rows = bench.benchmark_generate(methods=(a, a), contexts=(64, 128), decode_tokens=5, rounds=4, progress=False)
    assert [(r["context"], r["method"]) for r in rows] == [(64, a), (64, a), (128, a), (128, a)]
    for r in rows:
        assert len(r["decode_tps_runs"]) == 4 and "decode_ratio" not in r and "peak_target_gb" not in r  # no stock: no ratios
    # the fake hands out the five speeds in call order, four calls a round: entry 0 gets calls 0, 4, 8, 12 -> speeds 0, 4, 3, 2
    assert rows[0]["decode_tps_runs"] == [10.0, 50.0, 30.0, 40.0] and rows[0]["decode_tps"] == 35.0  # (30 + 40) / 2
    assert rows[1]["decode_tps_runs"] == [20.0, 10.0, 50.0, 30.0] and rows[1]["decode_tps"] == 25.0


def test_paired_ratios_differ_from_ratio_of_medians(monkeypatch, capsys):
    # stock 100, 50, 100; method 60, 60, 200 -> per-round ratios 0.6, 1.2, 2.0 (median 1.2); medians 100 and 60 give 0.6
    speeds = {bench.STOCK: [(100.0, 10.0, 5.0), (50.0, 10.0, 5.0), (100.0, 10.0, 5.0)],
              "turboquant:key_bits=3,value_bits=3": [(60.0, 5.0, 4.0), (60.0, 5.0, 4.0), (200.0, 5.0, 4.0)]}
    _fake(monkeypatch, speeds)
    rows = bench.benchmark_generate(methods=tuple(speeds), contexts=(64,), batches=(1, 2), decode_tokens=5, rounds=3, progress=False)
    assert [(r["batch"], r["method"]) for r in rows] == [(1, bench.STOCK), (1, "turboquant:key_bits=3,value_bits=3"),
                                                         (2, bench.STOCK), (2, "turboquant:key_bits=3,value_bits=3")]
    tq = rows[1]
    assert tq["decode_tps"] == 60.0 and tq["decode_ratio"] == pytest.approx(1.2)
    bench.print_generate(rows)
    out = capsys.readouterr().out
    assert "medians of 3 rounds" in out and "| 1.20 (0.60–2.00) |" in out


def test_print_generate_mixes_one_round_and_several(capsys):
    one = dict(context=16, batch=1, method=bench.STOCK, prefill_tps=10.0, decode_tps=5.0, peak_memory_gb=1.0, kv_bytes=2e6)
    many = dict(context=16, batch=1, method="affine", prefill_tps=5.0, decode_tps=5.0, peak_memory_gb=0.9, kv_bytes=5e5,
                decode_ratio=1.0, prefill_ratio=0.5, peak_target_gb=0.999, decode_tps_runs=[5.0, 5.0], decode_ratio_runs=[0.9, 1.1],
                prefill_ratio_runs=[0.5, 0.5])
    bench.print_generate([one, many])
    out = capsys.readouterr().out
    assert "medians of 2 rounds" in out and "| 1.00 (0.90–1.10) |" in out


def test_cli_rounds_and_the_sdpa_cache_setting(monkeypatch):
    "`--rounds` reaches benchmark_generate; the CLI sets MLX_CUDA_SDPA_CACHE_SIZE unless the user set it."
    import os
    from veloxquant import cli
    seen = {}
    monkeypatch.setattr(bench, "benchmark_generate", lambda *a, **kw: seen.update(kw) or [])
    monkeypatch.setattr(bench, "print_generate", lambda rows: None)
    monkeypatch.setenv("VELOXQUANT_NO_OPENBLAS", "1")
    monkeypatch.delenv("MLX_CUDA_SDPA_CACHE_SIZE", raising=False)
    cli.main(["benchmark", "--generate", "--skip-decode", "--rounds", "3"])
    assert seen["rounds"] == 3 and os.environ["MLX_CUDA_SDPA_CACHE_SIZE"] == "4096"
    monkeypatch.setenv("MLX_CUDA_SDPA_CACHE_SIZE", "17")
    cli.main(["benchmark", "--generate", "--skip-decode"])
    assert seen["rounds"] == 1 and os.environ["MLX_CUDA_SDPA_CACHE_SIZE"] == "17"
    for bad in ("0", "101", "x"):
        with pytest.raises(SystemExit):
            cli.main(["benchmark", "--generate", "--skip-decode", "--rounds", bad])
