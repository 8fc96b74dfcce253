"""The decode step replayed through `mx.compile` (`gpu.REPLAY_DECODE`, `gpu_decode.DecodeStep`), checked on a machine
without a GPU: `tests/fake_cuda.py` stands in for MLX's CUDA back-end (in a subprocess, as it patches MLX). Its launches
are not the kernels' results, but each output depends on every input's values and on the number of exact tokens the merge
reads (by shape, or by value with EV = 1), so the compiled replay must give, step by step, what the same launches give
launch by launch; a replay that kept a traced length or input would differ. The real kernels' parity is
`tests/test_fast_path.py::test_replayed_decode_matches` (GPU). The same runs check `DecodeStep`'s prepared launches of
a checked layout (its hot path) against its general path, step by step. (Not to be confused with `tests/test_compiled_decode.py`:
the CPU path of codecs without a kernel, `cache.compiled_decode_attention`.)"""
import json, pathlib, subprocess, sys

SCRIPT = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import fake_cuda; fake_cuda.install()
import mlx.core as mx
import veloxquant, veloxquant.gpu as gpu
from veloxquant.core import parse_method
from mlx_lm.models import base
import veloxquant.gpu_decode as gd
assert gpu.backend() == "cuda"
warm_call = gd.DecodeStep.__call__
def cold_call(self, *a, **k):  # every step through the general path (checks, templates and lists built per step)
    self._hot = None; return warm_call(self, *a, **k)
H, rep, D, steps, res = 8, 4, 128, 150, []
SPECS = sys.argv[2].split(';')
for spec in SPECS:
    for B, with_sinks in [(1, False), (2, True)]:
        outs, launches, lengths = {}, {}, set()
        for comp in (False, True, "cold", "bake"):  # launch by launch, replayed, without the prepared launches, templates written in
            gpu.REPLAY_DECODE = comp is True; fake_cuda.LAUNCHES.clear(); gd.DecodeStep.bake = comp == "bake"
            gd.DecodeStep.__call__ = cold_call if comp == "cold" else warm_call
            c = parse_method(spec).make_cache(); mx.random.seed(3); o = []
            sk = mx.random.normal((H * rep,)).astype(mx.float16) if with_sinks else None
            for T in [300] + [1] * steps:
                k, v, q = (mx.random.normal(s).astype(mx.float16) for s in ((B, H, T, D), (B, H, T, D), (B, H * rep, T, D)))
                kk, vv = c.update_and_fetch(k, v)
                o.append(base.scaled_dot_product_attention(q, kk, vv, cache=c, scale=D ** -0.5, mask="causal" if T > 1 else None, sinks=sk))
                mx.eval(o[-1]); lengths.add(c.k_store.length)
            outs[comp] = o[1:]; launches[{False: "off", True: "on"}.get(comp, comp)] = {k: v for k, v in fake_cuda.LAUNCHES.items() if "append" not in k}
            assert not gpu.FAILED, gpu.FAILED  # no kernel fell back to a reference path
        diff = max(float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max()) for x, y in zip(outs[False], outs[True]))
        cold = max(float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max()) for x, y in zip(outs[False], outs["cold"]))
        bake = max(float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max()) for x, y in zip(outs["cold"], outs["bake"]))
        rvc = max(float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max()) for x, y in zip(outs["cold"], outs[True]))
        distinct = len({round(float(x.astype(mx.float32).sum()), 3) for x in outs[True]})
        res.append(dict(spec=spec, B=B, sinks=with_sinks, diff=diff, cold=cold, bake=bake, replay_vs_cold=rvc, distinct=distinct, launches=launches, coded_lengths=len(lengths)))
print(json.dumps(res))
'''

# the two methods with kernels of their own (`DecodeStep`) and two through the generic coded path (`tiles.coded_decode`)
SPECS = ["affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3", "polar", "kivi"]

def test_replay_matches_launch_by_launch():
    tests = pathlib.Path(__file__).parent
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tests), ";".join(SPECS)], capture_output=True, text=True, timeout=900, cwd=tests.parent)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(res) == 2 * len(SPECS)
    for r in res:
        what = f"{r['spec']} B={r['B']} sinks={r['sinks']}"
        assert r["cold"] == 0.0, f"{what}: the prepared launches (DecodeStep's hot path) differ from the general path by {r['cold']}"
        assert r["replay_vs_cold"] == 0.0, f"{what}: the compiled replay differs from the general path by {r['replay_vs_cold']}"
        assert r["diff"] == 0.0, f"{what}: the compiled replay differs from launch-by-launch by {r['diff']}"
        assert r["distinct"] > 75, f"{what}: outputs hardly change from step to step ({r['distinct']} distinct): the check sees nothing"
        off, on = r["launches"]["off"], r["launches"]["on"]
        assert set(off) == set(on) and len(off) == 2, f"{what}: launches {off} / {on}"
        assert r["launches"]["cold"] == off, f"{what}: launches {off} with the hot path, {r['launches']['cold']} without"
        assert r["bake"] == 0.0, f"{what}: the kernels with their templates written in differ by {r['bake']}"
        baked = {k: v for k, v in r["launches"]["bake"].items() if k not in off}
        if ("affine" in r["spec"] or "turboquant" in r["spec"]) and not r["sinks"]:  # `DecodeStep` without sinks: most steps baked
            assert len(baked) == 2 and min(baked.values()) > 100, f"{what}: launches with bake {r['launches']['bake']}"
        for name, count in off.items():
            assert count == 150, f"{what}: {name} launched {count} times launch by launch"
            # compiled: one uncompiled first step, then one trace per coded length (the window's encodes change it)
            assert on[name] <= r["coded_lengths"] + 1, f"{what}: {name} launched {on[name]} times with the compiled replay"


def test_a_dropped_trace_is_not_replayed():
    """The replays drop the previous coded length's compiled function before tracing the next one, whose closure may get
    the freed function's id; `mx.compile` keys its traces by that id, so they rely on MLX erasing a dropped function's
    traces (a stale trace would replay the old length)."""
    import mlx.core as mx
    x, ids, reused, stale, holder = mx.ones((4,)), set(), 0, 0, None
    for i in range(200):
        def step(a, i=i): return a * i
        holder = None  # as `DecodeStep` / `coded_decode` do
        holder = mx.compile(step)
        reused += id(step) in ids; ids.add(id(step)); del step
        stale += float(holder(x)[0]) != i
    assert stale == 0, f"{stale} of 200 calls replayed a dropped function's trace"
    assert reused > 0, "no function id was reused: the check saw nothing"


SWITCHES = r'''
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import fake_cuda; fake_cuda.install()
import mlx.core as mx
import veloxquant, veloxquant.gpu as gpu
import veloxquant.gpu_decode as gd
from veloxquant.core import parse_method
from mlx_lm.models import base
warnings.simplefilter("ignore")
warm_call = gd.DecodeStep.__call__
def cold_call(self, *a, **k):
    self._hot = None; return warm_call(self, *a, **k)
res = {}
for spec, name in [("affine:key_bits=4,value_bits=4", "vq_affine_mma_decode"), ("turboquant:key_bits=3,value_bits=3", "vq_tq_mma_decode")]:
    for mode in ("cold", "warm"):
        gd.DecodeStep.__call__ = cold_call if mode == "cold" else warm_call
        c = parse_method(spec).make_cache(); mx.random.seed(5); o, during = [], []
        for i, T in enumerate([300] + [1] * 60):
            k, v, q = (mx.random.normal(s).astype(mx.float16) for s in ((1, 8, T, 128), (1, 8, T, 128), (1, 32, T, 128)))
            if i == 20: gpu.MERGE_WARPS = 2   # a switch while the layout runs on its prepared launches
            if i == 30: gpu.MERGE_WARPS = 4
            kk, vv = c.update_and_fetch(k, v)
            if 40 <= i < 46:                  # a failure injected while the layout runs on its prepared launches
                before = fake_cuda.LAUNCHES[name]
                with gpu.inject_failure(name):
                    o.append(base.scaled_dot_product_attention(q, kk, vv, cache=c, scale=128 ** -0.5, mask=None)); mx.eval(o[-1])
                during.append(fake_cuda.LAUNCHES[name] - before)
            else:
                o.append(base.scaled_dot_product_attention(q, kk, vv, cache=c, scale=128 ** -0.5, mask="causal" if T > 1 else None)); mx.eval(o[-1])
        res[f"{spec} {mode}"] = dict(outs=[float(x.astype(mx.float32).sum()) for x in o[1:]], during=during)
print(json.dumps(res))
'''

def test_prepared_launches_follow_switches_and_failures():
    """`DecodeStep`'s prepared launches (its hot path) against its general path while the layout runs on them: a switch of
    `gpu.MERGE_WARPS` and back, and a failure injected into the decode kernel for six steps (`gpu.inject_failure`: no
    launch of it then, the cache's fallback answers) give the same outputs step by step as the general path."""
    tests = pathlib.Path(__file__).parent
    p = subprocess.run([sys.executable, "-c", SWITCHES, str(tests)], capture_output=True, text=True, timeout=900, cwd=tests.parent)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for spec in ("affine:key_bits=4,value_bits=4", "turboquant:key_bits=3,value_bits=3"):
        cold, warm = res[f"{spec} cold"], res[f"{spec} warm"]
        assert warm["during"] == [0] * 6 and cold["during"] == [0] * 6, f"{spec}: launched during the injected failure: {warm['during']} / {cold['during']}"
        bad = [i for i, (a, b) in enumerate(zip(cold["outs"], warm["outs"])) if a != b]
        assert not bad, f"{spec}: prepared launches differ from the general path at steps {bad[:10]}"
        assert len(set(round(x, 3) for x in warm["outs"][18:32])) > 8, f"{spec}: outputs hardly change: the check sees nothing"
