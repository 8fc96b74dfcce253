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
