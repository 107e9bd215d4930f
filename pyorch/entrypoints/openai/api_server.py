"""The OpenAI-compatible HTTP server: FastAPI under uvicorn, in front of an `AsyncLLM`.

Processes: this one (HTTP, JSON, tokenization, chat templates, detokenization, SSE, metrics) and
the engine-core process that AsyncLLM starts (the step loop). Life cycle:
- start-up: bind the socket (a busy port fails at once), start the engine (loads the model,
  sizes the KV cache), print what was loaded, the KV capacity and the URL, then serve;
- SIGTERM / SIGINT: uvicorn stops accepting, lets in-flight requests finish for up to
  `GRACEFUL_SHUTDOWN_S`, cancels the rest (which aborts them in the engine), then
  `AsyncLLM.shutdown()` stops the core; exit code 0;
- engine death: noticed within `_WATCHDOG_PERIOD_S`; requests in flight get a 503 (or an error
  event), /health answers 503 for `ENGINE_DEAD_GRACE_S`, then the server stops listening, gives
  open connections `ENGINE_DEAD_DRAIN_S` and exits with code 1 (`os._exit`: the core is gone,
  nothing is left to clean up, and interpreter teardown took another 1.5 s). A timer forces that
  exit `ENGINE_DEAD_EXIT_S` after the death was noticed, whatever the event loop is doing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

import pyorch
from pyorch import envs
from pyorch.engine.exceptions import EngineDeadError
from pyorch.entrypoints.openai import cli_args
from pyorch.entrypoints.openai.errors import (
    OpenAIError,
    engine_dead_message,
    error_response,
    install_error_handlers,
)
from pyorch.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from pyorch.entrypoints.openai.server_routes import (
    LoadTrackingMiddleware,
    tokenizer_info_router,
)
from pyorch.entrypoints.openai.server_routes import router as side_router
from pyorch.entrypoints.openai.serving_chat import OpenAIServingChat, resolve_content_format
from pyorch.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pyorch.entrypoints.openai.serving_engine import ServerContext
from pyorch.entrypoints.openai.serving_pooling import OpenAIServingPooling, require_generate
from pyorch.entrypoints.openai.serving_pooling import router as pooling_router
from pyorch.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponsesRequest
from pyorch.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pyorch.logger import configure_logging

logger = logging.getLogger("pyorch.entrypoints.openai.api_server")

GRACEFUL_SHUTDOWN_S = 10.0
ENGINE_DEAD_GRACE_S = 0.5
ENGINE_DEAD_DRAIN_S = 1.0
ENGINE_DEAD_EXIT_S = 5.0  # docs/serving.md promises exit code 1 within this of the death
_WATCHDOG_PERIOD_S = 0.25
GC_THRESHOLDS = (10_000, 20, 10)  # gc.set_threshold once serving (see run_server)
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
    404: {"model": ErrorResponse}, 503: {"model": ErrorResponse},
}

router = APIRouter()


# ---- routes ------------------------------------------------------------------------------------
@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """200 while the engine is alive; 503 once it is dead."""
    try:
        await request.app.state.ctx.engine.check_health()
    except EngineDeadError:
        return error_response(engine_dead_message(), 503)
    return Response(status_code=200)


@router.get("/ping", responses={503: {"model": ErrorResponse}})
@router.post("/ping", responses={503: {"model": ErrorResponse}})
async def ping(request: Request) -> Response:
    """vLLM's (SageMaker's) alias of /health."""
    return await health(request)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=pyorch.__version__)


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def list_models(request: Request) -> ModelList:
    ctx: ServerContext = request.app.state.ctx
    root = ctx.engine.model_config.model
    return ModelList(data=[ModelCard(id=name, root=root, max_model_len=ctx.max_model_len)
                           for name in ctx.served_model_names])


@router.post("/v1/completions", responses=_ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    require_generate(request.app.state.ctx, "Completions")
    return await request.app.state.completion.create_completion(body, request)


@router.post("/v1/chat/completions", responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    require_generate(request.app.state.ctx, "Chat Completions")
    return await request.app.state.chat.create_chat_completion(body, request)


@router.post("/v1/responses", responses=_ERRORS)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    return await request.app.state.responses.create_response(body, request)


@router.get("/v1/responses/{response_id}", responses=_ERRORS)
async def retrieve_response(response_id: str, request: Request) -> Any:
    """A stored response (PYORCH_ENABLE_RESPONSES_API_STORE=1), as vLLM's retrieve."""
    return request.app.state.responses.retrieve(response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=_ERRORS)
async def cancel_response(response_id: str, request: Request) -> Any:
    """vLLM cancels only background responses, which this server refuses: a 400 or 404."""
    request.app.state.responses.cancel(response_id)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(body: Union[TokenizeCompletionRequest, TokenizeChatRequest],
                   request: Request) -> TokenizeResponse:
    return await request.app.state.tokenization.tokenize(body)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    try:
        return await request.app.state.tokenization.detokenize(body)
    except (ValueError, TypeError, OverflowError) as e:
        raise OpenAIError(f"cannot detokenize: {e}", param="tokens") from None


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text format. Refreshes the scheduler gauges first: the engine reports them only
    while it steps, so after the last request leaves they would otherwise stay stale."""
    state = request.app.state
    engine = state.ctx.engine
    if state.stat_logger is None:  # --disable-log-stats: no engine metrics are recorded
        return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    if not engine.errored and hasattr(engine, "get_scheduler_stats"):
        with contextlib.suppress(Exception):
            stats = await asyncio.wait_for(engine.get_scheduler_stats(), timeout=2.0)
            state.stat_logger.record(stats, None)
    return Response(state.stat_logger.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- middleware --------------------------------------------------------------------------------
# Routes that do no per-request work and answer without the API key (vLLM leaves every path
# outside /v1 open; we protect /tokenize, /detokenize and the rest too). /metrics joins the
# protected ones with --metrics-require-api-key.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/docs", "/redoc",
                        "/docs/oauth2-redirect", "/openapi.json"})


def _route_path(scope: dict) -> str:
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path


class ApiKeyMiddleware:
    """401 without `Authorization: Bearer <key>` on every path but `open_paths`. A plain ASGI
    middleware, so streaming and client-disconnect detection pass through untouched."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            if _route_path(scope) not in self.open_paths:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not secrets.compare_digest(given, self.expected):
                    response = error_response(
                        "invalid or missing API key: send 'Authorization: Bearer <key>'", 401,
                        headers={"WWW-Authenticate": "Bearer"})
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


# After a 413 the rest of an oversized body is read and dropped (so that the client, still
# sending, can read the answer) up to this much; a longer body just has its connection closed.
_DRAIN_LIMIT_BYTES = 64 << 20


class BodyLimitMiddleware:
    """413 for a request body over `limit` bytes, before anything parses it: at once from
    Content-Length, else as soon as the streamed (chunked) body passes the limit. The body is
    read here and replayed to the app; later receive() calls (disconnects) pass through."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def _too_large(self, scope: dict, receive: Any, send: Any, received: int,
                         more: bool) -> None:
        while more and received <= _DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client is gone: nobody to answer
            received += len(message.get("body", b""))
            more = message.get("more_body", False)
        response = error_response(
            f"the request body is larger than the server's limit of {self.limit} bytes "
            "(--max-request-body-bytes)", 413, headers={"Connection": "close"})
        await response(scope, receive, send)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = 0
            if declared > self.limit:
                await self._too_large(scope, receive, send, 0, True)
                return
        chunks: list[bytes] = []
        received = 0
        more = True
        first: Optional[dict] = None
        while more:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # a disconnect: the app sees it on its first receive
                break
            body = message.get("body", b"")
            received += len(body)
            more = message.get("more_body", False)
            if received > self.limit:
                await self._too_large(scope, receive, send, received, more)
                return
            chunks.append(body)
        replay: dict = first or {"type": "http.request", "body": b"".join(chunks),
                                 "more_body": False}
        replayed = False

        async def replaying_receive() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return replay
            return await receive()

        await self.app(scope, replaying_receive, send)


# ---- the app -----------------------------------------------------------------------------------
async def _watch_engine(app: FastAPI) -> None:
    """Notices engine death; answers stay 503 for a moment, then the server stops (exit 1)."""
    engine = app.state.ctx.engine
    while True:
        await asyncio.sleep(_WATCHDOG_PERIOD_S)
        try:
            await engine.check_health()
        except EngineDeadError as e:
            server = getattr(app.state, "server", None)
            if server is not None and server.should_exit:
                return  # already stopping (a signal that reached the core too): not a failure
            logger.error("the engine is dead (%s); stopping the server", e)
            break
    app.state.exit_code = 1
    if server is not None:  # a real server (not a test app): the exit is guaranteed
        timer = threading.Timer(ENGINE_DEAD_EXIT_S, _exit_now, args=(1,))
        timer.daemon = True
        timer.start()
    await asyncio.sleep(ENGINE_DEAD_GRACE_S)
    if server is not None:
        server.config.timeout_graceful_shutdown = ENGINE_DEAD_DRAIN_S
        server.should_exit = True


async def _log_stats(stat_logger: Any) -> None:
    """The periodic stats line (vLLM's do_log_stats loop)."""
    while True:
        await asyncio.sleep(envs.PYORCH_LOG_STATS_INTERVAL)
        stat_logger.log()


def _exit_now(code: int) -> None:
    """Leaves at once (no interpreter teardown), after flushing what was logged."""
    with contextlib.suppress(Exception):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def build_app(ctx: ServerContext, stat_logger: Any, args: argparse.Namespace) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watchdog = asyncio.create_task(_watch_engine(app), name="pyorch-engine-watchdog")
        log_stats = None
        if getattr(app.state, "log_stat_logger", None) is not None:
            log_stats = asyncio.create_task(_log_stats(app.state.log_stat_logger),
                                            name="pyorch-log-stats")
        ready = getattr(app.state, "on_ready", None)
        if ready is not None:
            ready()
        try:
            yield
        finally:
            watchdog.cancel()
            if log_stats is not None:
                log_stats.cancel()
            ctx.engine.shutdown()

    docs: dict[str, Any] = {}
    if getattr(args, "disable_fastapi_docs", False):
        docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pyorch OpenAI-compatible API", version=pyorch.__version__,
                  root_path=args.root_path or "", lifespan=lifespan, **docs)
    app.include_router(router)
    app.include_router(side_router)
    if getattr(args, "enable_tokenizer_info_endpoint", False):
        app.include_router(tokenizer_info_router)
    app.include_router(pooling_router)
    install_error_handlers(app)
    app.state.server_load_metrics = 0
    if getattr(args, "enable_server_load_tracking", False):  # innermost: counts what runs
        app.add_middleware(LoadTrackingMiddleware, state=app.state)
    limit = getattr(args, "max_request_body_bytes", 0)
    if limit:
        app.add_middleware(BodyLimitMiddleware, limit=limit)
    if args.api_key:  # outside the body limit: a request without the key is not even read
        open_paths = OPEN_PATHS
        if getattr(args, "metrics_require_api_key", False):
            open_paths = OPEN_PATHS - {"/metrics"}
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, open_paths=open_paths)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                       allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
    app.state.ctx = ctx
    app.state.stat_logger = stat_logger
    app.state.completion = OpenAIServingCompletion(ctx)
    app.state.chat = OpenAIServingChat(ctx)
    app.state.responses = OpenAIServingResponses(ctx)
    app.state.tokenization = OpenAIServingTokenization(ctx)
    app.state.pooling = OpenAIServingPooling(ctx)
    app.state.exit_code = 0
    return app


# ---- running it --------------------------------------------------------------------------------
def load_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: a file's content, or the template itself (it must look like Jinja)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value.encode().decode("unicode_escape") if "\\n" in value else value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _ignore(signum: int, frame: Any) -> None:
    pass


def _say(message: str) -> None:
    print(f"pyorch-serve: {message}", flush=True)


def _startup_report(engine: Any, names: list[str], url: str) -> None:
    mc = engine.model_config
    sc = engine.config.scheduler_config
    pid = engine.engine_core_pid
    dtype = str(mc.dtype).removeprefix("torch.")
    _say(f"loaded {mc.model} as {', '.join(names)} ({dtype}, device {mc.device}, "
         f"max_model_len {mc.max_model_len})")
    # The engine-core pid is for operators (monitoring, a stuck core) and for the tests that
    # kill it to check that the server notices.
    _say(f"KV cache: {engine.kv_cache_capacity_tokens} tokens ({engine.num_kv_blocks} blocks "
         f"of {engine.block_size}); max_num_seqs {sc.max_num_seqs}, max_num_batched_tokens "
         f"{sc.max_num_batched_tokens}"
         + (f" (prompt chunks sized for {sc.target_step_ms:g} ms steps)" if sc.target_step_ms
            else "") + f"; engine core pid {pid}")
    _say(f"serving the OpenAI API at {url}/v1 (docs at {url}/docs)")
    missing = [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is None]
    if missing:  # uvicorn falls back to asyncio's loop and h11, its pure-Python HTTP parser
        logger.warning("%s not installed: uvicorn serves with %s, which costs the API server "
                       "several times more CPU per streamed token (pip install %s)",
                       " and ".join(missing),
                       " and ".join({"uvloop": "asyncio's event loop",
                                     "httptools": "h11"}[m] for m in missing),
                       " ".join(missing))


def make_server_context(args: argparse.Namespace, engine: Any, names: list[str],
                        chat_template: Optional[str],
                        renderer: Optional[ThreadPoolExecutor]) -> ServerContext:
    """What the handlers need, from the flags and a started engine (server and run-batch)."""
    max_model_len = engine.model_config.max_model_len
    assert max_model_len is not None  # ModelConfig.resolve() sets it (or raises)
    tokenizer = engine.get_tokenizer()
    return ServerContext(
        engine=engine, served_model_names=names, max_model_len=max_model_len,
        vocab_size=engine.model_config.vocab_size, tokenizer=tokenizer,
        chat_template=chat_template, log_requests=args.enable_log_requests,
        max_log_len=getattr(args, "max_log_len", None),
        chars_per_token=engine.input_processor.chars_per_token, renderer=renderer,
        max_logprobs=engine.model_config.max_logprobs,
        default_sampling_params=engine.model_config.get_diff_sampling_param(),
        response_role=args.response_role,
        enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        exclude_tools_when_tool_choice_none=getattr(
            args, "exclude_tools_when_tool_choice_none", False),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        structured_outputs_disable_any_whitespace=getattr(
            args, "structured_outputs_disable_any_whitespace", False),
        scheduling_policy=args.scheduling_policy,
        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
        content_format=resolve_content_format(
            args.chat_template_content_format,
            chat_template or getattr(tokenizer, "chat_template", None)))


def settle_heap() -> None:
    """Called once before serving: keeps the garbage collector off the streaming path."""
    # NOTE(apisrv): the start-up heap (tokenizer, transformers, torch, FastAPI) lives as long as
    # the process: frozen (as vLLM's server does), no collection walks it again. Per-token
    # garbage (a few containers per stream per step) then still triggered a young collection
    # every ~700 allocations and a full one every few seconds, each full one a pause of tens of
    # ms over the live requests, all streams stalled: at 500 streams GC was ~15% of the
    # process's CPU and set the p99 inter-chunk gap (85 ms vs 35 ms with these thresholds,
    # bench/api_server_cpu.py). Almost all of that garbage is freed by reference counting; what
    # the larger thresholds delay is only the reclaiming of reference cycles.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_server(args: argparse.Namespace) -> int:
    """Runs until SIGTERM/SIGINT (returns 0) or engine death (returns 1); 2 on a bad setting."""
    import uvicorn

    from pyorch.engine.async_llm import AsyncLLM
    from pyorch.metrics.loggers import LoggingStatLogger
    from pyorch.metrics.prometheus import (
        METRIC_PREFIXES,
        PrometheusStatLogger,
        cache_config_info,
    )

    configure_logging()
    names = cli_args.served_model_names(args)
    try:
        chat_template = load_chat_template(args.chat_template)
        cli_args.check_tool_args(args)
        engine_args = cli_args.engine_args_from(args)
        config = engine_args.create_engine_config()  # fails fast on bad settings
    except (ValueError, FileNotFoundError) as e:
        print(f"pyorch serve: error: {e}", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"pyorch serve: error: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 1
    # SIGTERM during the model load: leave through the normal clean-up path.
    signal.signal(signal.SIGTERM, _interrupt)
    # --disable-log-stats: no stats at all, as in vLLM (no log line, no engine metrics).
    stat_logger: Optional[PrometheusStatLogger] = None
    log_stat_logger: Optional[LoggingStatLogger] = None
    if not args.disable_log_stats:
        stat_logger = PrometheusStatLogger(
            names[0], config.model_config.max_model_len or 2048,
            prefix=METRIC_PREFIXES[args.metrics_prefix])
        log_stat_logger = LoggingStatLogger()
    try:
        engine = AsyncLLM.from_engine_args(
            engine_args, stat_loggers=[x for x in (stat_logger, log_stat_logger) if x])
    except KeyboardInterrupt:
        sock.close()
        return 0
    except Exception as e:
        sock.close()
        print(f"pyorch serve: error: the engine failed to start: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    renderer = ThreadPoolExecutor(max_workers=args.renderer_num_workers,
                                  thread_name_prefix="pyorch-renderer")
    ctx = make_server_context(args, engine, names, chat_template, renderer)
    if ctx.default_sampling_params:
        _say(f"default sampling parameters from the generation config: "
             f"{ctx.default_sampling_params}")
    if stat_logger is not None:
        stat_logger.set_cache_config_info(cache_config_info(engine.config.cache_config))
    app = build_app(ctx, stat_logger, args)
    app.state.log_stat_logger = log_stat_logger
    host, port = sock.getsockname()[:2]
    scheme = "https" if args.ssl_certfile else "http"
    shown = f"[{host}]" if ":" in host else host
    url = f"{scheme}://{shown}:{port}{args.root_path or ''}"
    app.state.on_ready = lambda: _startup_report(engine, names, url)
    config_uv = uvicorn.Config(
        app, log_level=args.uvicorn_log_level,
        access_log=not (args.disable_log_requests or args.disable_uvicorn_access_log),
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        # uvicorn annotates this int, but uses it as an asyncio timeout: a float works.
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,  # type: ignore[arg-type]
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    server = uvicorn.Server(config_uv)
    app.state.server = server
    # uvicorn re-raises the signal it stopped on once it is done; these handlers turn that into
    # a no-op, so a server stopped by SIGTERM or Ctrl-C exits 0 after its clean shutdown.
    signal.signal(signal.SIGTERM, _ignore)
    signal.signal(signal.SIGINT, _ignore)
    settle_heap()
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
        renderer.shutdown(wait=False, cancel_futures=True)
    if app.state.exit_code:
        _say("exiting with code 1: the engine core died")
        _exit_now(int(app.state.exit_code))
    return int(app.state.exit_code)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m pyorch.entrypoints.openai.api_server [MODEL] [flags]` (same as pyorch-serve)."""
    parser = argparse.ArgumentParser(prog="pyorch-serve")
    cli_args.add_cli_args(parser)
    return cli_args.main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
