"""`pyorch run-batch` (pyorch/entrypoints/openai/run_batch.py): an OpenAI batch file in, one
result line per request out, in input order, through the real CLI (default model, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import BASE_ARGS

# The server flags minus the listening ones (run-batch serves no HTTP).
ENGINE_ARGS = [a for a in BASE_ARGS[4:]]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_run_batch(tmp_path):
    prompt = "The capital of France is"
    lines = [
        _line("chat", "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
               "temperature": 0}),
        _line("completion", "/v1/completions",
              {"prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 2}),
        _line("bad-url", "/v1/nowhere", {"prompt": "x"}),
        _line("bad-body", "/v1/completions", {"prompt": prompt, "temperature": -1}),
        _line("stream", "/v1/completions", {"prompt": prompt, "stream": True}),
        "not json",
        _line("again", "/v1/completions", {"prompt": prompt, "max_tokens": 5,
                                           "temperature": 0}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    run = subprocess.run([sys.executable, "-m", "pyorch.cli.main", "run-batch", "-i", str(src),
                          "-o", str(dst), *ENGINE_ARGS], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    results = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == \
        ["chat", "completion", "bad-url", "bad-body", "stream", None, "again"]
    by_id = {r["custom_id"]: r for r in results}
    chat = by_id["chat"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["usage"]["completion_tokens"] <= 4
    completion = by_id["completion"]["response"]["body"]
    assert len(completion["choices"]) == 2 and completion["usage"]["completion_tokens"] == 10
    # Greedy: the same prompt gives the same text in both lines.
    assert completion["choices"][0]["text"] == \
        by_id["again"]["response"]["body"]["choices"][0]["text"]
    for custom_id, words in (("bad-url", "Supported endpoints"), ("bad-body", "temperature"),
                             ("stream", "stream=true"), (None, "not valid JSON")):
        r = by_id[custom_id]
        assert r["response"]["status_code"] == 400 and r["response"]["body"] is None
        assert words in r["error"], r
    assert len({r["id"] for r in results}) == len(results)
    assert "7 requests, 4 failed" in run.stderr


def test_run_batch_refuses_urls_and_unsupported_flags(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    for extra, message in ((["-o", "https://example.com/out"], "URLs are not supported"),
                           (["-o", str(tmp_path / "o"), "--enable-lora"], "LoRA"),
                           (["-o", str(tmp_path / "o"), "--port", "9"],
                            "--port applies to the HTTP server")):
        run = subprocess.run([sys.executable, "-m", "pyorch.cli.main", "run-batch", "-i",
                              str(src), *extra], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr, run.stderr
