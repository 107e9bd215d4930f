"""`pyorch bench serve` against a fake OpenAI-compatible SSE server started in this file
(http.server in a thread): payloads, SSE parsing, timings, failures, the rate sweep, arrivals."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from pyorch.benchmarks import common, serve, serve_client
from pyorch.benchmarks.serve_client import (
    RequestResult,
    RequestSpec,
    arrival_offsets,
    build_payload,
    send_request,
    summarize,
)

FIRST_DELAY = 0.05  # s before the first token
TOKEN_DELAY = 0.02  # s between tokens


class FakeServer:
    """Streams `max_tokens` one-character chunks, TOKEN_DELAY apart, then a usage chunk and
    [DONE]. Every `fail_every`-th POST (counting from 1) answers HTTP 500."""

    def __init__(self, fail_every: int = 0, send_usage: bool = True):
        self.bodies: list[dict] = []
        self.posts = 0
        self.lock = threading.Lock()
        self.fail_every, self.send_usage = fail_every, send_usage
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                if self.path != "/v1/models":
                    self.send_error(404)
                    return
                self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.posts += 1
                    number = fake.posts
                    fake.bodies.append(body)
                if fake.fail_every and number % fake.fail_every == 0:
                    self._json(500, {"error": {"message": "injected failure"}})
                    return
                chat = self.path == "/v1/chat/completions"
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(FIRST_DELAY)
                n = body["max_tokens"]
                for i in range(n):
                    choice = {"index": 0, "delta": {"content": "a"}} if chat else {
                        "index": 0, "text": "a"}
                    self._event({"id": "x", "choices": [choice]})
                    if i + 1 < n:
                        time.sleep(TOKEN_DELAY)
                if fake.send_usage:
                    self._event({"id": "x", "choices": [], "usage": {
                        "prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _event(self, obj):
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            def _json(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(argv)


def test_defaults_and_flags():
    args = _parse([])
    assert math.isinf(args.request_rate) and args.request_rates is None
    assert args.endpoint == "/v1/completions" and args.ignore_eos and args.burstiness == 1.0
    args = _parse(["--request-rates", "1,2,4,inf", "--max-concurrency", "3", "--arrival", "fixed",
                   "--base-url", "http://h:1/", "--no-ignore-eos", "--extra-body", '{"top_k": 1}'])
    assert args.request_rates[:3] == [1.0, 2.0, 4.0] and math.isinf(args.request_rates[3])
    assert serve.base_url(args) == "http://h:1" and not args.ignore_eos
    assert args.extra_body == {"top_k": 1} and args.max_concurrency == 3
    assert serve.base_url(_parse(["--port", "9001"])) == "http://127.0.0.1:9001"
    with pytest.raises(SystemExit):
        _parse(["--request-rates", "1,0"])


def test_payloads():
    spec = RequestSpec("hello", 1, 7)
    body = build_payload("/v1/completions", "m", spec, ignore_eos=True, extra_body={"top_p": 0.5})
    assert body["prompt"] == "hello" and body["max_tokens"] == 7 and body["stream"]
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert body["top_p"] == 0.5 and "messages" not in body
    chat = build_payload("/v1/chat/completions", "m", spec, ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "hello"}]
    assert chat["max_completion_tokens"] == 7 and "ignore_eos" not in chat and "prompt" not in chat


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("usage", [True, False])
def test_one_request_timings(endpoint, usage):
    import httpx

    async def go(url):
        async with httpx.AsyncClient() as client:
            body = build_payload(endpoint, "fake-model", RequestSpec([3, 4, 5], 3, 6), True)
            return await send_request(client, url + endpoint, body, 3, time.perf_counter())

    with FakeServer(send_usage=usage) as server:
        r = asyncio.run(go(server.url))
    assert r.success, r.error
    assert r.output_tokens == 6 and r.output_tokens_from_usage == usage
    # Single gaps jitter with the client's scheduling; the arrival of each chunk cannot precede
    # its sending, so the cumulative times are bounded below.
    assert r.ttft_s >= FIRST_DELAY and len(r.itl_s) == 5
    assert r.ttft_s + sum(r.itl_s) >= FIRST_DELAY + 5 * TOKEN_DELAY
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    assert server.bodies[0]["prompt" if endpoint == "/v1/completions" else "messages"]


def test_http_error_is_recorded():
    import httpx

    async def go(url):
        async with httpx.AsyncClient() as client:
            body = build_payload("/v1/completions", "m", RequestSpec("x", 1, 2), True)
            return await send_request(client, url + "/v1/completions", body, 1, 0.0)

    with FakeServer(fail_every=1) as server:
        r = asyncio.run(go(server.url))
    assert not r.success and r.error.startswith("HTTP 500")


def test_summarize_known_data():
    def req(ttft, itl, out):
        return RequestResult(success=True, prompt_len=10, output_tokens=out, ttft_s=ttft,
                             itl_s=itl, e2e_s=ttft + sum(itl))
    results = [req(0.1, [0.01, 0.03], 3), req(0.3, [0.02], 2),
               RequestResult(success=False, error="boom")]
    s = summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["boom"])
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(12.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)
    assert s["itl_ms"]["p50"] == pytest.approx(20) and s["itl_ms"]["mean"] == pytest.approx(20)
    assert s["tpot_ms"]["mean"] == pytest.approx((20 + 20) / 2)  # 40ms/2 and 20ms/1
    assert s["e2e_ms"]["p90"] == pytest.approx(140 + 0.9 * (320 - 140))


def test_goodput_counts_requests_within_every_slo():
    def req(ttft, itl, out):
        return RequestResult(success=True, prompt_len=10, output_tokens=out, ttft_s=ttft,
                             itl_s=itl, e2e_s=ttft + sum(itl))
    # TPOT 20, 10, 50 ms; TTFT 100, 300, 50 ms; E2E 140, 310, 150 ms
    results = [req(0.1, [0.01, 0.03], 3), req(0.3, [0.01], 2), req(0.05, [0.05, 0.05], 3)]
    s = summarize(results, duration_s=2.0, slos_ms={"ttft": 200.0, "tpot": 30.0})
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.5)
    assert s["goodput_slos_ms"] == {"ttft": 200.0, "tpot": 30.0}
    s = summarize(results, duration_s=2.0, slos_ms={"e2el": 151.0})
    assert s["good_requests"] == 2
    assert "request_goodput" not in summarize(results, duration_s=2.0)
    assert serve_client.parse_goodput("ttft:500") == ("ttft", 500.0)
    for bad in ("ttft", "itl:5", "tpot:x", "e2el:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            serve_client.parse_goodput(bad)


def test_prefix_repetition_sweep_with_goodput(tmp_path):
    out = tmp_path / "serve.json"
    with FakeServer() as server:
        args = _parse(["--base-url", server.url, "--prompt-format", "token-ids",
                       "--vocab-size", "100", "--num-prompts", "6",
                       "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len",
                       "12", "--prefix-repetition-suffix-len", "2",
                       "--prefix-repetition-num-prefixes", "2",
                       "--prefix-repetition-output-len", "3", "--goodput", "ttft:60000",
                       "e2el:60000", "--no-plot", "--output-json", str(out)])
        assert serve.main(args) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert doc["workload"]["dataset"] == "prefix_repetition"
    assert run["good_requests"] == 6 and run["request_goodput"] > 0
    sent = server.bodies[1:]  # after the test request
    assert all(len(b["prompt"]) == 14 and b["max_tokens"] == 3 for b in sent)
    assert len({tuple(b["prompt"][:12]) for b in sent}) == 2


def test_arrivals():
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 10.0, arrival="fixed") == pytest.approx([0.0, 0.1, 0.2, 0.3])
    poisson = np.diff(arrival_offsets(20001, 5.0, seed=1))
    assert poisson.mean() == pytest.approx(0.2, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    steady = np.diff(arrival_offsets(20001, 5.0, burstiness=4.0, seed=1))
    assert steady.mean() == pytest.approx(0.2, rel=0.05)
    assert steady.std() / steady.mean() == pytest.approx(0.5, rel=0.05)  # gamma: CV 1/sqrt(k)
    assert arrival_offsets(5, 5.0, seed=3) == arrival_offsets(5, 5.0, seed=3)


def test_sweep_against_fake_server(tmp_path):
    out = tmp_path / "serve.json"
    with FakeServer(fail_every=4) as server:
        args = _parse(["--base-url", server.url, "--prompt-format", "token-ids",
                       "--vocab-size", "100", "--num-prompts", "6", "--random-input-len", "8",
                       "--random-output-len", "4", "--request-rates", "inf,20",
                       "--max-concurrency", "4",
                       "--output-json", str(out)])
        rc = serve.main(args)
    assert rc == 1  # some requests failed, by design
    doc = json.loads(out.read_text())
    assert (tmp_path / "serve.png").stat().st_size > 1000
    assert doc["model"] == "fake-model"
    assert [r["request_rate"] for r in doc["runs"]] == [20.0, "inf"]  # sorted, lightest first
    # POST 1 is the test request; then 12 more: numbers 4, 8, 12 fail
    assert server.posts == 13
    assert sum(r["failed"] for r in doc["runs"]) == 3
    for run in doc["runs"]:
        ok = [q for q in run["requests"] if q["success"]]
        assert run["completed"] == len(ok) and run["completed"] + run["failed"] == 6
        assert all(q["output_tokens"] == 4 and q["prompt_len"] == 8 for q in ok)
        assert run["output_throughput"] == pytest.approx(4 * len(ok) / run["duration_s"])
        assert run["request_throughput"] == pytest.approx(len(ok) / run["duration_s"])
        assert run["ttft_ms"]["p50"] >= FIRST_DELAY * 1e3
        assert all(len(q["itl_s"]) == 3 for q in ok)
        assert run["e2e_ms"]["p50"] >= (FIRST_DELAY + 3 * TOKEN_DELAY) * 1e3
        assert run["itl_ms"]["p50"] == pytest.approx(
            common.percentile([g * 1e3 for q in ok for g in q["itl_s"]], 50))
        assert run["errors"] and run["errors"][0].startswith("HTTP 500")
    lightest, heaviest = doc["runs"]
    assert lightest["itl_p50_over_lightest"] == pytest.approx(1.0)
    assert heaviest["itl_p50_over_lightest"] == pytest.approx(
        heaviest["itl_ms"]["p50"] / lightest["itl_ms"]["p50"])
    # rate 20 with 6 requests: the last is sent no earlier than its arrival offset
    assert max(q["start_s"] for q in lightest["requests"]) > 0.0
    for body in server.bodies:
        assert body["ignore_eos"] is True and body["stream"] is True
    sent = [b for b in server.bodies[1:]]
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 8 for b in sent)
    assert all(b["max_tokens"] == 4 for b in sent)


def test_concurrency_cap():
    """--max-concurrency 2 with rate inf: never more than 2 streams at once."""
    with FakeServer() as server:
        args = _parse(["--base-url", server.url, "--prompt-format", "token-ids",
                       "--vocab-size", "100", "--num-prompts", "6", "--random-input-len", "4",
                       "--random-output-len", "3", "--max-concurrency", "2", "--no-plot"])
        run = asyncio.run(_one_run(args))
    spans = [(q["start_s"], q["start_s"] + q["e2e_s"]) for q in run["requests"]]
    for t, _ in spans:
        assert sum(1 for a, b in spans if a <= t + 1e-4 and t < b - 1e-4) <= 2


async def _one_run(args):
    import httpx

    async with httpx.AsyncClient() as client:
        specs = serve.make_requests(args, None, 100, seed=0)
        return await serve.run_rate(client, args, args.base_url, "fake-model", specs,
                                    math.inf, seed=0)


def test_plot_reads_runs_back_from_json(tmp_path):
    """The unthrottled run's rate is the string "inf" once written to JSON: plotting the file's
    runs again works."""
    from pyorch.benchmarks import serve

    runs = [{"request_rate": rate, "request_throughput": tput,
             "ttft_ms": {"p50": 10.0 * tput, "p99": 20.0 * tput},
             "itl_ms": {"p50": 5.0, "p99": 9.0}} for rate, tput in ((4.0, 3.9), ("inf", 50.0))]
    path = tmp_path / "serve.png"
    serve.plot(str(path), json.loads(json.dumps(runs)), "replot")
    assert path.stat().st_size > 1000
