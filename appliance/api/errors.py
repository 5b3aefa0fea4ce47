"""The one place where failures become HTTP responses, in OpenAI's error shape.

`{"error": {"message", "type", "param", "code"}}`, with OpenAI's statuses and types: 400
`invalid_request_error` for anything wrong with the request (malformed JSON, a wrong type, an
unknown field, a context overflow), 404 for an unknown model or path, 413 for a body over the
limit, 429 with `Retry-After` when the server is full or the caller is over one of its limits
(appliance.api.limits), 503 while the model is not ready or when the audit log cannot record
the request (fail closed).
Messages never quote prompt or completion text; unexpected errors are logged with their
traceback and answered with a generic 500.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from appliance.api.schemas import ErrorDetail, ErrorResponse
from appliance.engine.async_engine import EngineDeadError
from appliance.engine.errors import ContextLengthExceededError, EngineError, InvalidRequestError
from audit.errors import AuditError, UnknownEntryError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error to answer with `status` in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unsupported(param: str, why: str) -> APIError:
    """A parameter this server understands but cannot honour as given."""
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "the request is invalid (OpenAI's invalid_request_error)"),
        (404, "the model is not served here"),
        (413, "the request body is over the size limit"),
        (429, "the server is full, or the caller over a limit; retry after Retry-After seconds"),
        (503, "not ready, shutting down, or the audit log cannot record the request"),
    )
}
"""Error statuses of the inference routes, for the OpenAPI schema."""


def api_error_for(exc: EngineError, *, prompt_param: str | None = None) -> APIError:
    """The response for an engine error; `prompt_param` names the prompt's field in this
    endpoint ("prompt" or "messages") for errors about its length."""
    if isinstance(exc, ContextLengthExceededError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine has stopped; see the server log", type="server_error")
    logger.error("engine error: %s", exc)
    return APIError(500, "the engine failed on this request", type="server_error")


def api_error_for_audit(exc: AuditError) -> APIError:
    """404 for a log position that does not exist; otherwise the log cannot record or read, and
    the request is refused (fail closed) with 503."""
    if isinstance(exc, UnknownEntryError):
        return APIError(404, str(exc), param="index", code="entry_not_found")
    logger.error("audit log: %s", exc)
    return APIError(
        503,
        "the audit log is unavailable, so this request is not served; retry later",
        type="server_error",
        code="audit_unavailable",
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(AuditError, _on_audit_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _on_engine_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected_error)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_audit_error(request: Request, exc: AuditError) -> JSONResponse:
    return api_error_for_audit(exc).response()


async def _on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
    return api_error_for(exc).response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = list(dict.fromkeys(_describe(error) for error in exc.errors()))
    param = problems[0][1]
    message = "; ".join(message for message, _ in problems[:_MAX_PROBLEMS])
    return APIError(400, message, param=param).response()


_MAX_PROBLEMS = 4


def _is_union_member(part: object) -> bool:
    """Whether a pydantic error location part names the member of a union that was tried
    (`str`, `list[constrained-int]`, `TextContentPart`) rather than a field or an index."""
    if not isinstance(part, str):
        return False
    return not part.isidentifier() or part[0].isupper() or part in ("str", "int", "float", "bool")


def _describe(error: Mapping[str, Any]) -> tuple[str, str | None]:
    """(message, param) for one pydantic error. Never includes the offending input."""
    loc = [str(part) for part in error.get("loc", ()) if not _is_union_member(part)]
    # The parameter as the client names it: `index`, not `path.index`.
    if loc[:1] in (["body"], ["path"], ["query"]):
        loc = loc[1:]
    param = ".".join(loc) or None
    kind = error.get("type")
    if kind == "json_invalid":
        reason = error.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({reason})", None
    if param is None:
        return "the request body must be a JSON object (Content-Type: application/json)", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"you must provide a {param} parameter", param
    return f"Invalid value for '{param}': {error.get('msg', 'invalid')}", param


# OpenAI endpoints a client may expect of an OpenAI-compatible server, and why they are not here.
_NOT_SERVED = {
    "/v1/embeddings": "this appliance serves one generative model and computes no embeddings",
}

SERVED_INFERENCE = (
    "it serves POST /v1/chat/completions, /v1/completions and /v1/responses, and GET /v1/models"
)


def not_found(method: str, path: str) -> APIError:
    """The 404 for a path nothing serves; for an OpenAI endpoint this appliance does not
    offer, the answer says so and names what it serves."""
    message = f"Invalid URL ({method} {path})"
    if (why := _NOT_SERVED.get(path.rstrip("/"))) is not None:
        message = f"{message}: {why}; {SERVED_INFERENCE}"
    return APIError(404, message, code="not_served" if why else None)


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return not_found(request.method, request.url.path).response()
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


def internal_error() -> APIError:
    """The answer to an unexpected error (logged with its traceback where it is caught)."""
    return APIError(500, "internal server error; see the server log", type="server_error")


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s %s", request.method, request.url.path)
    return internal_error().response()
