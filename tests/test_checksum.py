"""Saved caches carry a checksum in each layer's own state: a file whose stored values were edited is refused by
`load_prompt_cache`, an untouched one loads, and a file written before checksums (no `checksum` entry) loads with a
warning. Covers VQCache (affine, turboquant with its means), the sliding-window and chunked caches and both batch caches."""
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import veloxquant as vq
from veloxquant.batch import merge_caches
from veloxquant.sliding import sliding_cache, chunked_cache
from veloxquant.evict import prompt_passes
from conftest import StubTokenizer

K = mx.random.normal((1, 2, 40, 32), key=mx.random.key(1)); V = mx.random.normal((1, 2, 40, 32), key=mx.random.key(2))
AFF = vq.KVCacheConfig("affine", key_bits=4, value_bits=4, group_size=32, window=4)


def filled(c, n=40):
    "A 24-token prefill, then one-token decode steps up to `n` tokens (so codes, not only the fp16 window, are stored)."
    c.update_and_fetch(K[:, :, :24], V[:, :, :24])
    for i in range(24, n): c.update_and_fetch(K[:, :, i:i + 1], V[:, :, i:i + 1])
    mx.eval(c.state); return c


def svdq(method="svdq", **opts):
    "svdq codes only once it knows the layer's RoPE (the builder calls use_rope): set by hand here (kvtc saves range-coded 1-D streams: its tamper test is in its notebook)."
    from veloxquant.rope import RopeSpec
    c = vq.KVCacheConfig(method, min_tokens=8, window=4, **opts).make_cache()
    c.use_rope(RopeSpec(head_dim=32, dims=32, traditional=False, base=10000.0, freqs=None))
    return c


def batch(cfg):
    a, b = filled(cfg.make_cache(), 40), filled(cfg.make_cache(), 20)
    return merge_caches([a, b])


CASES = {
    "affine": lambda: filled(AFF.make_cache()),
    "turboquant": lambda: filled(vq.KVCacheConfig("turboquant", key_bits=3, value_bits=3, center=True, window=4).make_cache()),
    "rotating": lambda: filled(sliding_cache(AFF, 16, 0)),
    "chunked": lambda: filled(chunked_cache(AFF, 8)),
    "fp16_rotating": lambda: filled(sliding_cache(vq.KVCacheConfig("fp16"), 16, 0)),
    "svdq": lambda: filled(svdq(group_size=32)),
    "batch": lambda: batch(AFF),
    "fp16_batch": lambda: batch(vq.KVCacheConfig("fp16")),
}


def arrays_of(path):
    return mx.load(str(path), return_metadata=True)


@pytest.mark.parametrize("name", CASES)
def test_checksum(name, tmp_path):
    c = CASES[name]()
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), [c])
    arrays, meta = arrays_of(path)
    assert any("checksum" in k for k in arrays) or name == "fp16_batch", sorted(arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an untouched file: no warning
        (d,) = load_prompt_cache(str(path))
    assert type(d) is type(c) and mx.array_equal(mx.array(d.offset), mx.array(c.offset)).item()
    # one stored value edited: in every code array (packed codes, scales) and in the fp16 window / fp16 keys
    data = [k for k, v in arrays.items() if v.ndim >= 3 and "checksum" not in k]
    assert name.startswith("fp16") or any(not mx.issubdtype(arrays[k].dtype, mx.floating) for k in data), f"no codes stored: {data}"
    for key in data:
        a = arrays[key]; flat = a.reshape(-1)
        edited = dict(arrays, **{key: (flat.at[flat.size // 2].add(1)).reshape(a.shape)})
        bad = tmp_path / "bad.safetensors"; mx.save_safetensors(str(bad), edited, meta)
        with pytest.raises(ValueError, match="checksum does not match"):
            load_prompt_cache(str(bad))
    # a file of the format before checksums: every checksum entry removed (the tuple state's is its last entry)
    old = {k: v for k, v in arrays.items() if "checksum" not in k and not (name == "fp16_batch" and k == "0.6")}
    oldp = tmp_path / "old.safetensors"; mx.save_safetensors(str(oldp), old, meta)
    with pytest.warns(UserWarning, match="no checksum"):
        (o,) = load_prompt_cache(str(oldp))
    assert type(o) is type(c)


@pytest.mark.parametrize("mid", vq.method_ids())
def test_every_method_seals_its_state(mid, tiny_model, tmp_path):
    "Every registered method at its defaults: a saved cache loads without warning, and its largest stored array edited is refused."
    try:
        caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig(mid))
    except ValueError as e:  # a calibrated method without an artifact for this random model
        pytest.skip(f"{mid}: {str(e)[:120]}")
    toks = [i % 120 + 3 for i in range(200)]
    mx.eval(tiny_model(mx.array([toks]), cache=caches))
    prompt_passes(tiny_model, caches, toks, StubTokenizer())  # a method's own pass over the prompt (KVzip's reconstruction)
    for t in range(4): mx.eval(tiny_model(mx.array([[t + 5]]), cache=caches))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), caches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_prompt_cache(str(path))
    arrays, meta = arrays_of(path)
    key = max((k for k, v in arrays.items() if v.ndim >= 3 and "checksum" not in k), key=lambda k: arrays[k].size)
    a = arrays[key]; flat = a.reshape(-1)
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), dict(arrays, **{key: flat.at[flat.size // 2].add(1).reshape(a.shape)}), meta)
    with pytest.raises(ValueError, match="checksum does not match"):
        load_prompt_cache(str(bad))


@pytest.mark.parametrize("spec", ["vecinfer:iters=3", "comm_vq:em=1,iters=3", "a2ats:top_k=40,iters=3", "kvquant", "skvq",
                                  "ratequant:bits=2.5", "palu"])
def test_calibrated_method_seals_its_state(spec, tiny_model, tmp_path):
    "Calibrated methods (artifact made on the tiny model): a saved cache loads without warning; an edited code array is refused."
    from veloxquant.core import parse_method
    from veloxquant.calibrate import calibrate
    cfg = parse_method(spec)
    cal = calibrate(cfg, tiny_model, tokens=[(5 * i) % 120 + 3 for i in range(256)], window=128, out=tmp_path / "cal.safetensors",
                    progress=False)
    caches = vq.KVCacheBuilder.for_model(tiny_model, vq.KVCacheConfig(cfg.method, **{**cfg.options.to_dict(), "path": str(cal)}))
    mx.eval(tiny_model(mx.array([[i % 120 + 3 for i in range(200)]]), cache=caches))
    for t in range(4): mx.eval(tiny_model(mx.array([[t + 5]]), cache=caches))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), caches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_prompt_cache(str(path))
    arrays, meta = arrays_of(path)
    keys = [k for k, v in arrays.items() if v.ndim >= 3 and "checksum" not in k and not mx.issubdtype(v.dtype, mx.floating)]
    keys = keys or [max((k for k, v in arrays.items() if v.ndim >= 3 and "checksum" not in k), key=lambda k: arrays[k].size)]
    for key in keys:
        a = arrays[key]; flat = a.reshape(-1)
        bad = tmp_path / "bad.safetensors"
        mx.save_safetensors(str(bad), dict(arrays, **{key: flat.at[flat.size // 2].add(1).reshape(a.shape)}), meta)
        with pytest.raises(ValueError, match="checksum does not match"):
            load_prompt_cache(str(bad))


@pytest.mark.parametrize("entry", ["config", "offset", "window", "dims"])
def test_state_without_a_required_entry_is_refused(entry):
    "A state lacking one of VQCache's required entries is refused with a ValueError naming it (was a bare KeyError), before anything is loaded."
    st = dict(filled(AFF.make_cache()).state); st.pop(entry)
    fresh = AFF.make_cache()
    with warnings.catch_warnings(), pytest.raises(ValueError, match=f"no \\['{entry}'\\] entries"):
        warnings.simplefilter("ignore")
        fresh.state = st
    assert fresh.offset == 0 and fresh.k_store.length == 0  # nothing half-loaded


# The checksum pass (positions formed as row·C + column) gives the same value as the formula written out with a flat
# position array (so files saved before still verify), for every dtype a state holds, strided slices, empty and scalar arrays.
from veloxquant.cache import _array_sum, _bits, state_checksum  # noqa: E402


def _reference(a):
    x = _bits(a)
    w = (mx.arange(x.size, dtype=mx.uint32) * mx.array(2654435761, mx.uint32) + mx.array(0x9E3779B9, mx.uint32)) | mx.array(1, mx.uint32)
    return (x * w + (x >> 16)).sum()


def _arrays():
    mx.random.seed(3)
    n = mx.random.normal
    return [n((1, 8, 257, 128)).astype(mx.float16), n((1, 8, 300, 64)).astype(mx.bfloat16)[:, :, :299],
            mx.random.randint(0, 2**31, (2, 4, 100, 16)).astype(mx.uint32), n((3, 5, 7)), mx.array([True, False, True]),
            mx.random.randint(0, 255, (33,)).astype(mx.uint8), mx.random.randint(-9, 9, (4, 6)).astype(mx.int8),
            mx.zeros((0, 4)), mx.array(3.0), mx.arange(10, dtype=mx.int64), n((2, 3)).astype(mx.float16).T]


@pytest.mark.parametrize("i", range(11))
def test_sum_matches_the_formula(i):
    a = _arrays()[i]
    assert _array_sum(a).item() == _reference(a).item()


def test_one_changed_element_changes_the_checksum():
    a = mx.random.normal((1, 2, 64, 32)).astype(mx.float16)
    b = mx.array(a); b[0, 1, 40, 7] = b[0, 1, 40, 7] + 1
    assert _array_sum(a).item() != _array_sum(b).item()
    assert not mx.array_equal(state_checksum({"k": a}), state_checksum({"k": b})).item()


def test_generation_loop_reads_are_not_sealed(monkeypatch):
    """mlx-lm's generation loop (module `mlx_lm.generate`) evaluates `state` after each prefill chunk and reads nothing
    from it: no checksum there on a GPU back-end (faked here); any other reader (saving included) gets it; on the CPU
    every read is sealed."""
    import veloxquant.cache as vc
    c = filled(AFF.make_cache())
    if vc.gpu.backend() is None:
        cpu = {"__name__": "mlx_lm.generate", "caches": [c]}
        exec("states = [x.state for x in caches]", cpu)
        assert "checksum" in cpu["states"][0]
        monkeypatch.setattr(vc.gpu, "backend", lambda: "cuda")
    loop = {"__name__": "mlx_lm.generate", "caches": [c]}
    exec("states = [x.state for x in caches]", loop)
    assert "checksum" not in loop["states"][0] and "k" in loop["states"][0]
    assert "checksum" in c.state
    other = {"__name__": "somewhere.else", "caches": [c]}
    exec("states = [x.state for x in caches]", other)
    assert "checksum" in other["states"][0]


def test_generate_step_then_save_and_load(tmp_path):
    "A cache filled through mlx-lm's `generate_step` (unsealed reads inside) saves sealed and loads without a warning."
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100)
    model = llama.Model(args)
    caches = vq.KVCacheBuilder.for_model(model, AFF)
    for _ in zip(range(3), generate_step(mx.arange(40) % 100, model, max_tokens=3, prompt_cache=caches, prefill_step_size=16)):
        pass
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_prompt_cache(f)
    assert loaded[0].offset == caches[0].offset
