"""OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, for every failure.

`code` is the HTTP status and `type` its name, as vLLM's server answers. Handlers installed by
`install_error_handlers` make FastAPI's own failures (validation -> 400 instead of 422, unknown
routes, wrong methods, unexpected exceptions) use the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyorch.engine.exceptions import EngineDeadError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error to answer with `status` (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def error_body(message: str, status: int = 400, param: Optional[str] = None) -> dict[str, Any]:
    err_type = _TYPES.get(status)
    if err_type is None:
        try:
            err_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
        except ValueError:
            err_type = "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: Optional[str] = None,
                   headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def engine_dead_message() -> str:
    return "the engine is dead (its engine-core process exited or failed); the server is stopping"


# pydantic names the member of a union it tried in `loc` ("constrained-str", "list[int]"): not
# a field, so left out of `param`.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list"})


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or "-" in part or part in _UNION_TAGS)


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    # Text that is not valid Unicode says the most: it comes first.
    errors = sorted(errors, key=lambda e: e.get("type") != "string_unicode")
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_union_tag(x)]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            param = None
            parts.append(f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if param is None and where:
            param = where
        msg = err.get("msg", "invalid value")
        if err.get("type") == "string_unicode":
            msg = "contains a lone UTF-16 surrogate or other text that is not valid Unicode"
        parts.append(f"{where or 'body'}: {msg}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, headers=exc.headers)

    @app.exception_handler(OpenAIError)
    async def _on_openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(engine_dead_message(), 503)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500)
