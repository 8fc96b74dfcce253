"""The native CPU decode kernel (`veloxquant.cpu`) outside its notebook: a later process loads the compiled kernel from
numba's disk cache, and codecs whose words do not hold exactly the codes step aside (the MLX path runs)."""
import os, subprocess, sys
import pytest
import mlx.core as mx
from mlx_lm.models import llama
import veloxquant as vq
from veloxquant import cpu
from veloxquant.cache import VQCache
from veloxquant.core import parse_method

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed: no native CPU kernel")

_CALL = """
import mlx.core as mx, veloxquant.cpu as c
from veloxquant.methods.affine import AffineCodec
e = AffineCodec(64, 4, 64).encode(mx.random.normal((1, 2, 256, 64))); L = c.CpuLayout(e["w"], e["scales"], 4, e["biases"])
x = mx.zeros((1, 2, 8, 64), mx.float16)
c.cpu_decode_attention(mx.zeros((1, 4, 1, 64)), L, L, 200, x, x, 3, None, None, 0.1)
s = c._kernel().stats; print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))
"""


def test_a_second_process_loads_the_kernel_from_disk(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    run = lambda: subprocess.run([sys.executable, "-c", _CALL], env=env, capture_output=True, text=True, timeout=600)
    first, second = run(), run()
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "compiling the native CPU decode kernel" in first.stderr
    hits, misses = map(int, second.stdout.split())
    assert hits >= 1 and misses == 0, second.stdout  # compiled once, then loaded
    assert "compiling" not in second.stderr


@pytest.mark.parametrize("head_dim,spec", [(80, "turboquant:key_bits=3,value_bits=3"), (40, "turboquant:key_bits=2,value_bits=2"),
                                           (80, "turboquant:key_bits=4,value_bits=4")])
def test_padded_words_fall_back(head_dim, spec):
    "head_dim · bits not a multiple of 32: the packed words are padded, no `cpu_layout`; the same tokens as without the kernel."
    args = llama.ModelArgs(model_type="llama", hidden_size=2 * head_dim, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
                           num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=128, tie_word_embeddings=True, head_dim=head_dim)
    mx.random.seed(0); m = llama.Model(args); mx.eval(m.parameters())
    outs, prompt = {}, mx.random.randint(0, 128, (1, 150))
    for flag in (None, False):
        VQCache.cpu_kernel = flag
        try:
            caches = vq.KVCacheBuilder.for_model(m, parse_method(spec))
            lg = m(prompt, cache=caches); steps = []
            for _ in range(6):
                lg = m(mx.argmax(lg[:, -1:], -1), cache=caches); steps.append(lg[0, -1])
            outs[flag] = mx.stack(steps)
        finally: VQCache.cpu_kernel = None
    assert mx.abs(outs[None] - outs[False]).max().item() < 1e-4
