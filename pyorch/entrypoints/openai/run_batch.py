"""`pyorch run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL flags]`: OpenAI's batch file format
(vLLM's `vllm run-batch`), run offline through the same handlers as the server.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with `url`
`/v1/chat/completions` or `/v1/completions`; each output line, in input order, is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`: on success
`body` is what the endpoint would answer and `error` is null; on failure `body` is null,
`status_code` the HTTP status the server would give and `error` the message. A bad line fails
alone; the others run, all at once, batched by the engine. The engine flags are `pyorch serve`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any, Optional

from pyorch.entrypoints.openai import cli_args

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")
# `pyorch serve` flags that shape only the HTTP server: run-batch refuses them (rather than
# ignore them) unless they keep their default.
_SERVER_ONLY = ("host", "port", "api_key", "metrics_require_api_key", "max_request_body_bytes",
                "renderer_num_workers", "allowed_origins", "allowed_methods", "allowed_headers",
                "allow_credentials", "root_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
                "ssl_cert_reqs", "uvicorn_log_level", "disable_uvicorn_access_log",
                "disable_fastapi_docs", "enable_tokenizer_info_endpoint",
                "enable_server_load_tracking", "metrics_prefix", "disable_log_stats",
                "enable_log_requests", "max_log_len")
# Requests in flight at once; the engine batches them (max_num_seqs per step).
_MAX_CONCURRENT = 1024


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    cli_args.add_cli_args(parser)
    parser.description = ("Run an OpenAI batch file (JSON lines of custom_id, method, url, "
                          "body) and write one result line per request, in input order.")
    parser.epilog = "example:\n  pyorch run-batch -i requests.jsonl -o results.jsonl --model M"
    group = parser.add_argument_group("batch")
    group.add_argument("-i", "--input-file", required=True,
                       help="the batch file (a local path; '-' reads stdin)")
    group.add_argument("-o", "--output-file", required=True,
                       help="where the results go (a local path; '-' writes stdout)")
    return parser


def main(args: argparse.Namespace) -> int:
    from pyorch.entrypoints.openai.cli_refused import refusal

    problem = refusal(args) or _server_only_flag(args)
    for name in (args.input_file, args.output_file):
        if name.startswith(("http://", "https://")):
            problem = problem or f"{name}: URLs are not supported, only local files"
    if problem is not None:
        print(f"pyorch run-batch: error: {problem}", file=sys.stderr)
        return 2
    try:
        lines = _read_lines(args.input_file)
    except OSError as e:
        print(f"pyorch run-batch: error: cannot read {args.input_file}: {e}", file=sys.stderr)
        return 1
    return asyncio.run(_run(args, lines))


def _server_only_flag(args: argparse.Namespace) -> Optional[str]:
    defaults = cli_args.add_cli_args(argparse.ArgumentParser()).parse_args([])
    for name in _SERVER_ONLY:
        if getattr(args, name) != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            return f"{flag} applies to the HTTP server (pyorch serve), not to run-batch"
    return None


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return [line for line in sys.stdin.read().splitlines() if line.strip()]
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line.strip()]


async def _run(args: argparse.Namespace, lines: list[str]) -> int:
    from pyorch.engine.async_llm import AsyncLLM
    from pyorch.entrypoints.openai.api_server import load_chat_template, make_server_context
    from pyorch.entrypoints.openai.serving_chat import OpenAIServingChat
    from pyorch.entrypoints.openai.serving_completion import OpenAIServingCompletion

    try:
        chat_template = load_chat_template(args.chat_template)
        engine = AsyncLLM.from_engine_args(cli_args.engine_args_from(args))
    except Exception as e:
        print(f"pyorch run-batch: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        args.disable_log_requests = True  # one log line per batch line would drown the log
        ctx = make_server_context(args, engine, cli_args.served_model_names(args),
                                  chat_template, None)
        handlers = {"/v1/chat/completions": OpenAIServingChat(ctx),
                    "/v1/completions": OpenAIServingCompletion(ctx)}
        limit = asyncio.Semaphore(_MAX_CONCURRENT)

        async def one(line: str) -> dict[str, Any]:
            async with limit:
                return await _run_line(line, handlers)

        results = await asyncio.gather(*(one(line) for line in lines))
    finally:
        engine.shutdown()
    _write(args.output_file, results)
    failed = sum(r["error"] is not None for r in results)
    print(f"pyorch run-batch: {len(results)} requests, {failed} failed; results in "
          f"{args.output_file}", file=sys.stderr)
    return 0


async def _run_line(line: str, handlers: dict[str, Any]) -> dict[str, Any]:
    from pyorch.engine.exceptions import EngineDeadError
    from pyorch.entrypoints.openai.errors import OpenAIError
    from pyorch.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    custom_id: Optional[str] = None
    try:
        item = json.loads(line)
        if not isinstance(item, dict):
            raise OpenAIError("a batch line must be a JSON object")
        custom_id = item.get("custom_id")
        url, body = item.get("url"), item.get("body")
        if not isinstance(custom_id, str):
            raise OpenAIError("custom_id must be a string", param="custom_id")
        if item.get("method", "POST") != "POST":
            raise OpenAIError("method must be POST", param="method")
        if url not in handlers:
            raise OpenAIError(f"URL {url} was used. Supported endpoints: "
                              f"{', '.join(SUPPORTED_URLS)}", param="url")
        if not isinstance(body, dict):
            raise OpenAIError("body must be a JSON object", param="body")
        if body.get("stream"):
            raise OpenAIError("stream=true is not supported in batch mode", param="body.stream")
        request_type = ChatCompletionRequest if url == "/v1/chat/completions" \
            else CompletionRequest
        try:
            req = request_type.model_validate(body)
        except ValueError as e:  # pydantic's ValidationError
            raise OpenAIError(f"invalid body: {e}", param="body") from None
        handler = handlers[url]
        method = handler.create_chat_completion if url == "/v1/chat/completions" \
            else handler.create_completion
        response = await method(req, _NoDisconnect())
        return _result(custom_id, 200, json.loads(response.body), None)
    except OpenAIError as e:
        return _result(custom_id, e.status, None, e.message)
    except json.JSONDecodeError as e:
        return _result(custom_id, 400, None, f"the line is not valid JSON: {e}")
    except EngineDeadError as e:
        return _result(custom_id, 503, None, str(e))
    except (ValueError, TypeError) as e:
        return _result(custom_id, 400, None, str(e))


def _result(custom_id: Optional[str], status: int, body: Optional[dict],
            error: Optional[str]) -> dict[str, Any]:
    """One output line (vLLM's BatchRequestOutput)."""
    return {"id": f"pyorch-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"pyorch-batch-{uuid.uuid4().hex}",
                         "body": body},
            "error": error}


class _NoDisconnect:
    """The handlers' `raw` request: a batch line has no client that could go away."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()  # never returns: no disconnect
        return {}


def _write(path: str, results: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if path == "-":
        sys.stdout.write(text)
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)  # a reader never sees a half-written file
