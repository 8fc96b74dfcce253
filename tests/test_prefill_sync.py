"""`VQCache.prefill_sync`: a prefill chunk of >= 256 queries evaluates its attention output in the cache (bounding the
work the GPU holds queued ahead); the same values as without; shorter chunks (speculative decoding) and decode steps
never synchronise; None (the default) means on GPU back-ends only."""
import mlx.core as mx
import pytest
import veloxquant as vq
import veloxquant.cache as vc

CFG = vq.KVCacheConfig("affine", key_bits=4, value_bits=4, group_size=32)


def _run(sync, chunks, monkeypatch):
    calls = []
    real = mx.eval
    monkeypatch.setattr(vc.mx, "eval", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    c = CFG.make_cache(); c.prefill_sync = sync
    outs = []
    mx.random.seed(0)
    for L in chunks:
        k = mx.random.normal((1, 2, L, 64)).astype(mx.float16); q = mx.random.normal((1, 4, L, 64)).astype(mx.float16)
        c.update_and_fetch(k, k)
        outs.append(c.attend(q, k, k, 0.125, "causal" if L > 1 else None))
    monkeypatch.undo()
    return outs, len(calls)


def test_same_values_and_one_evaluation_per_long_chunk(monkeypatch):
    chunks = [300, 256, 40, 1, 1]
    on, n_on = _run(True, chunks, monkeypatch)
    off, n_off = _run(False, chunks, monkeypatch)
    for a, b in zip(on, off): assert mx.array_equal(a, b).item()
    assert n_on - n_off == 2  # the 300- and 256-query chunks; not the 40-token chunk nor the decode steps


@pytest.mark.skipif(vq.cache.gpu.backend() is not None, reason="the default is on where a GPU back-end runs")
def test_default_is_off_without_a_gpu(monkeypatch):
    assert vq.VQCache.prefill_sync is None
    _, n_default = _run(None, [300], monkeypatch)
    _, n_off = _run(False, [300], monkeypatch)
    assert n_default == n_off
