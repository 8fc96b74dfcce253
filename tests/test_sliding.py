"""Sliding-window and chunked compressed caches (veloxquant.sliding) against mlx-lm's RotatingKVCache / ChunkedKVCache:
attention outputs step by step, save/load round trips through mlx-lm's prompt-cache files, trim, deepcopy, sizes."""
import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

import veloxquant as vq
from veloxquant.attention import dispatch, install
from veloxquant.cache import seal_state
from veloxquant.sliding import ChunkedVQCache, FP16RotatingCache, RotatingVQCache, chunked_cache, sliding_cache

install()
STEPS = [5, 9, 1, 1, 1, 20, 1, 1, 7, 1, 1, 1, 1, 3, 1]  # 54 tokens: prefill chunks and decode steps past a window of 16
AFFINE = vq.KVCacheConfig("affine", group_size=32)


def run_steps(cache, steps, seed=0, H=2, Hq=4, D=32, dtype=mx.float32):
    "Random steps through one layer's attention, masks made the way mlx-lm's models make them."
    rng = np.random.default_rng(seed); outs = []
    for T in steps:
        q, k, v = (mx.array(rng.standard_normal((1, h, T, D)).astype(np.float32)).astype(dtype) for h in (Hq, H, H))
        if isinstance(cache, (ChunkedKVCache, ChunkedVQCache)):  # as llama4.py
            cache.maybe_trim_front()
            s, o = cache.start_position, cache.offset
            kk, qq = mx.arange(s, o + T)[None], mx.arange(o, o + T)[:, None]
            mask = (kk <= qq) & ((kk // cache.chunk_size) == (qq // cache.chunk_size))
        else:
            mask = cache.make_mask(T, window_size=cache.max_size)
        kf, vf = cache.update_and_fetch(k, v)
        outs.append(dispatch(q, kf, vf, cache, scale=D ** -0.5, mask=mask))
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("keep", [0, 4])
@pytest.mark.parametrize("max_size", [16, 7])
def test_rotating_parity(keep, max_size):
    ref = run_steps(RotatingKVCache(max_size, keep), STEPS)
    assert mx.array_equal(ref, run_steps(sliding_cache(vq.KVCacheConfig("fp16"), max_size, keep), STEPS)).item()
    for every in (1, RotatingVQCache.evict_every):
        c = sliding_cache(vq.KVCacheConfig("fp16", reference=True), max_size, keep)
        c.evict_every = every
        assert mx.abs(ref - run_steps(c, STEPS)).max().item() < 1e-5
    assert c.size() == RotatingKVCache(max_size, keep).size() or c.size() == max_size


def test_rotating_parity_bfloat16():
    ref = run_steps(RotatingKVCache(16), STEPS, dtype=mx.bfloat16)
    assert mx.array_equal(ref, run_steps(sliding_cache(vq.KVCacheConfig("fp16"), 16), STEPS, dtype=mx.bfloat16)).item()


def test_eviction_holds_the_window():
    c = sliding_cache(vq.KVCacheConfig("fp16", reference=True), 16); c.evict_every = 1
    run_steps(c, STEPS)
    assert (c.offset, c.stored, c.start) == (54, 15, 39)
    assert c.positions().tolist() == list(range(39, 54))
    c = sliding_cache(AFFINE, 16, keep=4); c.evict_every = 1
    run_steps(c, STEPS)
    assert c.positions().tolist() == [0, 1, 2, 3] + list(range(43, 54))


def test_chunked_parity():
    steps = [5, 9, 1, 1, 1, 12, 1, 1, 3, 1]
    ref = run_steps(ChunkedKVCache(8), steps)
    assert mx.array_equal(ref, run_steps(chunked_cache(vq.KVCacheConfig("fp16"), 8), steps)).item()
    assert mx.abs(ref - run_steps(chunked_cache(vq.KVCacheConfig("fp16", reference=True), 8), steps)).max().item() < 1e-5
    c = chunked_cache(AFFINE, 8)
    out = run_steps(c, steps)
    assert (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item() < 0.05
    assert c.start_position == 35 - 1 - 8 and c.stored == 9


@pytest.mark.parametrize("make", [lambda: sliding_cache(vq.KVCacheConfig("fp16"), 16, 4), lambda: sliding_cache(AFFINE, 16),
                                  lambda: sliding_cache(vq.KVCacheConfig("turboquant"), 16, 2), lambda: chunked_cache(AFFINE, 8),
                                  lambda: chunked_cache(vq.KVCacheConfig("fp16"), 8),
                                  lambda: sliding_cache(vq.KVCacheConfig("kivi", window=0), 16, 2), lambda: chunked_cache(vq.KVCacheConfig("gear", value_group=32), 8)])
def test_save_load_round_trip(make, tmp_path):
    a, b = make(), make()
    run_steps(a, [20, 1, 1], seed=1); run_steps(b, [20, 1, 1], seed=1)
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, [a])
    (loaded,) = load_prompt_cache(f)
    assert type(loaded) is type(a) and loaded.offset == a.offset and loaded.nbytes > 0
    assert mx.array_equal(run_steps(loaded, [1, 5, 1], seed=2), run_steps(b, [1, 5, 1], seed=2)).item()


@pytest.mark.parametrize("spec", ["kivi:window=0", "kivi_sink", "kitty:value_group=32", "gear:value_group=32,outlier_pct=1.0"])
def test_token_grouped_methods_keep_sliding_layers_exact(spec):
    """Methods whose codecs encode tokens in groups (`token_grouped` configs) hold a sliding or chunked layer's bounded
    tokens in the inner cache's fp16 window: nothing is coded there, outputs match the fp16 cache to fp16 rounding."""
    cfg = vq.parse_method(spec)
    for make, steps in ((lambda c: sliding_cache(c, 16, 4), STEPS), (lambda c: chunked_cache(c, 8), [5, 9, 1, 1, 1, 12, 1, 1, 3, 1])):
        c, ref = make(cfg), make(vq.KVCacheConfig("fp16", reference=True))
        out, want = run_steps(c, steps), run_steps(ref, steps)
        assert c.inner.k_store.length == 0 and c.inner.k_exact is not None
        assert mx.abs(out - want).max().item() < 1e-2
        assert c.inner.window >= (c.max_size + c.evict_every if isinstance(c, RotatingVQCache) else c.chunk_size)


def test_tampered_state_refused(tmp_path):
    a = sliding_cache(AFFINE, 16)
    run_steps(a, [20, 1])
    st = a.state
    st["start"] = st["start"] - 3
    with pytest.raises(ValueError, match="checksum does not match"):  # an edit without a recomputed checksum
        RotatingVQCache.from_state(dict(st))
    seal_state(st)  # behind the checksum, the structural checks (a forger who recomputes the checksum)
    with pytest.raises(ValueError, match="corrupt cache state"):
        RotatingVQCache.from_state(st)
    c = chunked_cache(AFFINE, 8); run_steps(c, [10, 1])
    st = c.state; st["offset"] += 1; seal_state(st)
    with pytest.raises(ValueError, match="corrupt cache state"):
        ChunkedVQCache.from_state(st)
    f = sliding_cache(vq.KVCacheConfig("fp16"), 16); run_steps(f, [5])
    st = f.state; st["idx"] = 99; seal_state(st)
    with pytest.raises(ValueError, match="idx=99"):
        FP16RotatingCache.from_state(st)


@pytest.mark.parametrize("config", [vq.KVCacheConfig("fp16"), AFFINE])
def test_trim_like_mlx_lm(config):
    c, r = sliding_cache(config, 16), RotatingKVCache(16)
    run_steps(c, [10]); run_steps(r, [10])
    assert c.is_trimmable() and r.is_trimmable()
    assert c.trim(3) == r.trim(3) == 3 and c.offset == r.offset == 7
    # after the trim both continue identically (fp16) / closely (affine)
    oc, orf = run_steps(c, [4, 1], seed=3), run_steps(r, [4, 1], seed=3)
    assert (mx.linalg.norm(oc - orf) / mx.linalg.norm(orf)).item() < (1e-6 if config.method == "fp16" else 0.15)  # 4-bit codes on Gaussian data
    run_steps(c, [12]); run_steps(r, [12])
    assert not c.is_trimmable() and not r.is_trimmable()
    with pytest.raises(ValueError, match="cannot trim"):
        c.trim(2)
    assert c.trim(0) == 0
    k = chunked_cache(config, 8); run_steps(k, [10, 1])
    assert k.is_trimmable() and k.trim(100) == 11 - k.start_position


def test_deepcopy_and_sizes():
    c = sliding_cache(AFFINE, 16); run_steps(c, [30, 1])
    d = copy.deepcopy(c)  # LRUPromptCache deep-copies caches
    assert d.offset == c.offset and d.inner is not c.inner
    assert mx.array_equal(run_steps(c, [2], seed=5), run_steps(d, [2], seed=5)).item()
    assert c.nbytes == c.inner.nbytes > 0 and c.size() == 16
    rep = vq.cache_report([c])
    assert rep["elements"] == 2 * c.stored * 64 and rep["nbytes"] == c.nbytes


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep=16"):
        RotatingVQCache(AFFINE, 16, 16)
    with pytest.raises(ValueError, match="max_size=0"):
        sliding_cache(vq.KVCacheConfig("fp16"), 0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        ChunkedVQCache(AFFINE, 0)
    with pytest.raises(ValueError, match="window_size=8"):
        sliding_cache(AFFINE, 16).make_mask(2, window_size=8)


def test_for_model_maps_cache_types():
    from veloxquant.sliding import equivalent_cache
    from mlx_lm.models.cache import ArraysCache, KVCache
    assert isinstance(equivalent_cache(RotatingKVCache(512, 0), AFFINE), RotatingVQCache)
    assert isinstance(equivalent_cache(RotatingKVCache(512, 0), vq.KVCacheConfig("fp16")), FP16RotatingCache)
    assert equivalent_cache(ChunkedKVCache(64), AFFINE).chunk_size == 64
    assert type(equivalent_cache(KVCache(), AFFINE)) is type(AFFINE.make_cache())
    with pytest.raises(ValueError, match="'mamba' builds caches of type ArraysCache"):
        equivalent_cache(ArraysCache(2), AFFINE, "mamba")


def test_attention_probe_skips_windowed_layers():
    "The evaluation harness's attention probe compares against full causal attention: windowed layers are left out."
    import sys, os
    sys.path.insert(0, os.path.dirname(__file__))
    from test_architectures import build
    from veloxquant.eval import decode_run
    model = build("gemma3_text")  # layer 0 sliding (window 16), layer 1 global
    run = decode_run(model, AFFINE, [(7 * i + 3) % 100 for i in range(40)], n_scored=4, attn_probe=2)
    assert [r["layer"] for r in run["attn"]] == [1]
    assert all(0 <= r["out_rel_err"] < 1 for r in run["attn"])
