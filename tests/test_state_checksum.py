"""The cache-state checksum: the compiled pass gives the same value as the formula written out (so files saved before
it was compiled still verify), for every dtype a state holds, strided slices, empty and scalar arrays."""
import mlx.core as mx
import pytest
from veloxquant.cache import _array_sum, _bits, state_checksum


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
def test_compiled_sum_matches_the_formula(i):
    a = _arrays()[i]
    assert _array_sum(a).item() == _reference(a).item()


def test_one_changed_element_changes_the_checksum():
    a = mx.random.normal((1, 2, 64, 32)).astype(mx.float16)
    b = mx.array(a); b[0, 1, 40, 7] = b[0, 1, 40, 7] + 1
    assert _array_sum(a).item() != _array_sum(b).item()
    assert not mx.array_equal(state_checksum({"k": a}), state_checksum({"k": b})).item()
