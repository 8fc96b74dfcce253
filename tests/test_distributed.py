"""mlx.distributed with 2 local ranks (`mlx.launch --backend ring -n 2`, the same launcher and collectives as across
machines): every registered method under tensor parallelism (fp16 tokens equal the unsharded run's, each rank's cache
holds half the KV heads and exactly half the bytes), `veloxquant eval` spreading a sweep over the ranks (the gathered
records equal a one-process run's), `veloxquant serve` under mlx.launch (rank 0 serves; the reply equals stock
mlx-lm on the unsharded model), and the refusals (head counts that do not divide, `--pipeline`).

The model is a 2-layer random-weight Llama with 8 query / 4 KV heads (the default model has 3 KV heads and cannot be
split over 2 ranks); see tests/distributed_worker.py."""
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "distributed_worker.py")
CLI = ["-c", "from veloxquant.cli import main; main()"]
SWEEP = "fp16;affine:key_bits=4,value_bits=4,window=0;q4_0:window=0;turboquant:key_bits=3,value_bits=3,window=0"  # 2 per rank
SERVE_METHOD = "affine:key_bits=8,value_bits=8,window=0"  # 8-bit: batched tokens equal one-by-one ones (see test_batch)
MAX_TOKENS = 8


def mlx_launch() -> str:
    exe = Path(sys.executable).with_name("mlx.launch")
    return str(exe) if exe.exists() else (shutil.which("mlx.launch") or pytest.skip("mlx.launch not installed"))


def free_ports(n: int) -> int:
    "A port p with p .. p+n-1 free on localhost (the ring back-end listens on one port per rank from --starting-port)."
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
        if p + n >= 65536: continue
        try:
            socks = []
            for q in range(p, p + n):
                t = socket.socket(); socks.append(t); t.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for t in socks: t.close()
    raise RuntimeError("no free consecutive ports")


def launch_cmd(n: int, args: list[str]) -> list[str]:
    return [mlx_launch(), "--backend", "ring", "-n", str(n), "--starting-port", str(free_ports(n)), "--", sys.executable, *args]


def run(cmd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard") / "shard.json"
    p = run(launch_cmd(2, [WORKER, "shard", str(out)]))
    assert out.exists(), f"2-rank worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_fp16_sharded_equals_unsharded(sharded):
    r = sharded["methods"]["fp16"]
    assert sharded["ranks"] == 2
    assert r["tokens_equal"], (r["tokens_unsharded"], r["tokens_sharded"])
    assert r["max_logit_diff"] < 1e-4  # float32 all_sum over 2 ranks: not bit-exact, within rounding
    assert r["fp16_keys_are_head_slices"] == [True, True]  # rank r stores exactly heads [2r, 2r+2) of the unsharded cache


def method_ids():
    from veloxquant.core import method_ids
    return method_ids()


# methods whose storage is not a per-head split of the unsharded cache, so bytes per rank are not exactly half:
NOT_SPLIT_BY_HEADS = {"adakv": "Ada-KV pools the budget over a layer's heads; each rank pools over its own heads",
                      "xkv": "one token factor per layer group, shared by all its heads, is stored on every rank"}


@pytest.mark.parametrize("method", method_ids())
def test_every_method_runs_sharded(sharded, method):
    r = sharded["methods"][method]
    if "error" in r and "calibrat" in r["error"].lower():
        pytest.skip(f"{method} needs a calibration artifact of the model: {r['error'][:200]}")
    assert "error" not in r, r["error"]
    if method in NOT_SPLIT_BY_HEADS:  # runs sharded; what it stores per rank is not the unsharded cache's half
        return
    assert r["unsharded_heads"] == 4 and r["rank_heads"] == [2, 2]
    assert r["rank_bytes"] == [r["unsharded_bytes"] // 2] * 2 and r["unsharded_bytes"] % 2 == 0  # bytes per rank: half
    for layers in r["rank_layer_bytes"]:
        assert [2 * b for b in layers] == r["unsharded_layer_bytes"]
    assert r["top1_agreement"] >= 11 / 12, (r["tokens_unsharded"], r["tokens_sharded"])  # same codes per head up to rounding


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    import distributed_worker
    return distributed_worker.write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama-4kv")


def eval_args(model, out):
    return [*CLI, "eval", "--model", str(model), "--methods", SWEEP, "--tasks", "ppl,kl", "--context", "96", "--scored", "16",
            "--out", str(out), "--no-charts", "--no-progress"]


def test_eval_sweep_over_two_ranks(tiny_dir, tmp_path):
    two, one = tmp_path / "two.json", tmp_path / "one.json"
    p = run(launch_cmd(2, eval_args(tiny_dir, two)))
    assert two.exists(), f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.stdout.count("| bits/elt |") == 1  # only rank 0 prints the table
    q = run([sys.executable, *eval_args(tiny_dir, one)])
    assert q.returncode == 0, q.stderr[-3000:]
    d2, d1 = json.loads(two.read_text()), json.loads(one.read_text())
    assert d2["meta"]["ranks"] == 2 and d1["meta"]["ranks"] == 1
    r2, r1 = d2["records"], d1["records"]
    assert [r["label"] for r in r2] == [r["label"] for r in r1] and len(r1) == 4
    assert [r["rank"] for r in r2] == [0, 1, 0, 1]  # round-robin: 2 configs per rank
    for a, b in zip(r2, r1):
        for k in ("config", "nbytes", "layer_nbytes", "n_scored", "context"): assert a[k] == b[k], k
        for k in ("ppl", "ppl_fp16", "kl_mean", "top1_agreement", "bits_per_element"):
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-7), (a["label"], k, a[k], b[k])


def http(port, path, body=None, timeout=300):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", None if body is None else json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r: return json.loads(r.read())


def test_serve_under_mlx_launch(tiny_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    cmd = launch_cmd(2, [*CLI, "serve", "--model", str(tiny_dir), "--method", SERVE_METHOD, "--port", str(port),
                         "--max-tokens", str(MAX_TOKENS)])
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ), start_new_session=True)
    try:
        for _ in range(1200):
            try: http(port, "/health", timeout=5); break
            except OSError:
                assert proc.poll() is None, f"server exited: {log.read_text()[-3000:]}"
                time.sleep(0.5)
        messages = [{"role": "user", "content": "Name three colors."}]
        res = http(port, "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0})
        st = http(port, "/veloxquant/stats")
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # mlx.launch and both ranks: the process group started above
        try: proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL); proc.wait()
    # stock mlx-lm on the unsharded model, same method and chat template
    import mlx_lm, veloxquant as vq
    from veloxquant.models import load_model
    model, tok = load_model(str(tiny_dir))
    vq.compress(model, vq.parse_method(SERVE_METHOD))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    toks = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS, prompt_cache=model.make_cache())]
    assert res["choices"][0]["message"]["content"] == tok.decode([t for t in toks if t not in tok.eos_token_ids])
    assert st["ranks"] == 2 and st["requests"], st
    req = st["requests"][-1]
    assert req["rank_cache_bytes"] == [req["cache_bytes"]] * 2 and req["cache_bytes"] > 0, req
    assert "rank 1 of 2: 2 KV heads per rank" in log.read_text()


REFUSALS = """
import os, sys, pathlib
from veloxquant.serve import serve_main
for i, args in enumerate((["--method", "fp16"], ["--model", sys.argv[1], "--pipel"])):  # the default model: 9 query, 3 KV heads
    try: serve_main(args)
    except SystemExit as e:  # one file per rank and refusal: the two ranks' stdout lines can interleave
        pathlib.Path(sys.argv[2], f"rank{os.environ.get('MLX_RANK', '?')}-{i}").write_text(f"exit {e.code}")
"""


def test_serve_refuses_what_it_cannot_shard(tiny_dir, tmp_path):
    p = run(launch_cmd(2, ["-c", REFUSALS, str(tiny_dir), str(tmp_path)]), timeout=300)  # both checks run before mlx-lm's server is imported
    out = p.stderr + p.stdout
    codes = {f.name: f.read_text() for f in tmp_path.iterdir()}
    assert codes == {f"rank{r}-{i}": "exit 2" for r in (0, 1) for i in (0, 1)}, (codes, out[-3000:])  # 2 refusals x 2 ranks
    assert "the model has 9 query heads and 3 KV heads: tensor parallelism over 2 ranks" in out, out[-3000:]
    assert "--pipeline: mlx-lm's pipeline stages" in out and "drop --pipeline" in out, out[-3000:]
