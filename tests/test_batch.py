"""Batch generation with compressed caches: mlx-lm's batch contract (merge/prepare/finalize/filter/extend/
extract/make_mask/trim/state), batch_generate / BatchGenerator tokens equal to one-by-one runs."""
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step, stream_generate
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import veloxquant as vq
from veloxquant.batch import VQBatchCache, FP16BatchCache, merge_caches, roll_rows
from veloxquant.core import parse_method

# every registered method at its default settings, plus fp16 windows on two methods and the fp16 reference path
from veloxquant.evict import eviction_methods
from veloxquant.group import GroupedCache
from conftest import uncalibrated, keeps_sequence_state
EVICTION = uncalibrated(eviction_methods())  # refused in batches (test_eviction_refuses_batch); calibrated ones need an artifact
CROSS_LAYER = [m for m in vq.method_ids() if isinstance(vq.KVCacheConfig(m).make_cache(), GroupedCache)]  # refused (test_cross_layer_refuses_batch)
# refused when the batch cache is built: codecs that encode token groups, or keep per-sequence statistics
GROUPED = {m for m in vq.method_ids() if getattr(vq.get_method(m).config_cls, "token_grouped", False) or keeps_sequence_state(m)}
SPECS = [*(m for m in uncalibrated(vq.method_ids()) if m not in EVICTION and m not in CROSS_LAYER), "fp16:reference=True", "affine:key_bits=4,value_bits=4,window=8",
         "turboquant:window=16", "vecinfer:iters=3",
         "ratequant:bits=2.5,window=16", "ratequant:base=affine,bits=3"]  # calibrated methods: calibrated on the model in the test
PROMPTS = [[(7 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate([37, 5, 70, 18])]


@pytest.fixture(scope="module")
def sharp_model():
    """A 2-layer random-weight Llama (GQA 4:2, head_dim 64) whose q/k and output weights are scaled ×4, so
    attention is peaked and greedy tokens are varied with clear top-1 margins (an unscaled random model
    repeats one token or sits on near-ties)."""
    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
                           tie_word_embeddings=False, head_dim=64)
    mx.random.seed(0)
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 4
    for l in model.model.layers:
        l.self_attn.q_proj.weight = l.self_attn.q_proj.weight * 4
        l.self_attn.k_proj.weight = l.self_attn.k_proj.weight * 4
    mx.eval(model.parameters())
    yield model
    vq.decompress(model)


def one_by_one(model, prompt, n, prefill_step_size=2048):
    "Greedy tokens and their log-probabilities from mlx-lm's own single-sequence `generate_step`."
    toks, lps = [], []
    for (t, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=model.make_cache(),
                                        prefill_step_size=prefill_step_size), range(n)):
        toks.append(int(t)); lps.append(float(lp[t]))
    return toks, lps


def batched(model, prompts, max_tokens, caches=None, **kw):
    "Greedy tokens, log-probabilities and final per-sequence caches from mlx-lm's `BatchGenerator`."
    g = BatchGenerator(model, stop_tokens=[], **kw)
    uids = g.insert(prompts, max_tokens, caches=caches)
    toks, lps, out = {u: [] for u in uids}, {u: [] for u in uids}, {}
    while responses := g.next_generated():
        for r in responses:
            toks[r.uid].append(r.token); lps[r.uid].append(float(r.logprobs[r.token]))
            if r.finish_reason: out[r.uid] = r.prompt_cache
    g.close()
    return [toks[u] for u in uids], [lps[u] for u in uids], [out[u] for u in uids]


def test_fp16_batch_is_stock_mlx_lm(sharp_model):
    "fp16 through veloxquant batches with mlx-lm's own BatchKVCache: tokens and log-probabilities bit-identical to stock."
    vq.decompress(sharp_model)
    stock = batched(sharp_model, PROMPTS, [12, 7, 12, 3], prefill_batch_size=2, completion_batch_size=3)
    vq.compress(sharp_model, vq.KVCacheConfig("fp16"))
    ours = batched(sharp_model, PROMPTS, [12, 7, 12, 3], prefill_batch_size=2, completion_batch_size=3)
    assert ours[0] == stock[0] and ours[1] == stock[1]
    assert ours[0] == [one_by_one(sharp_model, p, n)[0] for p, n in zip(PROMPTS, [12, 7, 12, 3])]
    assert all(type(c[0]).__name__ == "FP16Cache" for c in ours[2])  # extract gives veloxquant caches back


@pytest.mark.parametrize("spec", SPECS)
def test_batch_equals_one_by_one(sharp_model, spec, tmp_path):
    """Tokens of BatchGenerator (prompts of 37/5/70/18 tokens, different max_tokens so rows leave at different
    steps; all at once, with continuous batching: 2 prompts per prefill, 3 decoding rows, and with 16-token
    prefill chunks, so later chunks attend over compressed history while rows are split off) equal one-by-one
    generation with the same method and chunking. Log-probabilities agree to float32 reduction order only: padded rows
    reduce over more (masked) positions and blockwise softmax blocks start at other tokens, so bitwise
    equality of logits is not possible; tokens (greedy) are."""
    from veloxquant.calibrate import calibration_of, calibrate
    cfg = parse_method(spec)
    if calibration_of(cfg.method) is not None:  # a calibrated method: calibrate this model first (a temporary artifact)
        path = calibrate(cfg, sharp_model, tokens=[(5 * i + 1) % 128 for i in range(256)], window=128, progress=False,
                         out=tmp_path / "calibration.safetensors")
        cfg = vq.KVCacheConfig.from_dict({**cfg.to_dict(), "path": str(path)})
    vq.compress(sharp_model, cfg)
    n = [12, 7, 12, 3]
    if spec in GROUPED:  # methods whose codecs encode token groups are refused when the batch cache is built
        with pytest.raises(ValueError, match="encodes tokens in groups|sink tokens are not supported|per-sequence statistics|batch generation is refused|has no batch cache"):
            batched(sharp_model, PROMPTS, n)
        return
    refs = {step: [one_by_one(sharp_model, p, k, step) for p, k in zip(PROMPTS, n)] for step in (2048, 16)}
    for kw in ({}, dict(prefill_batch_size=2, completion_batch_size=3), dict(prefill_step_size=16, prefill_batch_size=3)):
        ref = refs[kw.get("prefill_step_size", 2048)]
        toks, lps, caches = batched(sharp_model, PROMPTS, n, **kw)
        assert toks == [r[0] for r in ref], (spec, kw)
        np.testing.assert_allclose(np.concatenate(lps), np.concatenate([r[1] for r in ref]), atol=2e-3)
        assert [c[0].offset for c in caches] == [len(p) + k for p, k in zip(PROMPTS, n)]  # the last token emitted was fed too
    if spec != "fp16":
        assert isinstance(merge_caches([c[0] for c in caches]), VQBatchCache)


@pytest.mark.parametrize("spec", ["comm_vq:em=1,iters=3", "a2ats:top_k=16,iters=3"])
def test_pre_rope_methods_refuse_batch(sharp_model, spec, tmp_path):
    "Methods whose codes sit at positions counted from the sequence start (`PreRopeCache`) refuse batch generation."
    from veloxquant.calibrate import calibrate
    cfg = parse_method(spec)
    path = calibrate(cfg, sharp_model, tokens=[(5 * i + 1) % 128 for i in range(256)], window=128, progress=False,
                     out=tmp_path / "calibration.safetensors")
    vq.compress(sharp_model, vq.KVCacheConfig.from_dict({**cfg.to_dict(), "path": str(path)}))
    with pytest.raises(ValueError, match="does not support batch generation"):
        batched(sharp_model, PROMPTS, [3, 3, 3, 3])


@pytest.mark.parametrize("spec", EVICTION)
def test_eviction_refuses_batch(sharp_model, spec):
    "Eviction methods keep different tokens per sequence and head: mlx-lm's batch merge is refused before any token runs."
    vq.compress(sharp_model, parse_method(spec))
    with pytest.raises(ValueError, match="do not support batch generation"):
        batched(sharp_model, PROMPTS, [3, 3, 3, 3])
    with pytest.raises(ValueError, match="no batch cache"):  # veloxquant.batch's own merge refuses them too
        merge_caches([sharp_model.make_cache()[0] for _ in range(2)])


@pytest.mark.parametrize("spec", CROSS_LAYER)
def test_cross_layer_refuses_batch(sharp_model, spec):
    "Methods with state shared across layers (a cache group) have no group merge: mlx-lm's batch merge is refused before any token runs."
    vq.compress(sharp_model, parse_method(spec))
    with pytest.raises(ValueError, match="no group merge exists"):
        batched(sharp_model, PROMPTS, [3, 3, 3, 3])


def test_compression_changes_tokens(sharp_model):
    "The batch path really attends over codes: 2-bit affine gives other tokens than fp16 on the same prompts."
    vq.compress(sharp_model, vq.KVCacheConfig("fp16"))
    a = batched(sharp_model, PROMPTS, [12] * 4)[0]
    vq.compress(sharp_model, vq.KVCacheConfig("affine", key_bits=2, value_bits=2, window=0))  # window 0: short prompts are coded
    b = batched(sharp_model, PROMPTS, [12] * 4)[0]
    assert a != b


def _filled(model, spec, prompts):
    "Per-sequence caches (one list per prompt) after prefilling each prompt alone."
    vq.compress(model, parse_method(spec))
    out = []
    for p in prompts:
        c = model.make_cache(); model(mx.array(p)[None], cache=c); mx.eval([x.state for x in c]); out.append(c)
    return out


def _same(a, b):
    sa, sb = a.state, b.state
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], dict):
            assert all(mx.array_equal(sa[k][n], sb[k][n]).item() for n in sa[k])
        elif isinstance(sa[k], mx.array):
            assert mx.array_equal(sa[k], sb[k]).item(), k
        else:
            assert sa[k] == sb[k], k


@pytest.mark.parametrize("spec", ["affine:key_bits=4,value_bits=4,window=8", "turboquant", "q4_0", "fp16:reference=True"])
def test_merge_extract_filter_extend_are_exact(sharp_model, spec):
    "merge → extract gives every sequence's codes and window back bit for bit, also after filter and extend."
    caches = _filled(sharp_model, spec, PROMPTS)
    b = merge_caches([c[0] for c in caches])
    assert isinstance(b, VQBatchCache) and b.size() == 70 and b.offset.tolist() == [37, 5, 70, 18]
    assert b.left_padding.tolist() == [33, 65, 0, 52]
    for i, c in enumerate(caches): _same(b.extract(i), c[0])
    b.filter([3, 0])  # drops the 33 padding columns both remaining rows have
    assert b.size() == 37 and b.left_padding.tolist() == [19, 0]
    _same(b.extract(0), caches[3][0]); _same(b.extract(1), caches[0][0])
    other = merge_caches([caches[1][0], caches[2][0]])
    b.extend(other)
    assert b.offset.tolist() == [18, 37, 5, 70] and b.size() == 70
    for i, j in enumerate([3, 0, 1, 2]): _same(b.extract(i), caches[j][0])
    # padding-aware mask: no row sees its left padding, causal over the new tokens
    m = b.make_mask(2)
    assert m.shape == (4, 1, 2, 72) and m.dtype == mx.bool_
    assert [int(m[i, 0, 0].sum()) for i in range(4)] == [19, 38, 6, 71]


def test_state_round_trip(sharp_model, tmp_path):
    "save_prompt_cache / load_prompt_cache of batch caches (compressed and fp16) restore them exactly."
    for spec in ["affine:key_bits=4,value_bits=4,window=8", "fp16"]:
        caches = _filled(sharp_model, spec, PROMPTS)
        batch = [merge_caches([c[l] for c in caches]) for l in range(2)]
        f = str(tmp_path / "b.safetensors")
        save_prompt_cache(f, batch)
        back = load_prompt_cache(f)
        assert [type(c) for c in back] == [type(c) for c in batch]
        for x, y in zip(batch, back):
            if isinstance(x, VQBatchCache): _same(x, y)
            else: assert all(mx.array_equal(u, v).item() for u, v in zip(x.state[:4], y.state[:4])) and x.state[4:6] == y.state[4:6] and mx.array_equal(x.state[6], y.state[6]).item()
        # the loaded batch keeps decoding like the original
        tok = mx.array([[1], [2], [3], [4]])
        a = sharp_model(tok, cache=batch); b_ = sharp_model(tok, cache=back)
        assert mx.array_equal(a, b_).item()
    st = dict(batch[0].state) if isinstance(batch[0], VQBatchCache) else None
    caches = _filled(sharp_model, "affine", PROMPTS)
    b = merge_caches([c[0] for c in caches]); st = dict(b.state); st["idx"] = 71
    with pytest.raises(ValueError, match="corrupt cache state"):
        VQBatchCache.from_state(st)


def test_trim_and_prepare_errors(sharp_model):
    caches = _filled(sharp_model, "affine", PROMPTS)
    b = merge_caches([c[0] for c in caches])
    assert b.is_trimmable() and b.trim(3) == 3 and b.offset.tolist() == [34, 2, 67, 15] and b.size() == 67
    with pytest.raises(ValueError, match="left_padding can only be added to an empty"):
        b.prepare(left_padding=[1, 1, 1, 1])
    vq.compress(sharp_model, vq.KVCacheConfig("affine"))
    with pytest.raises(ValueError, match="cannot batch caches of different methods"):
        merge_caches([caches[0][0], vq.KVCacheConfig("affine", key_bits=8).make_cache()])


def test_refused_configurations(sharp_model):
    "turboquant center=True keeps a per-sequence mean set by the first chunk: not batchable, not trimmable."
    caches = _filled(sharp_model, "turboquant:center=True", PROMPTS[:2])
    assert not caches[0][0].is_trimmable()
    with pytest.raises(ValueError, match="sequence_state"):
        merge_caches([c[0] for c in caches])
    assert vq.KVCacheConfig("affine", window=4).make_cache().is_trimmable()  # a window trims (see test_prefix_reuse.py)


@pytest.mark.parametrize("method", [m for m in vq.method_ids() if m not in CROSS_LAYER])  # cross-layer methods never batch
def test_padding_filler_is_finite(method):
    "Codes of zero vectors (what padding positions hold) decode to finite numbers for every method."
    from veloxquant.calibrate import calibration_of
    if calibration_of(method) is not None: pytest.skip("needs a calibration artifact (codes of zeros: see tests/test_calibrate.py)")
    c = vq.KVCacheConfig(method).make_cache()
    kc, vc = c._make_codecs(64, 64)
    for codec in (kc, vc):
        blk = codec.encode(mx.zeros((2, 2, 5 if codec.token_group == 1 else codec.token_group, 64), mx.float16))
        assert mx.isfinite(codec.decode(blk)).all().item()


def test_roll_rows():
    a = mx.arange(2 * 1 * 5).reshape(2, 1, 5)
    assert roll_rows(a[..., None], mx.array([0, 2]))[..., 0].tolist() == [[[0, 1, 2, 3, 4]], [[8, 9, 5, 6, 7]]]


@pytest.mark.slow
def test_real_model_batch_generate(real):
    """batch_generate on the real default model, three chat prompts of different lengths: the tokens equal
    one-by-one stream_generate with the same method (affine 8/8), and fp16 batches like stock mlx-lm.

    Why not every method bit for bit here: batching changes float32 rounding in the model itself (GEMM for
    B rows vs GEMV for one; stock mlx-lm's fp16 batch vs single log-probabilities differ by ~4e-6 on these
    prompts). A quantizer maps such a 1e-6 difference to another code whenever a value sits on a rounding
    boundary, so 4-bit codes of padded rows can differ in a few elements and a low-margin step can pick
    another token (measured: affine 4/4 diverges at token 12 of one prompt, log-prob differences up to
    0.02 before). The exact properties are tested on the tiny model: merge/extract/filter/extend keep
    every code bit for bit, and greedy tokens equal one-by-one runs for every registered method."""
    model, tok, _ = real
    qs = ["What is the capital of France?", "Name three primary colors.",
          "Write one sentence about the history of the Roman Empire and its fall in the fifth century."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in qs]
    try:
        vq.decompress(model)
        stock = batch_generate(model, tok, prompts, max_tokens=12, return_token_ids=True, return_logprobs=True)
        vq.compress(model, vq.KVCacheConfig("fp16"))
        ours = batch_generate(model, tok, prompts, max_tokens=12, return_token_ids=True, return_logprobs=True)
        assert ours.token_ids == stock.token_ids and ours.logprobs == stock.logprobs
        vq.compress(model, vq.KVCacheConfig("affine", key_bits=8, value_bits=8, window=0))  # window 0: these short prompts get coded
        res = batch_generate(model, tok, prompts, max_tokens=12, return_token_ids=True, return_prompt_caches=True)
        for p, ids in zip(prompts, res.token_ids):
            single = [r.token for r in stream_generate(model, tok, p, max_tokens=12, prompt_cache=model.make_cache())]
            assert ids == [t for t in single if t not in tok.eos_token_ids]
        assert "Paris" in res.texts[0]
        rep = vq.cache_report(res.caches[0])
        assert rep["compression_ratio"] > 1.5  # the returned caches are compressed (8-bit codes vs 16-bit)
    finally:
        vq.decompress(model)


# ------------------------------------------------------------------ property test of the batch contract
from hypothesis import given, settings, strategies as st


def _single(cfg, n, seed):
    "A per-sequence cache of `cfg` holding n random tokens (keys/values [1, 2, n, 64], float32), flushed."
    c = cfg.make_cache()
    if n:
        k = mx.random.normal((1, 2, n, 64), key=mx.random.key(seed)); v = mx.random.normal((1, 2, n, 64), key=mx.random.key(seed + 1))
        c.update_and_fetch(k, v); c._flush()
    return c


def _held(c):
    "(offset, codes per name, fp16 window) of a per-sequence cache, empty parts as None."
    n = c.k_store.length
    codes = {f"{s}/{k}": a for s in ("k", "v") for k, a in getattr(c, f"{s}_store").slice(0, n).items()} if n else {}
    return c.offset, codes, c.k_exact, c.v_exact


def _check_rows(b, singles):
    assert b.offset.tolist() == [s.offset for s in singles]
    for i, s in enumerate(singles):
        o1, c1, k1, v1 = _held(b.extract(i)); o2, c2, k2, v2 = _held(s)
        assert o1 == o2 and c1.keys() == c2.keys()
        assert all(mx.array_equal(c1[k], c2[k]).item() for k in c1)
        for x, y in ((k1, k2), (v1, v2)):
            assert (x is None or x.shape[2] == 0) == (y is None or y.shape[2] == 0)
            if x is not None and y is not None: assert mx.array_equal(x, y).item()


@settings(max_examples=25, deadline=None)
@given(spec=st.sampled_from(["affine:key_bits=4,value_bits=4", "affine:key_bits=3,value_bits=4,window=3", "turboquant:window=5",
                             "q4_0", "qjl", "fp16:reference=True"]),
       first=st.lists(st.integers(0, 30), min_size=1, max_size=4), second=st.lists(st.integers(0, 30), min_size=1, max_size=3),
       steps=st.integers(0, 3), data=st.data())
def test_batch_contract_property(spec, first, second, steps, data):
    """Random merge → decode steps → filter → extend → trim → state round trip: every row always holds
    exactly the codes and window of the same sequence run alone, and batched attention outputs equal the
    single-sequence ones."""
    cfg = parse_method(spec)
    singles = [_single(cfg, n, 10 * i) for i, n in enumerate(first)]
    b = merge_caches(singles)
    if max(first) == 0: singles[0]._ensure_codecs(64, 64)
    _check_rows(b, singles)
    for t in range(steps):  # decode steps with padding masks
        B = len(singles)
        q = mx.random.normal((B, 4, 1, 64), key=mx.random.key(100 + t)); k = mx.random.normal((B, 2, 1, 64), key=mx.random.key(200 + t))
        v = mx.random.normal((B, 2, 1, 64), key=mx.random.key(300 + t))
        mask = b.make_mask(1); b.update_and_fetch(k, v); out = b.attend(q, k, v, 0.125, mask)
        for i, s in enumerate(singles):
            s.update_and_fetch(k[i:i + 1], v[i:i + 1]); ref = s.attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], 0.125, None)
            np.testing.assert_allclose(np.array(out[i:i + 1]), np.array(ref), atol=2e-5, rtol=1e-4)
        _check_rows(b, singles)
    keep = data.draw(st.lists(st.integers(0, len(singles) - 1), min_size=1, max_size=len(singles), unique=True))
    b.filter(keep); singles = [singles[i] for i in keep]
    _check_rows(b, singles)
    more = [_single(cfg, n, 1000 + 10 * i) for i, n in enumerate(second)]
    b.extend(merge_caches(more)); singles += more
    _check_rows(b, singles)
    t = data.draw(st.integers(0, min(s.offset for s in singles)))
    size = b.size(); assert b.trim(t) == t and b.size() == size - t
    for s in singles: s.trim(t)
    _check_rows(b, singles)
    back = VQBatchCache.from_state(b.state)
    _check_rows(back, singles)



def prefilled(model) -> list:
    "Per-sequence caches of `PROMPTS` after a prefill in 16-token chunks and 3 generated tokens (the compressed model's `make_cache`)."
    seqs = []
    for p in PROMPTS:
        c = model.make_cache()
        for _ in zip(range(3), generate_step(mx.array(p), model, max_tokens=3, prompt_cache=c, prefill_step_size=16)): pass
        seqs.append(c)
    return seqs


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["affine:window=0", "affine:key_bits=4,value_bits=4,window=8", "affine:window=16", "turboquant:window=8",
                                  "turboquant:window=16", "turboquant:window=0"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_padded_batch_fused_decode(sharp_model, spec, dtype, monkeypatch):
    """On a GPU, a decode step of a padded batch (sequences of 37/5/70/18 prompt tokens + 3 generated, merged into one
    batch cache per layer) goes through the method's fused kernel with per-row ranges (`VQBatchCache._attend_rows`):
    its output equals the blockwise reference with `make_mask`'s padding mask on the same cache state, step after
    step (windows move per row), and after `filter` drops a row — within kernel precision (the tensor-core products
    round the query and the weights to fp16)."""
    sharp_model.set_dtype(dtype)
    try:
        vq.compress(sharp_model, parse_method(spec))
        seqs = prefilled(sharp_model)
        taken, real = [], VQBatchCache._attend_rows
        def spy(self, *a):
            out = real(self, *a); taken.append(out is not None); return out
        monkeypatch.setattr(VQBatchCache, "_attend_rows", spy)
        for layer in range(len(seqs[0])):
            fused, ref = merge_caches([c[layer] for c in seqs]), merge_caches([c[layer] for c in seqs])
            H, D = fused.k_store.arrays[next(iter(fused.k_store.arrays))].shape[1], 64
            mx.random.seed(layer)
            for step in range(20):
                if step == 10: fused.filter([0, 2, 3]); ref.filter([0, 2, 3])  # a row leaves mid-generation
                B = fused.offset.shape[0]
                k, v = (mx.random.normal((B, H, 1, D)).astype(dtype) for _ in range(2))
                q = (2 * mx.random.normal((B, 2 * H, 1, D))).astype(dtype)
                mask = ref.make_mask(1)
                fused.update_and_fetch(k, v); ref.update_and_fetch(k, v)
                a = fused.attend(q, k, v, D ** -0.5, mask)
                with monkeypatch.context() as m:
                    m.setattr(VQBatchCache, "_attend_rows", lambda self, *a: None)
                    b = ref.attend(q, k, v, D ** -0.5, mask)
                a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
                np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * np.abs(b).max(), err_msg=f"{spec} layer {layer} step {step}")
        assert taken and all(taken), f"{spec}: {taken.count(False)} of {len(taken)} decode steps missed the fused path"
    finally:
        sharp_model.set_dtype(mx.float32)


@pytest.mark.parametrize("spec", ["affine:window=0", "affine:key_bits=4,value_bits=4,window=8", "turboquant:window=16"])
def test_padded_batch_decoded_prefill(sharp_model, spec, monkeypatch):
    """A chunk of several queries per row over a padded batch (`VQBatchCache._attend_decoded_rows`, the GPU default,
    forced here with `decoded_prefill = True`) equals the blockwise reference with `make_mask`'s padding mask on the
    same cache state, chunk after chunk (every row's window boundary moves on its own), and after `filter`; and
    BatchGenerator's greedy tokens are those of the reference path."""
    try:
        vq.compress(sharp_model, parse_method(spec))
        seqs = prefilled(sharp_model)
        calls, real = [], VQBatchCache._attend_decoded_rows
        def spy(self, *a):
            calls.append(1); return real(self, *a)
        monkeypatch.setattr(VQBatchCache, "_attend_decoded_rows", spy)
        for layer in range(len(seqs[0])):
            fast, ref = merge_caches([c[layer] for c in seqs]), merge_caches([c[layer] for c in seqs])
            fast.decoded_prefill, ref.decoded_prefill = True, False
            H, D = 2, 64
            mx.random.seed(layer)
            for step, T in enumerate([5, 9, 1, 12, 7]):
                if step == 3: fast.filter([0, 2, 3]); ref.filter([0, 2, 3])
                B = fast.offset.shape[0]
                k, v = (mx.random.normal((B, H, T, D)) for _ in range(2))
                q = 2 * mx.random.normal((B, 2 * H, T, D))
                mask = ref.make_mask(T)
                fast.update_and_fetch(k, v); ref.update_and_fetch(k, v)
                a, b = np.array(fast.attend(q, k, v, D ** -0.5, mask)), np.array(ref.attend(q, k, v, D ** -0.5, mask))
                # on a GPU the reference's float32 matmuls run in TF32 (10-bit mantissa): measured 1.7e-3 on the H200
                tol = 1e-4 if mx.default_device().type == mx.cpu else 4e-3
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=f"{spec} layer {layer} step {step}")
        assert len(calls) == 2 * 4, calls  # every multi-query chunk of both layers took the decoded path
        monkeypatch.setattr(VQBatchCache, "decoded_prefill", True)
        got, _, _ = batched(sharp_model, PROMPTS, [6] * 4, prefill_step_size=16)
        monkeypatch.setattr(VQBatchCache, "decoded_prefill", False)
        want, _, _ = batched(sharp_model, PROMPTS, [6] * 4, prefill_step_size=16)
        assert got == want
    finally:
        vq.decompress(sharp_model)
