"""Every eviction method, on a small random model through a chunked prefill then decode steps: its caches' `nbytes`
never exceed fp16's at any step (what is held, its headroom and every buffer counted), and the shared `sinks`
option keeps the first positions in every head."""
import tempfile
from pathlib import Path
import pytest
import mlx.core as mx
import veloxquant as vq
from veloxquant.builder import KVCacheBuilder
from veloxquant.core import KVCacheConfig
from veloxquant.evict import eviction_methods, EvictCache, prompt_passes

METHODS = eviction_methods()
CHUNKS = (64, 64, 37) + (1,) * 12          # a chunked prefill (mlx-lm's prefill steps), the prompt's end, decode steps


def test_sixteen_methods():
    assert len(METHODS) == 16, METHODS


def config(model, method, **opts):
    "The method's config, calibrated on `model` first where the method needs an artifact (Q-Filters)."
    from veloxquant.calibrate import calibration_of, calibrate
    if calibration_of(method) is not None:
        out = Path(tempfile.mkdtemp(prefix="vq-evict-")) / f"{method}.safetensors"
        opts["path"] = str(calibrate(KVCacheConfig(method, **opts), model, tokens=list(range(1, 97)), window=48, out=out, progress=False))
    return KVCacheConfig(method, **opts)


class ByteTokenizer:
    "A tokenizer stand-in for kvzip's repeat instruction on a 128-token model: one id per byte, no chat template."
    chat_template = None
    def encode(self, text, add_special_tokens=False): return [b % 128 for b in text.encode()]


def steps(model, caches, toks, chunks=CHUNKS, passes=False):
    "Feed `toks` in `chunks`; yields after every step (kvzip's reconstruction pass run before the first single-token step)."
    s = 0
    for n in chunks:
        if passes and n == 1 and s == sum(c for c in chunks if c > 1): prompt_passes(model, caches, toks[:s], ByteTokenizer())
        mx.eval(model(mx.array(toks[s:s + n])[None], cache=caches)); s += n
        yield s


@pytest.mark.parametrize("budget", [0.5, 1.0])
@pytest.mark.parametrize("method", METHODS)
def test_nbytes_at_most_fp16_every_step(tiny_model, method, budget):
    toks = [(i * 7 + 3) % 128 for i in range(sum(CHUNKS))]
    ref = KVCacheBuilder.for_model(tiny_model, KVCacheConfig("fp16"))
    caches = KVCacheBuilder.for_model(tiny_model, config(tiny_model, method, budget=budget))
    assert all(isinstance(c, EvictCache) for c in caches)
    ref_steps = steps(tiny_model, ref, toks)
    for seen in steps(tiny_model, caches, toks, passes=True):
        next(ref_steps)
        ours, fp16 = sum(c.nbytes for c in caches), sum(c.nbytes for c in ref)
        assert ours <= fp16, f"{method} budget={budget}: {ours} bytes > fp16's {fp16} after {seen} tokens"


@pytest.mark.parametrize("method", METHODS)
def test_sinks_kept(tiny_model, method):
    """`sinks=4` at a quarter kept: positions 0-3 held by every head of every layer after the prompt and the decode steps
    (a layer whose target is below 4 prompt tokens, PyramidKV's top layers, holds the first ones it can)."""
    toks = [(i * 11 + 5) % 128 for i in range(sum(CHUNKS))]
    caches = KVCacheBuilder.for_model(tiny_model, config(tiny_model, method, budget=0.25, sinks=4))
    for _ in steps(tiny_model, caches, toks, passes=True): pass
    for c in caches:
        for head in c.kept_positions()[0]:
            t = sum(p < sum(n for n in CHUNKS if n > 1) for p in head)        # prompt tokens this head holds
            assert set(range(min(4, t))) <= set(head), (method, head[:8])
