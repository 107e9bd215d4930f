"""bench/api_server_cpu.py: its fake engine core's cadence and finishing, the client's SSE parsing
(over a chunked response cut at every byte), the summary, and a tiny end-to-end run through the
real pyorch-serve (and through the trivial server)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import time
from types import SimpleNamespace

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "api_server_cpu",
    os.path.join(os.path.dirname(__file__), "..", "..", "bench", "api_server_cpu.py"))
bench = importlib.util.module_from_spec(_SPEC)
sys.modules["api_server_cpu"] = bench  # its dataclasses look their module up
_SPEC.loader.exec_module(bench)

VOCAB = 512


def _config(max_num_seqs: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_model_len=64,
                                         max_num_batched_tokens=64),
        model_config=SimpleNamespace(vocab_size=VOCAB))


def test_fake_core_one_token_per_running_request_per_step():
    core = bench.FakeEngineCore(_config(max_num_seqs=2), step_ms=5)
    for rid, max_tokens in (("a", 2), ("b", 3), ("c", 1)):
        core.add_request(SimpleNamespace(request_id=rid, max_tokens=max_tokens))
    start = time.monotonic()
    steps = []
    while core.has_unfinished_requests():
        step = core.step()
        steps.append(({o.req_id: (len(o.new_token_ids), o.finish_reason) for o in step.outputs},
                      step.scheduled_new_req_ids))
        assert all(3 <= t < VOCAB for o in step.outputs for t in o.new_token_ids)
    assert time.monotonic() - start >= 3 * 0.005 * 0.9  # one tick per step
    assert steps == [
        ({"a": (1, None), "b": (1, None)}, ["a", "b"]),  # max_num_seqs=2: c waits
        ({"a": (1, "length"), "b": (1, None)}, []),
        ({"b": (1, "length"), "c": (1, "length")}, ["c"]),
    ]
    core.add_request(SimpleNamespace(request_id="d", max_tokens=5))
    core.step()
    core.abort_requests(["d"])
    assert not core.has_unfinished_requests() and core.make_stats().num_running_reqs == 0


def _response(events: list[str]) -> bytes:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    body = b"".join(b"%x\r\n%s\r\n" % (len(e.encode()), e.encode()) for e in events)
    return head + body + b"0\r\n\r\n"


def _event(payload: dict) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def test_client_parses_chunked_sse_cut_anywhere():
    events = [_event({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                        "content": ""}}]}),
              _event({"choices": [{"index": 0, "text": " t1"}]}),
              _event({"choices": [{"index": 0, "text": ""}]}),  # no text: not a token chunk
              _event({"choices": [{"index": 0, "delta": {"content": "é\n\"x"}}]}),
              _event({"choices": [{"index": 0, "text": " t2", "finish_reason": "length"}]})
              + _event({"choices": [], "usage": {"completion_tokens": 4}}),
              "data: [DONE]\n\n"]
    raw = _response(events)
    for cut in range(1, len(raw), 7):
        loop = asyncio.new_event_loop()
        try:
            result = bench.StreamResult()
            stream = bench.SSEStream(b"", result, loop.create_future())
            stream.connection_made(SimpleNamespace(write=lambda data: None,
                                                   close=lambda: None))
            stream.data_received(raw[:cut])
            stream.data_received(raw[cut:])
        finally:
            loop.close()
        assert (len(result.chunk_times), result.completion_tokens, result.done,
                result.error) == (3, 4, True, None), cut


def test_client_reports_http_and_stream_errors():
    loop = asyncio.new_event_loop()
    try:
        for raw, message in (
                (b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}", "404 Not Found"),
                (_response([_event({"error": {"message": "boom", "code": 500}})]), "boom")):
            result = bench.StreamResult()
            stream = bench.SSEStream(b"", result, loop.create_future())
            stream.connection_made(SimpleNamespace(write=lambda data: None,
                                                   close=lambda: None))
            stream.data_received(raw)
            assert message in (result.error or "") and not result.done
    finally:
        loop.close()


def test_cpu_seconds_counts_this_process():
    before = bench.cpu_seconds(os.getpid())
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    assert bench.cpu_seconds(os.getpid()) - before >= 0.05


def test_summary():
    def ok(times: list[float], tokens: int) -> object:
        return bench.StreamResult(start=0.0, chunk_times=times, completion_tokens=tokens,
                                  done=True)

    results = [ok([1.0, 1.1, 1.2, 1.3], 4), ok([1.0, 1.2, 1.4], 6),
               bench.StreamResult(error="connect: refused")]
    s = bench.summarize(results, wall_s=2.0, output_len=4)
    assert (s["num_ok"], s["num_failed"], s["chunks"], s["tokens"]) == (2, 1, 7, 10)
    assert s["tokens_per_chunk"] == pytest.approx(10 / 7)
    assert s["chunks_per_s"] == pytest.approx(7 / 0.4)  # first chunk to last
    assert s["itl_p50_ms"] == pytest.approx(100.0) and s["itl_max_ms"] == pytest.approx(200.0)
    assert s["ttft_p50_ms"] == pytest.approx(1000.0)
    assert s["errors"] == ["connect: refused"]


@pytest.fixture(scope="module")
def word_model(tmp_path_factory) -> str:
    """config.json and a word-level tokenizer ("t3".."t511", one token each): all the bench's
    server reads (the fake core loads no weights)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("word_model")
    vocab = {f"t{i}": i for i in range(3, VOCAB)} | {"<unk>": 0, "<s>": 1, "</s>": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                               bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} t4{% endif %}")
    tok.save_pretrained(path)
    transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_tiny_run_through_pyorch_serve(word_model, tmp_path, endpoint):
    out = tmp_path / "result.json"
    argv = ["--model", word_model, "--endpoint", endpoint, "--streams", "3", "--input-len", "5",
            "--output-len", "6", "--step-ms", "5", "--output-json", str(out),
            "--server-log", str(tmp_path / "server.log")]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    r = report["result"]
    assert (r["num_ok"], r["num_failed"], r["tokens"]) == (3, 0, 18)
    # Each stream's text came in 1..6 chunks (merged only if the server fell behind).
    assert 3 <= r["chunks"] <= 18 and r["tokens_per_chunk"] >= 1.0
    assert r["server_cpu_s"] >= 0  # a 50 ms run may not reach one clock tick
    assert report["config"]["endpoint"] == endpoint


def test_tiny_run_through_the_trivial_server(tmp_path):
    r = bench.run(bench.parse_args(["--target", "trivial", "--streams", "4",
                                    "--output-len", "5", "--step-ms", "5",
                                    "--server-log", str(tmp_path / "server.log")]))
    assert (r["num_ok"], r["tokens"], r["chunks"]) == (4, 20, 20)
    assert r["itl_p50_ms"] >= 4.0
