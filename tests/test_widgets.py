"""Tests of the data behind the widgets (veloxquant.widgets): codebook views and distortions against the
TurboQuant bounds, key spectra, key capture from the real default model, trade-off rows and Pareto
frontiers; plus the widgets driven from Python (the browser test drives them in JupyterLab)."""
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from veloxquant import widgets as vw

RESULTS = Path(__file__).resolve().parent.parent / "nbs" / "leaderboard_results.json"


# ---------------------------------------------------------------- codebooks
def test_bounds_values_and_errors():
    assert vw.mse_bounds(1) == (0.25, pytest.approx(math.sqrt(3) * math.pi / 8))
    lo, hi = vw.mse_bounds(3)
    assert lo == 4.0 ** -3 and hi / lo == pytest.approx(2.7207, abs=1e-4)
    for bad in (0, 9, 2.0, "3"):
        with pytest.raises(ValueError, match="bits="): vw.mse_bounds(bad)


@pytest.mark.parametrize("kind,dim", [("gaussian", None), ("laplace", None), ("sphere", 3), ("sphere", 64), ("sphere", 128)])
def test_density_is_normalized(kind, dim):
    x = np.linspace(-1, 1, 400_001) if kind == "sphere" else np.linspace(-40, 40, 400_001)
    assert np.trapezoid(vw.density(kind, x, dim), x) == pytest.approx(1.0, abs=1e-4)


def test_sphere_density_matches_sampled_coordinates():
    "The coordinate of a uniform unit vector in 64 dims: mass within ±1/√d from the density vs from samples."
    rng = np.random.default_rng(1)
    g = rng.standard_normal((20000, 64)); u = g / np.linalg.norm(g, axis=1, keepdims=True)
    x = np.linspace(-1 / 8, 1 / 8, 20001)
    assert np.trapezoid(vw.density("sphere", x, 64), x) == pytest.approx(np.mean(np.abs(u) <= 1 / 8), abs=0.005)


@pytest.mark.parametrize("kind,dim", [("gaussian", None), ("laplace", None), ("sphere", 64), ("sphere", 128)])
def test_codebook_view_satisfies_lloyd_max_conditions(kind, dim):
    "Boundaries are midpoints; each centroid is the conditional mean of its cell under the density (numerical integration)."
    v = vw.codebook_view(kind, 3, dim)
    c, t = v["centroids"], v["boundaries"]
    assert c.shape == (8,) and t.shape == (7,) and np.all(np.diff(c) > 0)
    np.testing.assert_allclose(t, 0.5 * (c[1:] + c[:-1]), atol=1e-6)
    half = 1.0 if kind == "sphere" else 40.0
    edges = np.concatenate([[-half], t, [half]])
    for i in range(8):
        x = np.linspace(edges[i], edges[i + 1], 20001); f = vw.density(kind, x, dim)
        assert c[i] == pytest.approx(np.trapezoid(x * f, x) / np.trapezoid(f, x), abs=2e-4 * (1 if kind != "sphere" else 1 / math.sqrt(dim)))
    assert v["pdf"].shape == v["x"].shape and v["x"][0] < c[0] and v["x"][-1] > c[-1]


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_sphere_distortion_between_paper_bounds(dim, bits):
    "TurboQuant: 4^-b <= E‖u − Q(u)‖² <= 2.72·4^-b for the sphere-coordinate codebook; measured ≈ solver's value."
    lo, hi = vw.mse_bounds(bits)
    m = vw.measured_distortion("sphere", bits, dim, n=2048)
    assert lo < m < hi
    assert m == pytest.approx(vw.codebook_view("sphere", bits, dim)["distortion"], rel=0.05)


def test_gaussian_inside_laplace_outside_the_upper_bound():
    "The Gaussian (the sphere's large-d limit) stays under 2.72·4^-b; the heavier-tailed Laplacian crosses it from 2 bits."
    for r in vw.distortion_table("gaussian", bits=(1, 2, 3, 4), n=1024):
        assert r["lower"] < r["measured"] < r["upper"], r
    lap = vw.distortion_table("laplace", bits=(1, 4), n=1024)
    assert lap[0]["measured"] < lap[0]["upper"] and lap[1]["measured"] > lap[1]["upper"]


def test_codebook_errors():
    with pytest.raises(ValueError, match="kind='cauchy'"): vw.codebook_view("cauchy", 2)
    with pytest.raises(ValueError, match="dim=2"): vw.measured_distortion("sphere", 2, 2)
    with pytest.raises(ValueError, match="n=0"): vw.measured_distortion("gaussian", 2, n=0)
    with pytest.raises(ValueError, match="n_grid=1"): vw.codebook_view("gaussian", 2, n_grid=1)
    with pytest.raises(ValueError, match="dim=100"): vw.codebook_explorer(dim=100)


def test_codebook_explorer_responds():
    w = vw.codebook_explorer("sphere", 2, 64, n=256)
    kind_w, bits_w, dim_w = w.children[0].children
    svg = w.children[2].children[0].value
    assert svg.startswith("<svg") and "sphere64" in w.children[1].value and "inside the bounds" in w.children[1].value
    bits_w.value = 4
    assert w.children[2].children[0].value != svg and "4 bits" in w.children[1].value
    kind_w.value = "laplace"
    assert dim_w.disabled and "laplace" in w.children[1].value and "outside the bounds" in w.children[1].value


# ---------------------------------------------------------------- key spectra
@settings(max_examples=25, deadline=None)
@given(st.integers(2, 300), st.sampled_from([8, 16, 64, 80]), st.integers(0, 2**31 - 1))
def test_spectrum_sums_to_total_variance(T, D, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((T, D)) * rng.uniform(0.1, 5, D) + rng.normal(0, 3, D)
    s = vw.key_spectrum(k)
    per_channel = k.var(axis=0).sum()
    assert s["total_variance"] == pytest.approx(per_channel, rel=1e-9)
    assert s["eigenvalues"].sum() == pytest.approx(per_channel, rel=1e-8)
    assert np.all(np.diff(s["eigenvalues"]) <= 1e-9 * s["eigenvalues"][0])
    assert s["cumulative"][-1] == pytest.approx(1.0) and np.all(np.diff(s["cumulative"]) >= -1e-12)
    assert s["cumulative"][s["components_90"] - 1] >= 0.9 - 1e-12
    assert s["components_90"] == 1 or s["cumulative"][s["components_90"] - 2] < 0.9


@pytest.mark.parametrize("rotation", ["hadamard", "orthogonal"])
def test_rotation_keeps_spectrum_and_spreads_outliers(rotation):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((500, 64)); k[:, 5] = 20 + 4 * rng.standard_normal(500)
    a, b = vw.key_spectrum(k), vw.key_spectrum(vw.rotate_keys(k, rotation))
    np.testing.assert_allclose(a["eigenvalues"], b["eigenvalues"], rtol=0, atol=1e-6 * a["eigenvalues"][0])
    assert a["outlier_ratio"] > 15 and b["outlier_ratio"] < a["outlier_ratio"] / 4  # Hadamard: 1.03, Haar: 3.5
    assert int(np.argmax(a["channel_rms"])) == 5 and a["channel_absmax"][5] == np.abs(k[:, 5]).max()
    np.testing.assert_array_equal(vw.rotate_keys(k, None), k)


def test_channel_heatmap():
    k = np.arange(40.0).reshape(10, 4) - 20
    h = vw.channel_heatmap(k, 5)
    assert h.shape == (5, 4)
    np.testing.assert_allclose(h[0], np.abs(k[:2]).mean(0))
    np.testing.assert_allclose(vw.channel_heatmap(k, 1)[0], np.abs(k).mean(0))
    assert vw.channel_heatmap(k, 64).shape == (10, 4)
    with pytest.raises(ValueError, match="n_bins=0"): vw.channel_heatmap(k, 0)
    with pytest.raises(ValueError, match=r"shape \(4,\)"): vw.key_spectrum(np.zeros(4))


def test_capture_keys_are_post_rope_keys(real):
    "Captured layer-0 keys equal RoPE(k_proj(input_layernorm(embed(tokens)))) computed directly; cached in memory."
    import mlx.core as mx
    from veloxquant.models import eval_tokens
    model, tok, _ = real
    keys = vw.capture_keys(model, tok, n_tokens=48, step=20, progress=False)
    inner = model.model
    assert keys.shape == (len(inner.layers), model.args.num_key_value_heads, 48, 64) and keys.dtype == np.float32
    assert vw.capture_keys(model, tok, n_tokens=48, step=20, progress=False) is keys
    toks = mx.array(eval_tokens(tok, 48))[None]
    attn = inner.layers[0].self_attn
    k = attn.k_proj(inner.layers[0].input_layernorm(inner.embed_tokens(toks)))
    k = attn.rope(k.reshape(1, 48, attn.n_kv_heads, -1).transpose(0, 2, 1, 3))
    np.testing.assert_allclose(keys[0], np.array(k[0]), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="n_tokens=8"): vw.capture_keys(model, tok, n_tokens=8)
    with pytest.raises(ValueError, match="tokenizer=None"): vw.capture_keys(model, None, n_tokens=16)


def test_key_spectrum_explorer_responds():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((3, 2, 64, 64)); keys[1, :, :, 7] += 30
    w = vw.key_spectrum_explorer(keys)
    layer_w, head_w, rot_w = w.children[0].children
    s0 = w.children[2].value
    assert s0.startswith("<svg") and "layer 0, KV head 0" in w.children[1].value
    layer_w.value = 1
    assert w.children[2].value != s0 and "largest channels 7" in w.children[1].value
    rot_w.value = "orthogonal"
    assert "orthogonal rotation" in w.children[1].value
    with pytest.raises(ValueError, match="rotation='none'"): vw.key_spectrum_explorer(keys, rotation="none")
    with pytest.raises(ValueError, match="shape"): vw.key_spectrum_explorer(keys[0])


# ---------------------------------------------------------------- trade-off
@pytest.fixture(scope="module")
def records():
    from veloxquant.eval import load_results
    return load_results(RESULTS)[0]


def test_tradeoff_rows(records):
    rows = vw.tradeoff_rows(records)
    assert len(rows) == len(records) and rows[0]["label"] == "fp16" and rows[0]["delta_ppl_pct"] == 0
    for r, rec in zip(rows, records):
        assert r["bits"] == rec["bits_per_element"] and r["kv_mib"] == rec["nbytes"] / 2**20
        assert r["niah_miss"] == pytest.approx(1 - rec["niah_accuracy"])
        assert r["method"] == "fp16" or all(f"{k}={v}" in r["settings"] for k, v in rec["config"].items() if k != "method")
    assert vw.tradeoff_rows([dict(label="x", method="m")])[0]["delta_ppl_pct"] is None
    with pytest.raises(ValueError, match=r"records\[0\]"): vw.tradeoff_rows([dict(bits=3)])


@pytest.mark.parametrize("metric", list(vw.METRICS))
@pytest.mark.parametrize("x", list(vw.X_AXES))
def test_frontier_is_exactly_the_non_dominated_set(records, metric, x):
    rows = vw.tradeoff_rows(records)
    front = vw.tradeoff_frontier(rows, metric, x)
    assert [rows[i][x] for i in front] == sorted(rows[i][x] for i in front)
    for i, r in enumerate(rows):
        dom = any(o[x] <= r[x] and o[metric] <= r[metric] and (o[x] < r[x] or o[metric] < r[metric]) for o in rows)
        assert (i in front) == (not dom), (r["label"], metric, x)


def test_select_rows_and_errors(records):
    rows = vw.tradeoff_rows(records)
    sub = vw.select_rows(rows, methods={"affine", "turboquant"}, max_bits=4.0)
    assert sub and {r["method"] for r in sub} <= {"affine", "turboquant"} and all(r["bits"] <= 4.0 for r in sub)
    assert vw.select_rows(rows) == rows and vw.select_rows(rows, max_bits=1.0) == []
    with pytest.raises(ValueError, match="metric='speed'"): vw.tradeoff_frontier(rows, "speed")
    with pytest.raises(ValueError, match="x='time'"): vw.tradeoff_frontier(rows, "kl_mean", "time")
    with pytest.raises(ValueError, match="no records"): vw.tradeoff_explorer([])


def test_chart_and_details(records):
    rows = vw.tradeoff_rows(records)
    svg = vw.chart_svg(vw.chart_tradeoff(rows, "kl_mean", selected="q4_0"))
    assert svg.startswith("<svg") and "KL mean (nats)" in svg
    for i in vw.tradeoff_frontier(rows, "kl_mean"): assert rows[i]["label"] in svg
    d = vw.config_details(records[1])
    assert records[1]["label"] in d and f"{records[1]['nbytes']:,d}" in d and "NIAH cells" in d


def test_tradeoff_explorer_responds(records):
    w = vw.tradeoff_explorer(RESULTS)
    metric_w, x_w, maxb_w, config_w = w.children[0].children[0].children
    chart, details = w.children[2].children
    svg0 = chart.value
    assert f"{len(records)} of {len(records)}" in w.children[1].value
    maxb_w.value = 4.0
    n = len(vw.select_rows(vw.tradeoff_rows(records), max_bits=4.0))
    assert chart.value != svg0 and f"{n} of {len(records)}" in w.children[1].value
    assert set(config_w.options) == {r["label"] for r in vw.select_rows(vw.tradeoff_rows(records), max_bits=4.0)}
    config_w.value = "affine k3 v3"
    assert "affine k3 v3" in details.value
    x_w.value = "kv_mib"
    assert "KV cache (MiB)" in chart.value
    w.children[0].children[1].value = ("q8_0",)
    assert "no configuration visible" in details.value and "0 of" in w.children[1].value


@pytest.mark.parametrize("keys, msg", [(np.ones((10, 64)), "zero variance"), (np.full((10, 64), np.nan), "NaN or infinite")])
def test_key_spectrum_degenerate_keys_refused(keys, msg):
    "Constant or non-finite keys give a ValueError naming the problem (not a failure inside numpy or the chart code)."
    from veloxquant.widgets import key_spectrum
    with pytest.raises(ValueError, match=msg):
        key_spectrum(keys)
