"""Attention-sink tokens kept exact (`sinks` option of every quantizing method, `VQCache(sinks=...)`)."""
import math
import pytest
from veloxquant.cache import seal_state
import mlx.core as mx
from mlx_lm.models.cache import save_prompt_cache, load_prompt_cache
import veloxquant as vq
from veloxquant.core import KVCacheConfig, cache_report, method_ids
from veloxquant.builder import KVCacheBuilder
from veloxquant.cache import VQCache
from veloxquant.methods.fp16 import IdentityCodec

from veloxquant.evict import eviction_methods
# eviction methods have no `sinks`/`window` of a quantizer; xkv keeps every token after the compressed prompt in fp16
from conftest import uncalibrated
QUANT_METHODS = [m for m in uncalibrated(method_ids()) if m not in ("fp16", "xkv", "svdq", "kvtc", "zipcache", "amc") and m not in eviction_methods()]  # svdq, kvtc: window >= 1; zipcache, amc: window >= a group (their sinks: tests/test_contract.py, nbs/methods/kvtc.ipynb)


def feed(model, caches, toks, chunks):
    "Feed `toks` in pieces of the given sizes; returns the concatenated logits [1, T, vocab]."
    outs, s = [], 0
    for n in chunks:
        outs.append(model(mx.array(toks[s:s + n])[None], cache=caches)); s += n
    assert s == len(toks)
    out = mx.concatenate(outs, axis=1); mx.eval(out)
    return out


def lossless(model, sinks, window):
    "Caches whose codec stores keys/values unchanged: attention must equal fp16's whatever the sink/window split."
    cfg = KVCacheConfig("fp16", reference=True)
    make = lambda kd, vd: (IdentityCodec(kd), IdentityCodec(vd))
    return [VQCache(cfg, make, window=window, sinks=sinks) for _ in model.layers]


@pytest.mark.parametrize("sinks, window, chunks", [(4, 0, (40, 1, 1, 8)), (4, 3, (2, 1, 1, 30, 16)), (1, 5, (50,)),
                                                   (7, 2, (3, 3, 3, 41)), (60, 0, (20, 30, 1))])
def test_sinks_keep_positions(tiny_model, sinks, window, chunks):
    "Sinks first, codes, window, current step: the same attention as fp16 for chunked prefill (mask arrays) and decode."
    toks = [(i * 11 + 5) % 128 for i in range(sum(chunks))]
    ref = feed(tiny_model, KVCacheBuilder.for_model(tiny_model, KVCacheConfig("fp16")), toks, chunks)
    caches = lossless(tiny_model, sinks, window)
    out = feed(tiny_model, caches, toks, chunks)
    assert mx.allclose(out, ref, atol=2e-2, rtol=1e-3).item(), mx.abs(out - ref).max().item()
    c = caches[0]
    assert c.n_sink == min(sinks, len(toks)) and c.k_sink.dtype == mx.float16
    stored = c.n_sink + c.k_store.length + (0 if c.k_exact is None else c.k_exact.shape[2])
    assert stored == c.offset == len(toks)


@pytest.mark.parametrize("method", QUANT_METHODS)
def test_every_method_has_sinks(tiny_model, method):
    "`sinks=4`: the first 4 keys/values are stored as float16 copies of the exact ones and counted in nbytes."
    toks = [(i * 7 + 3) % 128 for i in range(300)]
    exact = KVCacheBuilder.for_model(tiny_model, KVCacheConfig("fp16"))
    feed(tiny_model, exact, toks, (2, 98, 200))
    caches = KVCacheBuilder.for_model(tiny_model, KVCacheConfig(method, sinks=4, window=0))
    feed(tiny_model, caches, toks, (2, 98, 200))
    for i, (c, e) in enumerate(zip(caches, exact)):
        g = max(c.k_codec.token_group, c.v_codec.token_group)  # codecs that encode token groups keep the rest exact
        assert c.n_sink == 4 and c.k_store.length == 296 - 296 % g
        ek, ev = (e.k_store.arrays["x"][:, :, :4].astype(mx.float16), e.v_store.arrays["x"][:, :, :4].astype(mx.float16))
        same = mx.array_equal if i == 0 else (lambda a, b: mx.allclose(a, b, atol=1e-2))  # deeper layers: tokens 2, 3 read sinks 0, 1 in fp16
        assert same(c.k_sink, ek).item() and same(c.v_sink, ev).item()
    codes = sum(a.nbytes for c in caches for s in (c.k_store, c.v_store) for a in s.arrays.values())
    sink_bytes = len(caches) * 2 * (1 * 2 * 4 * 64 * 2)  # layers x (k, v) x [B, H, 4, D] fp16
    extra = sum(getattr(cd, "mu", None).nbytes for c in caches for cd in (c.k_codec, c.v_codec) if getattr(cd, "mu", None) is not None)
    left = sum(a.nbytes for c in caches for a in (c.k_exact, c.v_exact) if a is not None)  # an incomplete token group
    assert cache_report(caches)["nbytes"] == codes + sink_bytes + extra + left


def test_sinks_trim_below_and_continue(tiny_model):
    "Trimming into the sink tokens and continuing equals feeding the kept prefix afresh."
    cfg = KVCacheConfig("turboquant", key_bits=3, value_bits=3, sinks=6, window=2, center=True)
    toks = list(range(10, 60))
    a = KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, a, toks[:20], (4, 16))  # the first 4 in their own step, as in `b`
    assert [c.trim(16) for c in a] == [16, 16] and a[0].n_sink == 4 and a[0].offset == 4
    out_a = feed(tiny_model, a, toks[4:], (3, 1, 42))
    b = KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, b, toks[:4], (4,))
    assert mx.array_equal(out_a, feed(tiny_model, b, toks[4:], (3, 1, 42))).item()


@pytest.mark.parametrize("method", ["affine", "turboquant", "q4_0"])
def test_sinks_save_load_and_tamper(tiny_model, tmp_path, method):
    cfg = KVCacheConfig(method, sinks=5)
    caches = KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 120 + 3 for i in range(100)], (90, 10))
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches)
    loaded = load_prompt_cache(f)
    assert loaded[0].n_sink == 5
    assert mx.array_equal(feed(tiny_model, caches, [7, 8], (2,)), feed(tiny_model, loaded, [7, 8], (2,))).item()
    st = dict(caches[0].state); st["k_sink"] = st["k_sink"][:, :, :3]; st["v_sink"] = st["v_sink"][:, :, :3]
    seal_state(st)  # past the checksum (which alone refuses an edited file): the structural check behind it
    fresh = cfg.make_cache()
    with pytest.raises(ValueError, match="sink tokens stored"):
        fresh.state = st


def test_sinks_option_validated():
    for m in QUANT_METHODS:
        with pytest.raises(ValueError, match="sinks=-1"): KVCacheConfig(m, sinks=-1)
        with pytest.raises(ValueError, match="sinks=2.0"): KVCacheConfig(m, sinks=2.0)
    with pytest.raises(ValueError, match="sinks"): KVCacheConfig("fp16", sinks=4)  # nothing to keep exact


def test_attention_probe_aligns_codes_after_sinks(tiny_model):
    "The harness's per-layer q·k error still finds the codes' positions when sink tokens come first."
    from veloxquant.eval import decode_run
    toks = [(i * 5 + 1) % 128 for i in range(120)]
    run = decode_run(tiny_model, KVCacheConfig("turboquant", key_bits=4, value_bits=4, sinks=4, window=0), toks, 8, attn_probe=2)
    assert all(a["score_rel_err"] is not None and 0 < a["score_rel_err"] < 0.5 for a in run["attn"]), run["attn"]
    lossless_run = decode_run(tiny_model, KVCacheConfig("q8_0", sinks=4, window=0), toks, 8, attn_probe=2)
    assert all(a["score_rel_err"] < 0.05 for a in lossless_run["attn"]), lossless_run["attn"]
