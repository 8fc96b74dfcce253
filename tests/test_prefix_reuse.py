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
    "Every registered method at default settings (all window 0) — each must say it trims exactly."
    return vq.method_ids() + ["fp16:reference=True"]


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


@pytest.mark.parametrize("spec", ["affine:window=8", "turboquant:window=16", "q8_0:window=4", "turboquant:center=True"])
def test_inexact_trim_is_declared(sharp_model, spec):
    """An fp16 window (encoded window tokens cannot get their exact values back) or a per-sequence mean
    (turboquant center=True) makes trimming inexact: `is_trimmable()` is False, so mlx-lm's LRUPromptCache
    never trims these caches — it reuses only exact shorter prefixes."""
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
