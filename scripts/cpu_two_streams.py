"""Prototype, not adopted: the CPU decode step (`_CpuStep`) with the codes split in two halves, each half scored and mixed
by its own compiled function on its own CPU stream (two threads), merged with the exact window by their softmax maxima.
One layer of the default model shape at 4k: turboquant 3/3 3.57 -> 2.85 ms, affine 4/4 2.04 -> 1.84 ms; end to end on the
2-core CPU slower (turboquant 0.64x -> 0.59x of stock, nbs/decode_two_streams_cpu_s13.json): the second stream competes
with the BLAS threads of the weight matmuls. Usage: python scripts/cpu_two_streams.py layer SPECS [S]
                            python scripts/cpu_two_streams.py di SPECS STEPS --out FILE   (specs ending in |two use the prototype)"""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlx.core as mx
import veloxquant.attention as att, veloxquant.cache as cache
from veloxquant.attention import fast_exp, _NEG
_S2 = mx.new_stream(mx.cpu)
class _CpuStep2:
    def __init__(self, kc, vc):
        f32 = mx.float32
        def part(q, kb, vb, lo, nc):
            sc = kc.scores(q, kb); n = sc.shape[-1]
            sc = mx.where(mx.arange(n) + lo < nc, sc, _NEG)
            m = sc.max(-1, keepdims=True)
            e = fast_exp(mx.contiguous(sc - m))
            return m, e.sum(-1, keepdims=True), vc.mix(e, vb)
        def prep(queries, scale):
            B, Hq, _, D = queries.shape
            return (queries.astype(f32) * scale)
        def win(q, parts, xk, xv, nx, keys, values):
            cap = xk.shape[2]
            ek = mx.concatenate([xk.astype(f32), keys.astype(f32)], axis=2)
            ev = mx.concatenate([xv.astype(f32), values.astype(f32)], axis=2)
            i = mx.arange(cap + 1)
            sx = mx.where((i < nx) | (i == cap), q @ mx.expand_dims(ek, 2).swapaxes(-1, -2), _NEG)
            mw = sx.max(-1, keepdims=True)
            M = mw
            for m, l, o in parts: M = mx.maximum(M, m)
            ew = mx.exp(sx - M)
            num = ew @ mx.expand_dims(ev, 2); den = ew.sum(-1, keepdims=True)
            for m, l, o in parts:
                a = mx.exp(m - M); num = num + o * a; den = den + l * a
            return num / den
        self.kc, self.vc = kc, vc
        self.part = mx.compile(part)
        self.win1 = mx.compile(lambda q, m1, l1, o1, *r: win(q, [(m1, l1, o1)], *r))
        self.win2 = mx.compile(lambda q, m1, l1, o1, m2, l2, o2, *r: win(q, [(m1, l1, o1), (m2, l2, o2)], *r))
    def __call__(self, queries, kb, vb, nc, xk, xv, nx, keys, values, scale):
        B, Hq, _, D = queries.shape; Hkv = xk.shape[1]
        q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, Hq // Hkv, 1, D)
        cap = next(iter(kb.values())).shape[2]
        h = (cap // 2 + 63) // 64 * 64
        if nc > h and h < cap:
            sl = lambda d, a, b: {k: v[:, :, a:b] for k, v in d.items()}
            with mx.stream(_S2): p2 = self.part(q, sl(kb, h, cap), sl(vb, h, cap), mx.array(h, mx.int32), mx.array(nc, mx.int32))
            p1 = self.part(q, sl(kb, 0, h), sl(vb, 0, h), mx.array(0, mx.int32), mx.array(nc, mx.int32))
            out = self.win2(q, *p1, *p2, xk, xv, mx.array(nx, mx.int32), keys, values)
        else:
            p1 = self.part(q, kb, vb, mx.array(0, mx.int32), mx.array(nc, mx.int32))
            out = self.win1(q, *p1, xk, xv, mx.array(nx, mx.int32), keys, values)
        for c in (self.kc, self.vc):
            for a in ("_qkey", "_qrot", "_qpkey", "_qp"):
                if getattr(c, a, None) is not None: setattr(c, a, None)
        return out.reshape(B, Hq, 1, -1).astype(queries.dtype)
_orig = cache.VQCache._cpu_step
_ALT = {}
def _cpu_step(self, *a, **k):
    if not getattr(self, "two", False): return _orig(self, *a, **k)
    saved = cache._CpuStep, cache._CPU_STEPS
    cache._CpuStep, cache._CPU_STEPS = _CpuStep2, _ALT
    try: return _orig(self, *a, **k)
    finally: cache._CpuStep, cache._CPU_STEPS = saved
cache.VQCache._cpu_step = _cpu_step
if __name__ == "__main__":
    mode = sys.argv.pop(1)
    sys.modules["cpu2"] = sys.modules[__name__]
    import runpy
    if mode == "layer": runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_two_streams_layer.py"), run_name="__main__")
    else:
        src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_interleaved.py")).read()
        src = src.replace("        if spec.endswith(\"|old\"): c.cpu_step = False", "        if spec.endswith(\"|old\"): c.cpu_step = False\n        if spec.endswith(\"|two\"): c.two = True")
        exec(compile(src, "decode_interleaved.py", "exec"), {"__name__": "__main__"})
