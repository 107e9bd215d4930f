"""Hostile input (issue 20): text that cannot be encoded, bodies and prompts far too large, long
lists, and a 50 MB prompt sent while others stream. Each is refused early with OpenAI's error body
naming the field, and never slows down the requests around it."""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest
from conftest import MAX_MODEL_LEN, start_server

from pyorch.engine.input_processor import check_prompt_text, max_chars_per_token
from pyorch.entrypoints.openai.cli_args import DEFAULT_MAX_BODY
from pyorch.entrypoints.openai.protocol import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_STOP,
)

SURROGATE = "\ud800"


def _post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """json.dumps escapes a lone surrogate as JSON's "\\ud800" (httpx's json= cannot encode
    it), which is what a hostile client sends."""
    return http.post(path, content=json.dumps(body),
                     headers={"content-type": "application/json"})


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


# ---- text that cannot be encoded -----------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": f"{SURROGATE} hi", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", f"a{SURROGATE}"], "max_tokens": 1}, "prompt.1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": f"x{SURROGATE}"}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["a", "\udfff"]}, "stop.1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "bad_words": [f"{SURROGATE}x"]},
     "bad_words.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {SURROGATE}"}],
                              "max_tokens": 1}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": SURROGATE}]}], "max_tokens": 1},
     "messages.1.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi",
                                            "name": SURROGATE}], "max_tokens": 1},
     "messages.0.name"),
    ("/tokenize", {"prompt": f"{SURROGATE} hi"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": f"\udc80{SURROGATE}"}]},
     "messages.0.content"),
])
def test_lone_surrogates_are_400_naming_the_field(http, path, body, param):
    error = _error(_post(http, path, body))
    assert error["param"] == param and "surrogate" in error["message"]
    assert error["type"] == "BadRequestError"


def test_surrogate_pairs_are_fine(http):
    # A correctly paired surrogate in JSON is one astral character, valid text.
    r = http.post("/tokenize", content='{"prompt": "hi \\ud83d\\ude00"}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["count"] >= 2


def test_bad_words_are_honoured(http):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    word = text.split()[0]
    blocked = http.post("/v1/completions", json={**body, "bad_words": [word]})
    assert blocked.status_code == 200
    assert not blocked.json()["choices"][0]["text"].split()[0:1] == [word]


# ---- every field is honoured or refused ----------------------------------------------------------
@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
    # OpenAI's deprecated forms of tools / tool_choice (tools themselves: test_serving_chat_tools)
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
])
def test_unsupported_fields_are_refused_by_name(http, path, extra, param):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "hi"})
    error = _error(http.post(path, json={**base, "max_tokens": 1, **extra}))
    assert error["param"] == param and "not supported" in error["message"]


def test_neutral_values_and_metadata_fields_are_accepted(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "text"}, "tool_choice": "none", "store": False,
            "metadata": {"k": "v"}, "user": "u", "best_of": 1}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---- the prompt length bound before tokenization -------------------------------------------------
def _tokenizer():
    from transformers import AutoTokenizer  # noqa: F401  (the server's loader, same files)

    from pyorch.engine.arg_utils import EngineArgs
    from pyorch.model_loader import get_tokenizer

    mc = EngineArgs(device="cpu", max_model_len=MAX_MODEL_LEN).create_engine_config().model_config
    return get_tokenizer(mc.model, mc.tokenizer)


def test_chars_per_token_bound_never_refuses_what_fits():
    tok = _tokenizer()
    k = max_chars_per_token(tok)
    assert k is not None and 16 <= k <= 256  # SmolLM2: byte-level BPE, no normalizer
    # The tightest strings: the longest token repeated, and texts of every kind of character.
    longest = max((t for t in tok.get_vocab()), key=len)
    text = tok.convert_tokens_to_string([longest])
    samples = [text * 50, "a" * 5000, " " * 5000, "\n" * 3000, "é" * 3000, "日本語" * 1000,
               "😀" * 1000, "<|im_start|>" * 300, "".join(chr(c) for c in range(32, 3000)),
               "http://example.com/" * 300]
    for s in samples:
        n = len(tok.encode(s, add_special_tokens=False))
        assert len(s) <= n * k, (s[:40], len(s), n, k)  # so len > max_len * k => n > max_len
    # Right at the bound, a text that encodes to exactly max_model_len tokens passes.
    at_bound = text * (len(text) and (MAX_MODEL_LEN * k) // len(text))
    check_prompt_text(at_bound, MAX_MODEL_LEN, k)
    with pytest.raises(ValueError, match="characters"):
        check_prompt_text(at_bound + "x" * (k + 1), MAX_MODEL_LEN, k)


def test_prompt_far_too_long_is_refused_without_tokenizing(http):
    k = max_chars_per_token(_tokenizer())
    assert k is not None
    huge = "hello " * (MAX_MODEL_LEN * k)  # ~6x the bound; would take seconds to encode whole
    for path, body, param in (
            ("/v1/completions", {"prompt": huge, "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": ["hi", huge], "max_tokens": 1}, "prompt.1"),
            ("/tokenize", {"prompt": huge}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}],
                                      "max_tokens": 1}, "messages"),
            ("/tokenize", {"messages": [{"role": "user", "content": huge}]}, "messages")):
        t0 = time.monotonic()
        error = _error(http.post(path, json=body))
        assert error["param"] == param and "maximum context length" in error["message"]
        assert time.monotonic() - t0 < 5, path


# ---- bounds on list fields -----------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * (MAX_STOP + 1)}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "s" * 5000}, "stop"),
    ("/v1/completions", {"prompt": "hi",
                         "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
     "logit_bias"),
    ("/v1/completions", {"prompt": ["hi"] * (MAX_PROMPTS + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["hi"] * 16, "n": MAX_SEQUENCES // 16 + 1}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["w"] * 129}, "bad_words"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages"),
])
def test_list_bounds_are_400_naming_the_field(http, path, body, param):
    error = _error(http.post(path, json=body))
    assert error["param"] is not None and error["param"].startswith(param), error


# ---- the request body limit ----------------------------------------------------------------------
def test_body_over_the_limit_is_413_before_parsing(http):
    big = b'{"prompt": "' + b"a" * (DEFAULT_MAX_BODY + 1) + b'"}'
    t0 = time.monotonic()
    error = _error(http.post("/v1/completions", content=big,
                             headers={"content-type": "application/json"}), 413)
    assert "--max-request-body-bytes" in error["message"] and time.monotonic() - t0 < 10

    def chunked():  # no Content-Length: the limit is checked while the body streams in
        yield b'{"prompt": "'
        for _ in range(DEFAULT_MAX_BODY // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    _error(http.post("/tokenize", content=chunked(),
                     headers={"content-type": "application/json"}), 413)
    assert http.get("/health").status_code == 200


# ---- a 50 MB prompt while others stream ----------------------------------------------------------
def _ttft(h: httpx.Client) -> float:
    body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    with h.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - t0
    raise AssertionError("no token streamed")


def _health(h: httpx.Client) -> float:
    t0 = time.monotonic()
    assert h.get("/health").status_code == 200
    return time.monotonic() - t0


# The hostile client: a separate process at nice 19, so that on a 2-core CI machine the CPU it
# spends building and sending 50 MB does not compete with the server under test (a real
# attacker sends from elsewhere); everything the server spends to refuse it still counts. Given
# "start I J ..." it sends hostile requests I, J, ... back to back, over and over, printing
# "INDEX STATUS SECONDS" for each, until "stop" (then "done").
_ATTACKER = r"""
import http.client, json, os, sys, threading, time, urllib.parse
os.nice(19)
url = urllib.parse.urlsplit(sys.argv[1])
hostile = json.loads(sys.argv[2])
payloads = [json.dumps({"prompt": kind * (size // len(kind))}).encode()
            for _, size, kind, _ in hostile]
stop = threading.Event()

def send(i):
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    t0 = time.monotonic()
    try:
        conn.request("POST", url.path + hostile[i][0], body=payloads[i],
                     headers={"content-type": "application/json"})
        status = conn.getresponse().status
    except OSError:
        status = -1
    conn.close()
    print(i, status, time.monotonic() - t0, flush=True)

def loop(indices):
    while not stop.is_set():
        for i in indices:
            send(i)

print("ready", flush=True)
worker = None
for line in sys.stdin:
    words = line.split()
    if words[0] == "start":
        stop.clear()
        worker = threading.Thread(target=loop, args=([int(w) for w in words[1:]],))
        worker.start()
    else:
        stop.set()
        worker.join()
        print("done", flush=True)
"""


@pytest.fixture(scope="module")
def one_thread_server(tmp_path_factory: pytest.TempPathFactory):
    """A server whose engine computes on one thread (OMP_NUM_THREADS=1), leaving the second
    core of a 2-core CI machine to the API server and the attacker. With the default two, every
    parallel region of the engine waits for its second thread whenever anything else runs
    (docs/architecture.md, GGUF on the CPU): idle TTFT itself moved 35-230 ms under one busy
    process, and this test compared the attacker's CPU with the engine's, not stalls."""
    proc = start_server(tmp_path_factory.mktemp("one_thread"), "one_thread", [],
                        env={"OMP_NUM_THREADS": "1"}).wait_ready()
    yield proc
    proc.terminate()


def test_50mb_prompt_does_not_stall_other_requests(one_thread_server):
    """A 50 MB prompt (and, separately, bodies under the limit) sent over and over while
    streaming requests run: their median time to first token and /health latency, against the
    same server idle, measured the same way in this test. Before the fix a 50 MB prompt was
    tokenized on the event loop for ~111 s, and everything else waited as long."""
    server = one_thread_server
    import subprocess
    import sys

    k = max_chars_per_token(_tokenizer()) or 1
    hostile = [  # (path, characters, repeated text, expected status)
        ("/v1/completions", 50 << 20, "x", 413),  # over the body limit
        # just under the body limit: parsed, then refused by the length bound alone
        ("/v1/completions", DEFAULT_MAX_BODY - 100, "y", 400),
        ("/tokenize", 2 * (MAX_MODEL_LEN * k + 1), "z_", 400),  # over the length bound
    ]
    attacker = subprocess.Popen([sys.executable, "-c", _ATTACKER, server.url,
                                 json.dumps(hostile)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert attacker.stdin is not None and attacker.stdout is not None
    assert attacker.stdout.readline().strip() == "ready"
    answers: list[tuple[int, int, float]] = []

    def rounds(h: httpx.Client, attack: tuple[int, ...], n: int = 7) -> tuple[float, float]:
        if attack:
            attacker.stdin.write(f"start {' '.join(map(str, attack))}\n")  # type: ignore
            attacker.stdin.flush()  # type: ignore[union-attr]
            time.sleep(0.2)  # the first bodies are on their way
        ttfts, healths = [], []
        for _ in range(n):
            ttfts.append(_ttft(h))
            healths.append(_health(h))
        if attack:
            attacker.stdin.write("stop\n")  # type: ignore[union-attr]
            attacker.stdin.flush()  # type: ignore[union-attr]
            for line in attacker.stdout:  # type: ignore[union-attr]
                if line.strip() == "done":
                    break
                index, code, seconds = line.split()
                answers.append((int(index), int(code), float(seconds)))
        return statistics.median(ttfts), statistics.median(healths)

    try:
        with httpx.Client(base_url=server.url, timeout=120) as h:
            rounds(h, (), 2)  # warm-up
            idle_ttft, idle_health = rounds(h, ())
            load_ttft, load_health = rounds(h, (0,))  # 50 MB prompts, back to back
            other_ttft, other_health = rounds(h, (1, 2))  # under the body limit
    finally:
        attacker.stdin.close()
        attacker.wait(60)
    print(f"\nTTFT median idle {idle_ttft * 1e3:.1f} ms, with 50 MB prompts in flight "
          f"{load_ttft * 1e3:.1f} ms, with 8 MB + /tokenize {other_ttft * 1e3:.1f} ms; /health "
          f"idle {idle_health * 1e3:.1f} ms, with 50 MB {load_health * 1e3:.1f} ms, with 8 MB "
          f"+ /tokenize {other_health * 1e3:.1f} ms; {len(answers)} hostile requests answered "
          f"in {min(a[2] for a in answers):.2f}-{max(a[2] for a in answers):.2f} s")
    assert {a[0] for a in answers} == {0, 1, 2}
    for which, code, seconds in answers:
        assert code == hostile[which][3], (which, code)
        assert seconds < 10, (which, seconds)  # was 111 s for the 50 MB prompt
    # Within 2x of idle; 10 ms of absolute slack for timer noise on millisecond latencies.
    assert load_ttft <= 2 * idle_ttft + 0.01, (idle_ttft, load_ttft)
    assert load_health <= 2 * idle_health + 0.01, (idle_health, load_health)
    # A /health request can land behind one 8 MB JSON parse holding the GIL (~12 ms, see below;
    # two fresh-clone CI runs measured 16.6 ms): one parse of slack on top of 2x idle.
    assert other_health <= 2 * idle_health + 0.025, (idle_health, other_health)
    # An 8 MB body is parsed as JSON before it can be refused (~12 ms holding the API server's
    # GIL, each, back to back here). With a one-thread engine, measured 0.7-1.3x of idle (alone
    # and beside a busy process); the two-thread server of earlier runs measured up to 5.2x in a
    # fresh-clone CI run, its engine waiting for its second thread. 3x: the stall this test
    # guards against (a body handled on the event loop) costs seconds.
    assert other_ttft <= 3 * idle_ttft + 0.01, (idle_ttft, other_ttft)


# ---- which routes need the API key (the middleware on its own) -----------------------------------
@pytest.mark.parametrize("protect_metrics", [False, True])
def test_api_key_covers_every_working_route(protect_metrics):
    import argparse

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pyorch.entrypoints.openai.api_server import OPEN_PATHS, ApiKeyMiddleware
    from pyorch.entrypoints.openai.cli_args import add_cli_args

    args = argparse.ArgumentParser()
    add_cli_args(args)
    flags = ["--api-key", "k"] + (["--metrics-require-api-key"] if protect_metrics else [])
    assert args.parse_args(flags).metrics_require_api_key is protect_metrics
    app = FastAPI()
    for path in ("/health", "/ping", "/version", "/metrics", "/tokenize", "/detokenize",
                 "/v1/models", "/anything"):
        app.add_api_route(path, lambda: {"ok": True})
    open_paths = OPEN_PATHS - {"/metrics"} if protect_metrics else OPEN_PATHS
    app.add_middleware(ApiKeyMiddleware, api_key="k", open_paths=open_paths)
    with TestClient(app) as c:
        for path in ("/health", "/ping", "/version"):
            assert c.get(path).status_code == 200
        assert c.get("/metrics").status_code == (401 if protect_metrics else 200)
        for path in ("/tokenize", "/detokenize", "/v1/models", "/anything"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
