"""vLLM's side routes: `/invocations` (SageMaker), `/load`, `/reset_prefix_cache` and
`/tokenizer_info`, plus the ASGI middleware that counts the server load for `/load`.

- `POST /invocations` routes a body by its shape, as vLLM does: the first request type it
  validates as, in vLLM's order (chat completion, then completion), handles it; a body that
  is neither is a 400 naming the expected types. Pooling types join when pyorch has them.
- `GET /load` answers `{"server_load": N}`, the number of generation requests in flight
  (counted only with `--enable-server-load-tracking`, else always 0, as in vLLM).
- `POST /reset_prefix_cache` drops the engine's prefix cache and answers `{"success": bool}`:
  false while requests hold blocks (callers may retry), as vLLM's newest server does.
- `GET /tokenizer_info` (only with `--enable-tokenizer-info-endpoint`): the tokenizer's init
  settings, its class and the server's chat template, in vLLM's shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pyorch.entrypoints.openai.errors import OpenAIError, error_response
from pyorch.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
)

logger = logging.getLogger("pyorch.entrypoints.openai.api_server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
}
# The routes whose requests /load counts (those that run the model).
LOAD_TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations",
                                "/v1/responses", "/v1/embeddings"})

router = APIRouter()


# ---- /invocations -------------------------------------------------------------------------------
# vLLM's order: an earlier type wins when a body validates as several.
_INVOCATION_TYPES: list[tuple[type[pydantic.BaseModel], str, str]] = [
    (ChatCompletionRequest, "chat", "create_chat_completion"),
    (CompletionRequest, "completion", "create_completion"),
]


@router.post("/invocations", responses=_ERRORS)
async def invocations(request: Request) -> Any:
    """SageMaker's inference route: a chat-completion or completion body, told apart by its
    fields, answered as /v1/chat/completions or /v1/completions would."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"malformed JSON body: {e}") from None
    for request_type, handler_name, method in _INVOCATION_TYPES:
        try:
            parsed = request_type.model_validate(body)
        except pydantic.ValidationError:
            continue
        handler = getattr(request.app.state, handler_name)
        return await getattr(handler, method)(parsed, request)
    names = [t.__name__ for t, _, _ in _INVOCATION_TYPES]
    raise OpenAIError(f"Cannot find suitable handler for request. Expected one of: {names}")


# ---- /load --------------------------------------------------------------------------------------
@router.get("/load")
async def server_load(request: Request) -> JSONResponse:
    """vLLM's server-load metric: generation requests in flight (with
    --enable-server-load-tracking; 0 without)."""
    return JSONResponse({"server_load": request.app.state.server_load_metrics})


class LoadTrackingMiddleware:
    """Counts the requests in flight on `LOAD_TRACKED_PATHS` in `app.state.server_load_metrics`:
    from the request's arrival until its response's last byte is sent (a stream counts until
    it ends) or the client goes away. A plain ASGI middleware, like vLLM's load_aware_call."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope["type"] != "http" or path not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load_metrics += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.state.server_load_metrics -= 1

        async def counting_send(message: dict) -> None:
            try:
                await send(message)
            finally:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    finish()

        try:
            await self.app(scope, receive, counting_send)
        finally:
            finish()


# ---- /reset_prefix_cache ------------------------------------------------------------------------
@router.post("/reset_prefix_cache", responses=_ERRORS)
async def reset_prefix_cache(request: Request, reset_running_requests: bool = False,
                             reset_external: bool = False) -> JSONResponse:
    """Drops the prefix cache: `{"success": true}`, or false while requests hold KV blocks.
    vLLM's query parameters that need what pyorch lacks are refused, not ignored."""
    if reset_running_requests:
        raise OpenAIError("reset_running_requests=true (preempting the running requests to "
                          "reset the cache) is not supported by this server; retry once they "
                          "finish", param="reset_running_requests")
    if reset_external:
        raise OpenAIError("reset_external=true: this server has no external (KV connector) "
                          "prefix cache", param="reset_external")
    logger.info("resetting the prefix cache")
    success = await request.app.state.ctx.engine.reset_prefix_cache()
    return JSONResponse({"success": bool(success)})


# ---- /tokenizer_info ----------------------------------------------------------------------------
tokenizer_info_router = APIRouter()


@tokenizer_info_router.get("/tokenizer_info", responses=_ERRORS)
async def tokenizer_info(request: Request) -> JSONResponse:
    """The tokenizer's settings (vLLM's TokenizerInfoResponse): its init kwargs without file
    paths, `tokenizer_class`, and `chat_template` when the server was given one."""
    ctx = request.app.state.ctx
    if ctx.tokenizer is None:
        return error_response("this server has no tokenizer (skip_tokenizer_init)", 400)
    return JSONResponse(tokenizer_info_dict(ctx.tokenizer, ctx.chat_template))


def tokenizer_info_dict(tokenizer: Any, chat_template: Any) -> dict[str, Any]:
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for path_key in ("vocab_file", "merges_file", "tokenizer_file", "gguf_file",
                     "name_or_path"):
        config.pop(path_key, None)
    info: dict[str, Any] = {k: _jsonable(v) for k, v in config.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        info["chat_template"] = chat_template
    return info


def _jsonable(value: Any) -> Any:
    """A JSON value for a tokenizer setting: special tokens (AddedToken) as their text."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
