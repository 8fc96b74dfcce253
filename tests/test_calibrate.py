"""The shared calibration piece (`veloxquant.calibrate`): calibration text disjoint from the evaluation text, the checked
artifact keyed by model fingerprint / method settings / head_dim, and every refusal case, through `spectral` (the first
calibrated method) on tiny random models."""
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import save_prompt_cache, load_prompt_cache

import veloxquant as vq
import veloxquant.calibrate as cal
import veloxquant.models as models

IDS = [(7 * i + 3) % 120 + 2 for i in range(384)]


def tiny(seed=0, head_dim=64, kv_heads=2, layers=2):
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=layers, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=128,
                           tie_word_embeddings=True, head_dim=head_dim)
    mx.random.seed(seed)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def calibrated(cache_dir):
    m = tiny()
    cfg = vq.KVCacheConfig("spectral", key_bits=2, value_bits=2, window=8)
    path = cal.calibrate(cfg, m, tokens=IDS, window=128, progress=False)
    return m, cfg, path


def feed(model, caches, toks, chunks):
    outs, s = [], 0
    for c in chunks:
        outs.append(model(mx.array(toks[s:s + c])[None], cache=caches)); s += c
    return mx.concatenate(outs, axis=1)


def test_calibration_text_is_disjoint_from_eval():
    ev, ca = models._split_text("eval"), models._split_text("calib")
    paras = [p for p in ca.split("\n\n") if p.strip()]
    assert len(paras) > 100 and not any(p in ev for p in paras)


def test_calibration_tokens_come_from_the_calib_split():
    class Tok:  # a character tokenizer: token ids are the characters' code points
        def encode(self, s, add_special_tokens=False): return [ord(c) for c in s]
    ids = cal.calibration_tokens(Tok(), 500)
    text = "".join(map(chr, ids))
    assert text in models._split_text("calib") and text not in models._split_text("eval")


def test_artifact_metadata_and_default_location(calibrated):
    m, cfg, path = calibrated
    fp = cal.model_fingerprint(m)
    assert path == cal.artifact_path("spectral", cfg.options, fp) and path.parent.parent == Path(models.cache_dir())
    tensors, meta = cal.load_calibration(path, "spectral", cfg.options, fp, 64)
    assert meta["method"] == "spectral" and json.loads(meta["settings"]) == {"key_bits": 2}
    assert meta["fingerprint"] == fp and json.loads(meta["head_dims"]) == [64, 64] and meta["n_layers"] == "2"
    assert tensors["layer1/basis"].shape == (2, 64, 64) and tensors["layer0/bits"].sum() == 128


def test_builder_binds_layers_and_roundtrips(calibrated, tmp_path):
    m, cfg, path = calibrated
    caches = vq.KVCacheBuilder.for_model(m, cfg)
    assert [(c.config.options.layer, c.config.options.path) for c in caches] == [(0, str(path)), (1, str(path))]
    toks = [(5 * i + 1) % 120 + 2 for i in range(100)]
    out = feed(m, caches, toks, (90, 1, 9))
    assert mx.isfinite(out).all().item() and caches[0].k_store.length > 0
    f = str(tmp_path / "c.safetensors")
    save_prompt_cache(f, caches)
    loaded = load_prompt_cache(f)
    assert mx.array_equal(feed(m, caches, [3, 4], (2,)), feed(m, loaded, [3, 4], (2,))).item()


def _refused(model, cfg, match):
    before = dict(cal._LOADED)
    with pytest.raises(ValueError, match=match):
        vq.KVCacheBuilder.for_model(model, cfg)
    return before


def test_refused_for_another_model(calibrated):
    m, cfg, path = calibrated
    _refused(tiny(seed=1), vq.KVCacheConfig("spectral", key_bits=2, path=str(path)), "another model")
    _refused(tiny(kv_heads=1), vq.KVCacheConfig("spectral", key_bits=2, path=str(path)), "another model")
    _refused(tiny(seed=1), vq.KVCacheConfig("spectral", key_bits=2), "does not exist")  # none in the cache dir for it


def test_refused_for_another_head_dim(calibrated):
    m, cfg, path = calibrated
    _refused(tiny(head_dim=32), vq.KVCacheConfig("spectral", key_bits=2, path=str(path)), "another model")
    bound = vq.KVCacheConfig("spectral", key_bits=2, path=str(path), layer=0)  # a bound config, used on other keys
    with pytest.raises(ValueError, match="head_dim 64, not 32"):
        bound.make_cache().update_and_fetch(mx.zeros((1, 2, 1, 32)), mx.zeros((1, 2, 1, 32)))
    with pytest.raises(ValueError, match="layer=5 is out of range"):
        vq.KVCacheConfig("spectral", key_bits=2, path=str(path), layer=5).make_cache().update_and_fetch(
            mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))


def test_refused_for_another_setting(calibrated):
    m, cfg, path = calibrated
    _refused(m, vq.KVCacheConfig("spectral", key_bits=3, path=str(path)), r"settings \{\"key_bits\": 2\}")
    _refused(m, vq.KVCacheConfig("spectral", key_bits=3), "does not exist")
    # settings that do not enter the artifact (value bits, window) share it
    assert len(vq.KVCacheBuilder.for_model(m, vq.KVCacheConfig("spectral", key_bits=2, value_bits=3, window=0))) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "metadata"])
def test_refused_when_corrupted_never_half_loaded(calibrated, damage):
    m, cfg, path = calibrated
    raw = bytearray(path.read_bytes())
    if damage == "flip": raw[-11] ^= 0x20
    if damage == "truncate": raw = raw[:len(raw) // 2]
    if damage == "metadata":  # claim another fingerprint in the header: the sha256 covers the metadata too
        fp = cal.model_fingerprint(m)
        raw = bytearray(bytes(raw).replace(fp[:8].encode(), ("0" * 8 if fp[:8] != "0" * 8 else "1" * 8).encode(), 1))
    bad = path.with_name("bad.safetensors")
    bad.write_bytes(bytes(raw))
    _refused(m, vq.KVCacheConfig("spectral", key_bits=2, path=str(bad)), "sha256 mismatch|unreadable")
    assert str(bad) not in cal._LOADED  # nothing of the damaged file is kept


def test_unbound_config_and_calibration_free_method(cache_dir):
    with pytest.raises(ValueError, match="needs a calibration artifact bound to a layer"):
        vq.KVCacheConfig("spectral").make_cache().update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))
    with pytest.raises(ValueError, match="calibration-free"):
        cal.calibrate("rabitq", tiny(), tokens=IDS, progress=False)
    assert cal.calibration_of("rabitq") is None and cal.calibration_of("spectral") is not None


def test_fingerprint():
    a, b = tiny(), tiny()
    assert cal.model_fingerprint(a) == cal.model_fingerprint(b)
    assert len({cal.model_fingerprint(x) for x in (a, tiny(seed=1), tiny(head_dim=32), tiny(layers=3))}) == 4


def test_cli_calibrate_refuses_calibration_free(capsys):
    from veloxquant.cli import main
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--method", "rabitq", "--model", "/nonexistent-model-dir"])
    assert e.value.code == 2
