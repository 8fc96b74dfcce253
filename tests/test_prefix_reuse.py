"""Prompt-cache reuse with compressed caches: save → load → trim → continue with other suffixes, directly,
through mlx-lm's LRUPromptCache, and as per-prompt caches of batch_generate."""
import copy

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (LRUPromptCache, can_trim_prompt_cache, load_prompt_cache, save_prompt_cache,
                                 trim_prompt_cache)

import veloxquant as vq
from veloxquant.core import parse_method
from test_batch import sharp_model, batched, one_by_one  # noqa: F401  (fixture and helpers)

PREFIX = [(5 * j + 1) % 128 for j in range(45)]
FIRST = [(11 * j + 7) % 128 for j in range(9)]            # the suffix the cache was computed with
SUFFIXES = [[3, 1, 4, 1, 5, 9, 2, 6], [100, 101, 27], [64] * 12]


def trimmable_specs():
    """Every registered method at default settings — each must say it trims (and the trims used here are exact) — except
    the eviction methods, `cachegen` (tokens coded in chunks) and `zipcache` (bit widths chosen per group from its
    saliency), which refuse trims (`test_inexact_trim_is_declared`)."""
    from veloxquant.evict import eviction_methods
    from conftest import uncalibrated, keeps_sequence_state
    return [m for m in uncalibrated(vq.method_ids()) if m not in eviction_methods() and m not in ("cachegen", "zipcache") and not keeps_sequence_state(m)] + ["fp16:reference=True"]


def feed(model, cache, toks):
    "One forward chunk; returns the logits [1, T, vocab] (evaluated)."
    out = model(mx.array(toks)[None], cache=cache); mx.eval(out); return out


@pytest.mark.parametrize("spec", trimmable_specs())
def test_save_load_trim_continue(sharp_model, spec, tmp_path):
    """Prefix + first suffix, saved and loaded, trimmed back to the prefix and continued with three other
    suffixes gives logits bit-identical to a run that prefilled the prefix alone (same chunking: prefix,
    then suffix)."""
    vq.compress(sharp_model, parse_method(spec))
    c = sharp_model.make_cache()
    feed(sharp_model, c, PREFIX); feed(sharp_model, c, FIRST)
    f = str(tmp_path / "prefix.safetensors")
    save_prompt_cache(f, c, {"tokens": str(len(PREFIX) + len(FIRST))})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta["tokens"] == "54" and [type(x) for x in loaded] == [type(x) for x in c]
    assert can_trim_prompt_cache(loaded), f"{spec} must trim exactly"
    for suffix in SUFFIXES:
        reuse = copy.deepcopy(loaded)
        assert trim_prompt_cache(reuse, len(FIRST)) == len(FIRST) and reuse[0].offset == len(PREFIX)
        got = feed(sharp_model, reuse, suffix)
        ref_cache = sharp_model.make_cache(); feed(sharp_model, ref_cache, PREFIX)
        ref = feed(sharp_model, ref_cache, suffix)
        assert mx.array_equal(got, ref).item(), (spec, suffix)
        # and the decode steps after it
        t = mx.argmax(got[0, -1]).item()
        assert mx.array_equal(feed(sharp_model, reuse, [t]), feed(sharp_model, ref_cache, [t])).item()


@pytest.mark.parametrize("spec", ["turboquant:center=True", "h2o:budget=0.5", "snapkv:budget=0.5", "streaming_llm:capacity=16",
                                  "tova:budget=0.5", "knorm:budget=0.5", "cachegen", "chunkkv:budget=0.5", "cam:budget=0.5",
                                  "curdkv:budget=0.5", "keyformer:budget=0.5", "squeeze:budget=0.5", "zipcache"])
def test_inexact_trim_is_declared(sharp_model, spec):
    """A per-sequence mean (turboquant center=True, set by the first chunk encoded) makes trimming inexact, and eviction
    methods cannot bring evicted tokens back: `is_trimmable()` is False, so mlx-lm's LRUPromptCache never trims it — it reuses only exact shorter prefixes."""
    vq.compress(sharp_model, parse_method(spec))
    c = sharp_model.make_cache()
    feed(sharp_model, c, PREFIX + FIRST)
    assert not can_trim_prompt_cache(c)
    lru = LRUPromptCache(max_size=4)
    lru.insert_cache("m", PREFIX + FIRST, c)
    cache, rest = lru.fetch_nearest_cache("m", PREFIX + SUFFIXES[0])
    assert cache is None and rest == PREFIX + SUFFIXES[0]  # no silent trim of an inexact cache
    short = sharp_model.make_cache(); feed(sharp_model, short, PREFIX)
    lru.insert_cache("m", PREFIX, short)
    cache, rest = lru.fetch_nearest_cache("m", PREFIX + SUFFIXES[0])
    assert rest == SUFFIXES[0] and cache[0].offset == len(PREFIX)


WINDOWED = ["affine:window=8", "turboquant:window=16", "q8_0:window=4", "polar:window=8", "qjl:window=8",
            "turboquant_rvq:window=8", "q4_0:window=8"]


@pytest.mark.parametrize("spec", WINDOWED)
def test_window_trim_within_the_window_is_exact(sharp_model, spec):
    """Trimming the tokens of the last step (what speculative decoding and a cached prompt's last turn need)
    gives bit-identical continuation to a fresh run with the same chunking, for every chunking tried —
    also when the trimmed step had pushed blocks out of the window (`exact_trim` says True)."""
    vq.compress(sharp_model, parse_method(spec))
    toks = PREFIX + FIRST + SUFFIXES[0]
    for chunks in ([45, 9], [20, 1, 1, 23, 3, 6], [44, 4, 1, 5]):
        c = sharp_model.make_cache(); pos = 0
        for n in chunks: feed(sharp_model, c, toks[pos:pos + n]); pos += n
        k = chunks[-1]
        assert c[0].is_trimmable() and c[0].exact_trim(k)
        assert trim_prompt_cache(c, k) == k
        ref = sharp_model.make_cache(); pos = 0
        for n in chunks[:-1]: feed(sharp_model, ref, toks[pos:pos + n]); pos += n
        for step in (SUFFIXES[1], [7], [9]):
            assert mx.array_equal(feed(sharp_model, c, step), feed(sharp_model, ref, step)).item(), (spec, chunks)


@pytest.mark.parametrize("spec", ["affine:key_bits=4,value_bits=4,window=8", "turboquant:window=8", "q8_0:window=8"])
def test_deep_window_trim_stays_within_the_methods_error(sharp_model, spec):
    """A trim past blocks already encoded leaves tokens as codes that a fresh run holds in fp16 (`exact_trim`
    False; fewer than 2W of them): never more codes than the same method without a window holds, so the
    continuation's distance to fp16 (L1 between next-token distributions) stays within that method's own
    error (within 10%: codes from fp16 rather than float32 values), and the cache keeps going (decode steps after it work and re-grow the window)."""
    from veloxquant.core import KVCacheConfig
    cfg = parse_method(spec)
    toks = PREFIX + FIRST + SUFFIXES[2]
    def run(config, n, step=5, model=sharp_model):
        vq.compress(model, config); c = model.make_cache()
        for i in range(0, n, step): feed(model, c, toks[i:min(n, i + step)])
        return c
    c = run(cfg, len(toks)); k = len(toks) - 30
    assert c[0].is_trimmable() and not c[0].exact_trim(k)
    trim_prompt_cache(c, k)
    assert c[0].k_store.length <= 30 and c[0].offset == 30
    no_window = run(KVCacheConfig.from_dict({**cfg.to_dict(), "window": 0}), 30)
    fresh = run(cfg, 30)
    fp = run(KVCacheConfig("fp16"), 30)
    outs = {}
    for name, cache, conf in (("trimmed", c, cfg), ("fresh", fresh, cfg), ("no_window", no_window, None), ("fp16", fp, None)):
        vq.compress(sharp_model, conf or cache[0].config)
        outs[name] = feed(sharp_model, cache, SUFFIXES[0])
    sm = lambda x: mx.softmax(x.astype(mx.float32), axis=-1)
    err = lambda a: mx.abs(sm(outs[a]) - sm(outs["fp16"])).sum(-1).mean().item()
    assert err("fresh") <= err("no_window")  # the window helps ...
    assert err("trimmed") <= 1.1 * err("no_window") + 1e-3, {n: err(n) for n in outs}  # ... and a deep trim is no worse than none
    vq.compress(sharp_model, cfg)
    feed(sharp_model, c, [1] * 20)
    assert c[0].offset == 58 and c[0].k_exact.shape[2] >= 8


@pytest.mark.parametrize("spec", ["affine:key_bits=4,value_bits=4", "turboquant", "fp16"])
def test_lru_prompt_cache_prefix_match(sharp_model, spec):
    """mlx-lm's LRUPromptCache holds compressed caches: an exact hit returns a copy, a longer entry sharing a
    prefix is trimmed to it; continuing equals a run with the same chunking."""
    vq.compress(sharp_model, parse_method(spec))
    c = sharp_model.make_cache()
    feed(sharp_model, c, PREFIX); feed(sharp_model, c, FIRST)
    lru = LRUPromptCache(max_size=4)
    lru.insert_cache("m", PREFIX + FIRST, c)
    assert lru.nbytes == sum(x.nbytes for x in c) > 0
    hit, rest = lru.fetch_nearest_cache("m", PREFIX + FIRST)
    assert rest == [] and hit is not c and hit[0].offset == len(PREFIX) + len(FIRST)
    for suffix in SUFFIXES:
        cache, rest = lru.fetch_nearest_cache("m", PREFIX + suffix)
        assert rest == suffix and cache[0].offset == len(PREFIX)
        ref_cache = sharp_model.make_cache(); feed(sharp_model, ref_cache, PREFIX)
        assert mx.array_equal(feed(sharp_model, cache, rest), feed(sharp_model, ref_cache, suffix)).item()
    assert lru._trie.get("m", PREFIX + FIRST).prompt_cache[0].offset == len(PREFIX) + len(FIRST)  # entry untouched


@pytest.mark.parametrize("spec", ["affine:key_bits=4,value_bits=4", "affine:key_bits=4,value_bits=4,window=8", "polar", "fp16"])
def test_batch_generate_from_shared_prefix(sharp_model, spec, tmp_path):
    """Several suffixes of different lengths batched from copies of one loaded prefix cache (merge of
    non-empty caches, right-padded prefill over compressed history, finalize) give the tokens of one-by-one
    generation from the same prefix cache."""
    vq.compress(sharp_model, parse_method(spec))
    c = sharp_model.make_cache(); feed(sharp_model, c, PREFIX)
    f = str(tmp_path / "p.safetensors"); save_prompt_cache(f, c)
    loaded = load_prompt_cache(f)
    toks, _, _ = batched(sharp_model, SUFFIXES, [10] * 3, caches=[copy.deepcopy(loaded) for _ in SUFFIXES])
    for suffix, got in zip(SUFFIXES, toks):
        ref = []
        for (t, _), _ in zip(generate_step(mx.array(suffix), sharp_model, max_tokens=10,
                                           prompt_cache=copy.deepcopy(loaded)), range(10)):
            ref.append(int(t))
        assert got == ref, (spec, suffix)


def test_load_in_a_fresh_process(sharp_model, tmp_path):
    """A prompt-cache file (per-sequence fp16 / turboquant caches, and a batch cache) loads in a new process
    after only `import veloxquant`: every cache class is registered with mlx-lm's load_prompt_cache."""
    import subprocess, sys
    files = []
    for spec in ["fp16", "turboquant", "affine"]:
        vq.compress(sharp_model, parse_method(spec))
        c = sharp_model.make_cache(); feed(sharp_model, c, PREFIX)
        f = str(tmp_path / f"{spec}.safetensors"); save_prompt_cache(f, c); files.append((f, c[0].offset))
    from veloxquant.batch import merge_caches
    other = sharp_model.make_cache(); feed(sharp_model, other, FIRST)
    f = str(tmp_path / "batch.safetensors"); save_prompt_cache(f, [merge_caches([c[l], other[l]]) for l in range(2)])
    code = ("import sys, veloxquant; from mlx_lm.models.cache import load_prompt_cache\n"
            "for f in sys.argv[1:]: print(type(load_prompt_cache(f)[0]).__name__, load_prompt_cache(f)[0].size())")
    out = subprocess.run([sys.executable, "-c", code, *[x[0] for x in files], f], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["FP16Cache", "45", "TurboQuantCache", "45", "VQCache", "45", "VQBatchCache", "45"]


@pytest.mark.parametrize("spec", ["affine:key_bits=4,value_bits=4,window=8", "turboquant", "q4_0:window=4"])
def test_speculative_decoding_runs(sharp_model, spec):
    """mlx-lm's speculative decoding (draft model = the same tiny model) refuses untrimmable caches; with the
    compressed caches (fp16 windows smaller than the prompt, so verify steps push blocks out and rejected drafts
    are trimmed) it runs, and its first 16 tokens are those of plain greedy decoding with the same method. Not
    all 24 on purpose: a verify step's queries see the code/fp16 split of the step's start, one-token steps
    see it move every token, so a block can become codes a few tokens earlier or later and this deliberately
    sharp random model can then pick another low-margin token (tokens stay per-token identical codes)."""
    from mlx_lm.generate import speculative_generate_step
    vq.compress(sharp_model, parse_method(spec))
    prompt = mx.array(PREFIX)
    cache = sharp_model.make_cache() + sharp_model.make_cache()  # main model's layers, then the draft's
    assert can_trim_prompt_cache(cache)
    got = [int(t) for t, _, _ in speculative_generate_step(prompt, sharp_model, sharp_model, num_draft_tokens=3,
                                                            max_tokens=24, prompt_cache=cache)]
    ref = [int(t) for (t, _), _ in zip(generate_step(prompt, sharp_model, max_tokens=24, prompt_cache=sharp_model.make_cache()), range(24))]
    assert len(got) == 24 and cache[0].offset >= len(PREFIX) + 23
    assert got[:16] == ref[:16], (got, ref)
