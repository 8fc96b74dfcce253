"""The mlx-lm cache contract, the dispatcher and the reference attention (tiny random model + real model)."""
import json
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache, make_prompt_cache

import veloxquant as vq
from veloxquant.cache import seal_state
from veloxquant.attention import blockwise_attention, dense_blocks, dispatch, install, uninstall
from veloxquant.eval import prefill


def feed(model, caches, toks, chunks):
    outs, s = [], 0
    for c in chunks:
        outs.append(model(mx.array(toks[s:s + c])[None], cache=caches)); s += c
    return mx.concatenate(outs, axis=1)


def kl(p_logits, q_logits):
    p = p_logits - mx.logsumexp(p_logits, -1, keepdims=True)
    q = q_logits - mx.logsumexp(q_logits, -1, keepdims=True)
    return (mx.exp(p) * (p - q)).sum(-1)


# ---------------------------------------------------------------- reference attention
@settings(max_examples=25, deadline=None)
@given(rep=st.sampled_from([1, 3, 4, 8]), D=st.sampled_from([64, 80, 128]), L=st.integers(1, 9),
       hist=st.integers(0, 300), block=st.integers(1, 128), mask=st.sampled_from(["none", "causal", "bool", "add"]),
       sinks=st.booleans(), B=st.integers(1, 2))
def test_blockwise_equals_sdpa(rep, D, L, hist, block, mask, sinks, B):
    Hkv = 2
    S = hist + L
    q = mx.random.normal((B, Hkv * rep, L, D)); k = mx.random.normal((B, Hkv, S, D)); v = mx.random.normal((B, Hkv, S, D))
    m = {"none": None, "causal": "causal"}.get(mask)
    if mask == "bool":
        m = mx.random.uniform(shape=(B, 1, L, S)) > 0.3
        m = m | (mx.arange(S)[None, None, None] == S - 1)  # at least one visible key per row
    if mask == "add": m = mx.random.normal((1, Hkv * rep, L, S))
    sk = mx.random.normal((Hkv * rep,)) if sinks else None
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=m, sinks=sk)
    out = blockwise_attention(q, hist, dense_blocks(k[:, :, :hist], v[:, :, :hist], block), k[:, :, hist:], v[:, :, hist:],
                              D ** -0.5, m, sk)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-4, rtol=2e-4)


# ---------------------------------------------------------------- tiny model: contract
def test_fp16_bit_identical_tiny(tiny_model):
    toks = list(range(3, 60))
    ref = feed(tiny_model, [KVCache() for _ in tiny_model.layers], toks, (40, 1, 1, 15))
    out = feed(tiny_model, vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("fp16")), toks, (40, 1, 1, 15))
    assert mx.array_equal(ref, out).item()


@pytest.mark.parametrize("spec", ["fp16", "fp16:reference=true", "affine:key_bits=4,value_bits=4",
                                  "affine:key_bits=3,value_bits=2,group_size=32,window=7", "kivi", "kivi:group_size=128,value_group=64,window=0",
                                  "kivi_sink", "kitty", "gear:outlier_pct=1.0", "gear:key_bits=4,value_bits=4,rank=2,window=32",
                                  "rabitq:window=7",
                                  "rabitq:value_bits=2,value_group=32,window=0,rotation=hadamard",
                                  "nsnquant:key_bits=1,value_bits=2,window=7", "nsnquant:window=0",
                                  "xquant:window=7", "xquant:window=0,key_bits=1",
                                  "minicache:window=7,start=0.0", "minicache:window=0,start=0.0,gamma=0.5",
                                  "cachegen:window=8", "cachegen:window=0,chunk=4,early_bits=8",
                                  "xkv:layers=2,key_rank=16,value_rank=24", "svdq:min_tokens=64,window=16", "kvtc:min_tokens=64,window=16",
                                  "svdq:schedule=8-2-0-0-0-0-0-0,value_bits=2,group_size=32,window=7,sinks=3",
                                  "snapkv:budget=0.3,quantizer=turboquant:key_bits=3+value_bits=3", "adakv:budget=0.25,window=8",
                                  "morphkv:budget=0.4,window=8", "morphkv:capacity=40,window=4,fusion=max",
                                  "morphkv:budget=0.4,window=8,quantizer=turboquant:key_bits=3+value_bits=3",
                                  "nestedkv:budget=0.3,window=8,block=16", "nestedkv:budget=0.3,heads=adaptive",
                                  "zipcache:group_size=32,window=32", "zipcache:group_size=64,window=64,salient=0.5,sinks=2",
                                  "chunkkv:budget=0.3,window=8,chunk=5", "chunkkv:budget=0.3,window=8,chunk=5,reuse=2", "curdkv:budget=0.4", "keyformer:budget=0.5",
                                  "cam:budget=0.5,merge_budget=4", "cam:budget=0.4,quantizer=turboquant:key_bits=3+value_bits=3",
                                  "squeeze:budget=0.5",
                                  "amc:group_size=32,window=32,min_tokens=64", "amc:top=0.25,mid=0.5,bits_low=2,rank_low=0.25,window=64,sinks=3"])
def test_save_load_roundtrip_bit_exact(tiny_model, tmp_path, spec):
    from veloxquant.core import parse_method
    cfg = parse_method(spec)
    caches = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 120 + 3 for i in range(300)], (290, 1, 1, 8))
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches, {"note": "x"})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta == {"note": "x"} and [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.offset for c in loaded] == [c.offset for c in caches] == [300, 300]
    nxt = [7, 8, 9]
    assert mx.array_equal(feed(tiny_model, caches, nxt, (3,)), feed(tiny_model, loaded, nxt, (3,))).item()
    assert mx.array_equal(feed(tiny_model, caches, [1], (1,)), feed(tiny_model, loaded, [1], (1,))).item()


CALIBRATED = ["vecinfer:key_bits=1,value_bits=2,window=7,iters=3", "vecinfer:key_bits=2,value_bits=1,window=0,iters=3",
              "comm_vq:key_bits=1,value_bits=2,window=7,em=1,iters=3", "comm_vq:key_bits=2,value_bits=1,window=0,em=1,iters=3",
              "a2ats:sel_bits=1,top_k=40,window=7,iters=3", "a2ats:sel_bits=2,key_bits=2,value_bits=2,top_k=40,window=16,iters=3",
              "kvquant", "kvquant:key_bits=2,value_bits=2,window=8,key_outliers=0",
              "kvquant:value_outliers=0,value_rotation=true,mixed=true,mixed_width=3.25,window=4", "skvq",
              "skvq:key_bits=4,value_bits=3,window=0,sinks=0,reorder=false",
              "ratequant:bits=2.5,window=7", "ratequant:base=affine,bits=3,window=0,granularity=layer",
              "palu", "palu:ratio=0.25,bits=16,lrd_heads=1,window=8,sinks=2", "palu:ratio=0.75,bits=2,search=uniform,window=0", "palu:sinks=3"]


def calibrated(model, spec, tmp_path):
    "`spec`'s config bound to an artifact calibrated on `model` (256 token ids) in `tmp_path`."
    from veloxquant.core import parse_method
    from veloxquant.calibrate import calibrate
    cfg = parse_method(spec)
    path = calibrate(cfg, model, tokens=[(7 * i) % 120 + 3 for i in range(256)], window=128, out=tmp_path / "cal.safetensors",
                     progress=False)
    return vq.KVCacheConfig(cfg.method, **{**cfg.options.to_dict(), "path": str(path)})


@pytest.mark.parametrize("spec", CALIBRATED)
def test_calibrated_save_load_trim(tiny_model, tmp_path, spec):
    "Calibrated methods: save/load round trip continues bit-exactly; trimming the last step then continuing equals a fresh run."
    cfg = calibrated(tiny_model, spec, tmp_path)
    caches = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, caches, [i % 120 + 3 for i in range(300)], (290, 1, 1, 8))
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches, {"note": "x"})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta == {"note": "x"} and [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.offset for c in loaded] == [c.offset for c in caches] == [300, 300]
    assert mx.array_equal(feed(tiny_model, caches, [7, 8, 9], (3,)), feed(tiny_model, loaded, [7, 8, 9], (3,))).item()
    toks = list(range(10, 70))
    a = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, a, toks, (40, 5)); assert all(c.is_trimmable() for c in a)
    assert [c.trim(5) for c in a] == [5, 5] and a[0].offset == 40
    out_a = feed(tiny_model, a, toks[40:], (3, 1, 16))
    b = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, b, toks, (40,))
    assert mx.array_equal(out_a, feed(tiny_model, b, toks[40:], (3, 1, 16))).item()


def test_corrupt_state_refused(tiny_model):
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("affine"))
    feed(tiny_model, caches, list(range(20)), (20,))
    st_ = dict(caches[0].state); st_["offset"] = 25
    with pytest.raises(ValueError, match="corrupt cache state"):
        type(caches[0]).from_state(st_)


@pytest.mark.parametrize("spec", ["fp16", "affine:key_bits=4,value_bits=4", "rabitq", "rabitq:window=0", "xquant",
                                  "minicache:start=0.0", "xkv:layers=2", "svdq:min_tokens=16,window=8",
                                  "kvtc:min_tokens=16,window=8,sinks=0", "amc:group_size=32,window=32,min_tokens=16"])
def test_trim_then_continue(tiny_model, spec):
    from veloxquant.core import parse_method
    cfg = parse_method(spec); toks = list(range(10, 70))
    a = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, a, toks, (40, 5)); assert all(c.is_trimmable() for c in a)
    assert [c.trim(5) for c in a] == [5, 5] and a[0].offset == 40
    out_a = feed(tiny_model, a, toks[40:], (3, 1, 16))
    b = vq.KVCacheBuilder.for_model(tiny_model, cfg)
    feed(tiny_model, b, toks, (40,))
    out_b = feed(tiny_model, b, toks[40:], (3, 1, 16))
    assert mx.array_equal(out_a, out_b).item()


def test_dispatcher_leaves_other_caches_alone(tiny_model):
    install(); install()  # idempotent
    import mlx_lm.models.llama as llama_mod, mlx_lm.models.base as base
    assert llama_mod.scaled_dot_product_attention is dispatch and base.scaled_dot_product_attention is dispatch
    toks = list(range(30))
    ref_q = None
    for cache_fn in (lambda: [KVCache() for _ in tiny_model.layers],):
        with_dispatch = feed(tiny_model, cache_fn(), toks, (20, 1, 9))
        uninstall()
        try:
            without = feed(tiny_model, cache_fn(), toks, (20, 1, 9))
        finally:
            install()
        assert mx.array_equal(with_dispatch, without).item()
    # mlx-lm's own QuantizedKVCache still works (routes on `bits`), and veloxquant caches never expose it
    qc = [KVCache().to_quantized(64, 8) for _ in tiny_model.layers]
    feed(tiny_model, qc, toks, (20, 1))
    for spec in ("fp16", "affine"):
        c = vq.KVCacheConfig(spec).make_cache()
        assert not any(hasattr(c, a) for a in ("bits", "group_size", "to_quantized"))


def test_compress_and_no_state_leak_tiny(tiny_model):
    vq.compress(tiny_model, vq.KVCacheConfig("affine", key_bits=4, value_bits=4))
    try:
        c1, c2 = make_prompt_cache(tiny_model), make_prompt_cache(tiny_model)
        assert c1[0] is not c2[0] and type(c1[0]).__name__ == "VQCache" and c1[0].offset == 0
    finally:
        vq.decompress(tiny_model)
    assert not hasattr(tiny_model, "make_cache") or type(make_prompt_cache(tiny_model)[0]) is KVCache


def test_model_that_bypasses_dispatcher_is_refused(tiny_model, monkeypatch):
    import mlx_lm.models.llama as llama_mod
    monkeypatch.setattr(llama_mod, "scaled_dot_product_attention",
                        lambda q, k, v, cache, scale, mask, sinks=None: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    monkeypatch.delattr(tiny_model, "_vq_verdict", raising=False)  # the verdict of an earlier test is kept on the model
    with pytest.raises(ValueError, match="computes attention without"):
        vq.compress(tiny_model, vq.KVCacheConfig("affine"))
    assert not hasattr(tiny_model, "_vq_config")


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, msg", [
    (dict(method="nope"), "method='nope' is not a known method"),
    (dict(method=3), "method=3 is not a known method"),
    (dict(method="affine", key_bits=7), r"key_bits=7 is not allowed; allowed values: \[2, 3, 4, 5, 6, 8\]"),
    (dict(method="affine", value_bits=1), "value_bits=1"),
    (dict(method="affine", key_bits="4"), "key_bits='4'"),
    (dict(method="affine", key_bits=4.0), "key_bits=4.0"),
    (dict(method="affine", group_size=16), "group_size=16"),
    (dict(method="affine", window=-1), "window=-1 is out of range"),
    (dict(method="affine", window="8"), "window='8' must be an integer"),
    (dict(method="affine", bits=4), "bits=4: unknown option for method 'affine'; allowed options"),
    (dict(method="fp16", reference=1), "reference=1 must be True or False"),
])
def test_bad_input(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        vq.KVCacheConfig(**kwargs)


def test_group_size_must_divide_head_dim(tiny_model):
    cfg = vq.KVCacheConfig("affine", group_size=128)  # head_dim 64
    with pytest.raises(ValueError, match="group_size=128 does not divide head_dim=64"):
        feed(tiny_model, vq.KVCacheBuilder.for_model(tiny_model, cfg), [1, 2], (2,))


def test_sizes_are_honest(tiny_model):
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("affine", key_bits=4, value_bits=4, window=0))  # window 0: every token coded
    feed(tiny_model, caches, [i % 128 for i in range(512)], (512,))
    rep = vq.cache_report(caches)
    # 2 layers x B1 x 2 heads x 512 tokens x (64 + 64) elements; 4 bits + fp16 scale and bias per 64
    assert rep["elements"] == 2 * 2 * 512 * 128
    assert rep["nbytes"] == sum(a.nbytes for c in caches for s in (c.k_store, c.v_store) for a in s.arrays.values())
    assert rep["bits_per_element"] == pytest.approx(4.5)
    assert rep["compression_ratio"] == pytest.approx(16 / 4.5)


# ---------------------------------------------------------------- the real model
def _decode_logits(model, caches, toks, n_prefill):
    last = prefill(model, caches, toks[:n_prefill])
    outs = [last[None]]
    for t in toks[n_prefill:]:
        outs.append(model(mx.array([[t]]), cache=caches)[0, -1:].astype(mx.float32))
    return mx.concatenate(outs)


def test_real_fp16_bit_identical(real):
    model, _, toks = real
    ref = _decode_logits(model, [KVCache() for _ in model.layers], toks[:300], 270)
    out = _decode_logits(model, vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("fp16")), toks[:300], 270)
    assert mx.array_equal(ref, out).item()


def test_real_affine_kl_ordering(real):
    model, _, toks = real
    t = toks[:320]
    ref = _decode_logits(model, [KVCache() for _ in model.layers], t, 256)
    kls = {}
    for b in (8, 4):
        out = _decode_logits(model, vq.KVCacheBuilder.for_model(model, vq.KVCacheConfig("affine", key_bits=b, value_bits=b)), t, 256)
        kls[b] = kl(ref, out).mean().item()
    print("KL vs fp16:", kls)
    assert kls[8] < 2e-3          # 8-bit: next-token distribution essentially unchanged
    assert kls[4] > 3 * kls[8]    # 4-bit measurably further


def test_real_generate_no_state_leak(real):
    model, tokenizer, toks = real
    vq.compress(model, vq.KVCacheConfig("affine", key_bits=8, value_bits=8))
    try:
        p1, p2 = toks[:200], toks[300:420]
        a = mlx_lm.generate(model, tokenizer, prompt=p1, max_tokens=8)
        mlx_lm.generate(model, tokenizer, prompt=p2, max_tokens=8)
        b = mlx_lm.generate(model, tokenizer, prompt=p1, max_tokens=8)
        assert a == b and len(a) > 0
        pc = model.make_cache()
        s = "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, p1, max_tokens=8, prompt_cache=pc))
        assert s == a and pc[0].offset >= 200 and type(pc[0]).__name__ == "VQCache"
    finally:
        vq.decompress(model)


def test_tampered_state_refused(tiny_model):
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig("affine", key_bits=4, value_bits=4, window=0))  # window 0: every token coded
    feed(tiny_model, caches, list(range(20)), (20,))
    st_ = dict(caches[0].state)
    with pytest.raises(ValueError, match="checksum does not match"):  # an edit without a recomputed checksum
        type(caches[0]).from_state(dict(st_, window=5))
    # behind the checksum, the structural checks (a forger who recomputes the checksum)
    bad = dict(st_, config=vq.KVCacheConfig("affine", key_bits=8, value_bits=4, window=0).to_json())
    with pytest.raises(ValueError, match="do not match method 'affine'"):
        type(caches[0]).from_state(seal_state(bad))
    bad = dict(st_, config=vq.KVCacheConfig("fp16", reference=True).to_json())
    with pytest.raises(ValueError, match="do not match method 'fp16'"):
        type(caches[0]).from_state(seal_state(bad))
    with pytest.raises(ValueError, match="window=5"):
        type(caches[0]).from_state(seal_state(dict(st_, window=5)))


def test_empty_after_trim(tiny_model):
    c = vq.KVCacheConfig("affine").make_cache()
    assert c.empty()
    feed(tiny_model, [c, vq.KVCacheConfig("affine").make_cache()], [1, 2, 3], (3,))
    assert not c.empty() and c.trim(3) == 3 and c.empty()


def test_fused_decode_hook_is_checked(tiny_model):
    "A custom `fused_decode` hook: not callable → ValueError at construction; a wrong result → ValueError naming the shape."
    import pytest
    from veloxquant.cache import VQCache
    from veloxquant.methods.affine import AffineCodec
    cfg = vq.KVCacheConfig("affine", window=0)  # window 0: the 20 prefill tokens are codes when the decode step comes
    with pytest.raises(ValueError, match="fused_decode must be callable"):
        VQCache(cfg, lambda kd, vd: (AffineCodec(kd, 4, 64), AffineCodec(vd, 4, 64)), fused_decode=5)
    def caches(hook):
        cs = vq.KVCacheBuilder.for_model(tiny_model, cfg)
        for c in cs: c.fused_decode = hook
        tiny_model(mx.array([[3] * 20]), cache=cs)
        return cs
    cs = caches(lambda kc, vc: (lambda q, *a: mx.zeros((1, 1, 1, 7))))
    with pytest.raises(ValueError, match="expected a floating array shaped like the queries"):
        tiny_model(mx.array([[4]]), cache=cs)
    cs = caches(lambda kc, vc: 5)
    with pytest.raises(ValueError, match="must return a function or None"):
        tiny_model(mx.array([[4]]), cache=cs)
    ref = vq.KVCacheBuilder.for_model(tiny_model, cfg); tiny_model(mx.array([[3] * 20]), cache=ref)
    cs = caches(lambda kc, vc: (lambda *a: None))  # None: the reference path, same result
    assert mx.allclose(tiny_model(mx.array([[4]]), cache=cs), tiny_model(mx.array([[4]]), cache=ref)).item()
