import pytest
import mlx.core as mx


@pytest.fixture(scope="session")
def tiny_model():
    "A 2-layer random-weight Llama (GQA 4:2, head_dim 64): fast contract tests without any download."
    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
                           tie_word_embeddings=True, head_dim=64)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def real():
    "The embedded default model (SmolLM2-135M-Instruct) and real Wikipedia tokens."
    from veloxquant.models import load_model, eval_tokens
    model, tokenizer = load_model()
    return model, tokenizer, eval_tokens(tokenizer, 1024)


def pytest_collection_modifyitems(config, items):
    "Tests marked `gpu` need an MLX GPU back-end (Metal or CUDA); skip them elsewhere (CI also deselects them)."
    from veloxquant.gpu import backend
    if backend() is None:
        skip = pytest.mark.skip(reason="needs an MLX GPU back-end (Metal or CUDA)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def uncalibrated(ids):
    """`ids` without the methods that need a calibration artifact made for the model at hand (`veloxquant.calibrate`):
    the method-generic tests build caches without a model; tests/test_architectures.py calibrates those methods on each
    tiny model and tests/test_calibrate.py checks their artifacts."""
    from veloxquant.calibrate import calibration_of
    return [m for m in ids if calibration_of(m.split(":")[0]) is None]


def keeps_sequence_state(spec) -> bool:
    "Whether a method spec's config says it keeps per-sequence statistics (no exact trim, batching refused at build time)."
    from veloxquant.core import parse_method
    return bool(getattr(parse_method(spec).options, "sequence_state", False))


class StubTokenizer:
    """A stand-in tokenizer for random models without one: fixed ids for any text, no chat template. For the prompt
    passes some eviction methods run after the prefill (`veloxquant.evict.prompt_passes`: KVzip's reconstruction
    builds its instruction with the tokenizer)."""
    chat_template = None
    def encode(self, s, add_special_tokens=False): return [5, 6, 7, 8]
