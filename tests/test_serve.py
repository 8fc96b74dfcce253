"""`veloxquant serve` end to end: mlx-lm's OpenAI-compatible server on localhost with a compressed cache,
real default model, concurrent requests batched, prefix reuse, compressed bytes reported."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import veloxquant as vq
from veloxquant.core import parse_method

METHOD = "affine:key_bits=8,value_bits=8,window=0"  # 8-bit: batched tokens equal one-by-one ones (see test_batch); window 0: these short chats would otherwise fit the default fp16 window and store nothing coded
MAX_TOKENS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def post(port, messages, max_tokens=MAX_TOKENS):
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r: return json.loads(r.read())


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r: return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", "from veloxquant.cli import main; main()", "serve", "--method", METHOD,
                                 "--port", str(port), "--max-tokens", str(MAX_TOKENS)], stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ))
    try:
        for _ in range(600):
            try:
                get(port, "/health"); break
            except OSError:
                if proc.poll() is not None: raise RuntimeError(f"server exited: {log.read_text()}")
                time.sleep(0.5)
        yield port, log
    finally:
        proc.terminate()
        try: proc.wait(timeout=30)
        except subprocess.TimeoutExpired: proc.kill()


def direct(model, tok, messages):
    "Greedy tokens of stock mlx_lm.stream_generate with the same method, same chat template."
    import mlx_lm
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    toks = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=MAX_TOKENS, prompt_cache=model.make_cache())]
    return len(prompt), tok.decode([t for t in toks if t not in tok.eos_token_ids])


@pytest.mark.slow
def test_serve_batches_compressed_requests(server, real):
    port, log = server
    model, tok, _ = real
    qa = [{"role": "user", "content": "What is the capital of France?"}]
    qb = [{"role": "user", "content": "Name three primary colors."}]
    res = {}
    threads = [threading.Thread(target=lambda k, m: res.__setitem__(k, post(port, m)), args=(k, m)) for k, m in (("a", qa), ("b", qb))]
    for t in threads: t.start()
    for t in threads: t.join()
    a, b = res["a"]["choices"][0]["message"]["content"], res["b"]["choices"][0]["message"]["content"]
    assert "Paris" in a
    assert any(c in b.lower() for c in ("red", "blue", "yellow"))

    # the same answers as direct generation with the same method (8-bit codes: batched = one-by-one tokens)
    vq.compress(model, parse_method(METHOD))
    try:
        for r, m in ((res["a"], qa), (res["b"], qb)):
            n_prompt, text = direct(model, tok, m)
            assert r["usage"]["prompt_tokens"] == n_prompt
            assert r["choices"][0]["message"]["content"] == text

        # a follow-up sharing the first conversation as its prefix: served from mlx-lm's LRUPromptCache
        qc = qa + [{"role": "assistant", "content": a}, {"role": "user", "content": "And the capital of Italy?"}]
        rc = post(port, qc)
        c = rc["choices"][0]["message"]["content"]
        assert rc["usage"]["prompt_tokens_details"]["cached_tokens"] > 20  # the shared prefix came from the cache
        assert "Rome" in c
        n_prompt, text = direct(model, tok, qc)
        assert rc["usage"]["prompt_tokens"] == n_prompt
        # the server prefilled this prompt in other chunks (cached prefix built by decode steps, then per chat
        # segment), so its codes are not bit-identical to one prefill; the greedy words agree on this prompt
        assert c.split()[:4] == text.split()[:4]
    finally:
        vq.decompress(model)

    stats = get(port, "/veloxquant/stats")
    assert stats["method"]["method"] == "affine" and stats["method"]["key_bits"] == 8
    reqs = stats["requests"]
    assert len(reqs) == 3
    assert [r["max_batch"] for r in reqs[:2]] == [2, 2]  # the two concurrent requests were decoded in one batch
    assert stats["decode_steps_by_batch"].get("2", 0) >= 1
    for r in reqs:  # compressed: 8.5 bits per element vs 16
        assert 0 < r["cache_bytes"] < r["fp16_bytes"] / 1.5 and r["bits_per_element"] < 9
    # an empty text prompt gets a 400 and the server keeps generating (mlx-lm alone would lose its generation thread)
    body = json.dumps({"prompt": "", "max_tokens": 3}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60); raise AssertionError("empty prompt was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and b"prompt is empty" in e.read()
    assert post(port, [{"role": "user", "content": "Say hello."}], max_tokens=4)["choices"][0]["message"]["content"]
    text = log.read_text()
    assert "decoding 2 sequence(s) together in one batch" in text
    assert text.count("bytes compressed with affine") == 4


def test_serve_refuses_bad_flags():
    "Bad method specs and mlx-lm's own --kv-bits (which turns batching off) exit with status 2 and a clear error."
    for args, msg in ((["--method", "affine:key_bits=7"], "key_bits=7"), (["--kv-bits", "4"], "--kv-bits is mlx-lm's own"),
                      (["--model", "/nonexistent"], "no such folder"), (["--model=/nonexistent"], "no such folder"),
                      (["--kv-bit", "4"], "--kv-bit is mlx-lm's own"),
                      (["--method", "turboquant:sinks=4"], "sinks>0"), (["--method", "turboquant:center=true"], "center=true")):
        p = subprocess.run([sys.executable, "-c", "from veloxquant.cli import main; main()", "serve", *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_generate_refuses_mlx_kv_flags_and_bad_models():
    "`veloxquant generate`: mlx-lm's own KV flags (also abbreviated) and missing models (both --model forms) exit 2."
    for args, msg in ((["--kv-bits", "4"], "--kv-bits configures"), (["--max-kv", "16"], "--max-kv configures"),
                      (["--model=/nonexistent"], "no such folder"), (["--model", "/tmp"], "no config.json")):
        p = subprocess.run([sys.executable, "-c", "from veloxquant.cli import main; main()", "generate", "--prompt", "hi", *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr[-500:])
