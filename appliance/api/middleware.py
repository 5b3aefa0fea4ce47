"""ASGI middleware around every request: the body's limits (size, JSON nesting), the audit-entry
header and the TEE-state header.

All are plain ASGI (not Starlette's `BaseHTTPMiddleware`, which buffers and slows streamed
responses). Each needs only a response's start, and a streamed response sends a body message
per write (per token or so: W3's server CPU), so each wraps `send` in a plain function that
hands a body message on as it is, returning the awaitable of the `send` it wraps: one function
call per message, no coroutine of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.api.audit_trail import AuditTrail, request_receipt
from appliance.api.errors import APIError, api_error_for_audit, internal_error
from appliance.json_limits import JsonNestingError, check_request_body
from audit.errors import AuditError

AUDIT_ENTRY_HEADER = b"audit-entry"
API_PREFIX = "/v1/"

TEE_HEADER = b"x-inferno-tee"
ATTESTATION_HEADER = b"x-inferno-attestation"


def _too_large(max_bytes: int) -> str:
    return f"the request body is larger than the server's limit of {max_bytes} bytes"


class BodySizeLimit:
    """Answers 413 for a request body over `max_bytes`: at once when Content-Length says so,
    otherwise as soon as the bytes received pass the limit (chunked uploads). Answers 400 for a
    JSON body (or one without a Content-Type, which FastAPI parses as JSON too) nested deeper
    than appliance.json_limits.MAX_NESTING_DEPTH, once it is received whole and before the route
    parses it: Python's json parser recurses, and 100,000 levels would end in RecursionError."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            error = APIError(413, _too_large(self.max_bytes))
            await error.response()(scope, receive, send)
            return
        num_received = 0
        json_body: list[bytes] | None = [] if _may_be_json(scope) else None

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                num_received += len(chunk)
                # Raised inside the route's body read; the error handlers answer 413 or 400.
                if num_received > self.max_bytes:
                    raise HTTPException(413, _too_large(self.max_bytes))
                if json_body is not None:
                    json_body.append(chunk)
                    if not message.get("more_body", False):
                        try:
                            check_request_body(b"".join(json_body))
                        except JsonNestingError as exc:
                            raise HTTPException(400, str(exc)) from exc
            return message

        await self.app(scope, limited_receive, send)


def _may_be_json(scope: Scope) -> bool:
    """Whether FastAPI would parse this request's body as JSON: no Content-Type, or
    application/json or application/*+json."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            return media_type == b"application/json" or (
                media_type.startswith(b"application/") and media_type.endswith(b"+json")
            )
    return True


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _dropped() -> None:
    """What sending a message that is not sent awaits."""


class TeeStateHeader:
    """Adds `X-Inferno-TEE: <state>` to every response, so a client always sees whether the
    machine serving it was attested: `VERIFIED`, `PENDING` (the gate has not decided yet),
    `FAILED`, or `UNVERIFIED` (tee.mode = insecure-dev); and `X-Inferno-Attestation`, the
    standing verdict's id and age (`id=<32 hex>; age=<s>`, `PENDING`, or `UNVERIFIED`), so that
    a client can require a fresh one. Both are read as each response starts
    (appliance.attestation.service.TeeService.state and .attestation_header)."""

    def __init__(
        self, app: ASGIApp, state: Callable[[], str], attestation: Callable[[], str] | None = None
    ):
        self.app = app
        self.state = state
        self.attestation = attestation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        def send_with_header(message: Message) -> Awaitable[None]:
            if message["type"] == "http.response.start":
                headers = [(TEE_HEADER, self.state().encode("ascii"))]
                if self.attestation is not None:
                    headers.append((ATTESTATION_HEADER, self.attestation().encode("ascii")))
                message["headers"] = [*message.get("headers", ()), *headers]
            return send(message)

        await self.app(scope, receive, send_with_header)


class AuditEntryHeader:
    """Adds `Audit-Entry: <origin> <index> <base64 leaf hash>` to every response under `/v1/`,
    naming the entry that records the request (appliance.api.audit_trail): the entry a route
    logged already (an accepted inference), or else an `api.request` logged now, as the
    response starts. If that cannot be logged, the response is replaced by a 503 (fail closed).

    It must wrap every middleware that may answer by itself (the body limit, authentication),
    so that their answers are logged too. Probes and scrapes (`/health`, `/live`, `/metrics`)
    are not API calls and are not logged.
    """

    def __init__(self, app: ASGIApp, trail: AuditTrail):
        self.app = app
        self.trail = trail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        started = refused = False

        async def start_with_entry(start: Message) -> None:
            nonlocal started, refused
            started = True
            receipt = request_receipt(scope)
            if receipt is None:
                try:
                    receipt = await self.trail.record_api_request(scope, start["status"])
                except AuditError as exc:
                    refused = True
                    await api_error_for_audit(exc).response()(scope, receive, send)
                    return
            entry = (AUDIT_ENTRY_HEADER, receipt.header_value().encode("ascii"))
            start["headers"] = [*start.get("headers", ()), entry]
            await send(start)

        def send_with_entry(message: Message) -> Awaitable[None]:
            if refused:
                return _dropped()  # the rest of a response the audit log could not record
            if message["type"] == "http.response.start":
                return start_with_entry(message)
            return send(message)

        try:
            await self.app(scope, receive, send_with_entry)
        except Exception:
            # Unexpected: the outermost error handler logs it and would answer 500 without the
            # header; answer here, logged, and let the handler see that a response started.
            if not started:
                await internal_error().response()(scope, receive, send_with_entry)
            raise
