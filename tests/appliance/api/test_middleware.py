"""The middleware on minimal apps in-process: even an unexpected error's 500 names the entry that
records it (the real server's routes do not fail unexpectedly on purpose), and a streamed
body's messages pass every middleware without a coroutine of its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path

import httpx
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from appliance.api.access_log import AccessLog
from appliance.api.audit_trail import RECEIPT_STATE, AuditTrail
from appliance.api.errors import install_error_handlers
from appliance.api.metrics import ServerMetrics
from appliance.api.middleware import AuditEntryHeader, TeeStateHeader
from audit.log import AuditLog, AuditLogSettings
from audit.store import AuditReceipt


def test_an_unexpected_error_is_answered_500_with_its_audit_entry(tmp_path: Path) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/v1/broken")
    async def broken() -> None:
        raise RuntimeError("a bug")

    settings = AuditLogSettings("inferno.test/mw", f"sqlite:///{tmp_path}/a.db", tmp_path / "k")
    with AuditLog.open(settings) as log:
        app.add_middleware(AuditEntryHeader, trail=AuditTrail(log, ServerMetrics("m"), "m"))

        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.get("/v1/broken")

        response = asyncio.run(call())
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "internal server error; see the server log"
        _, index, _ = response.headers["audit-entry"].split(" ")
        [(_, data)] = list(log.store.entries(int(index), int(index)))
    entry = json.loads(data)
    assert entry["details"] == {"method": "GET", "route": "/v1/broken", "status": 500}


def test_a_streamed_body_message_passes_every_middleware_as_the_servers_own_send(
    tmp_path: Path,
) -> None:
    """The middleware need only a response's start: a body message (one per streamed write)
    reaches the server's `send` through plain calls, so the awaitable the app gets back is the
    very one the server's `send` returned, and what is sent is unchanged and in order."""
    body = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\ndata: {"n":3}\n\n', b""]
    sent: list[Message] = []
    returned: list[Awaitable[None]] = []
    received: list[Awaitable[None]] = []

    async def record(message: Message) -> None:
        sent.append(message)

    def server_send(message: Message) -> Awaitable[None]:
        returned.append(record(message))
        return returned[-1]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i, chunk in enumerate(body):
            message = {"type": "http.response.body", "body": chunk, "more_body": i < 2}
            received.append(send(message))
            await received[-1]

    settings = AuditLogSettings("inferno.test/mw", f"sqlite:///{tmp_path}/a.db", tmp_path / "k")
    with AuditLog.open(settings) as log:
        trail = AuditTrail(log, ServerMetrics("m"), "m")
        stack = AccessLog(TeeStateHeader(AuditEntryHeader(app, trail), state=lambda: "PENDING"))
        # An accepted inference request: its route logged its entry already.
        receipt = AuditReceipt("inferno.test/mw", 7, b"\x01" * 32)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        scope["state"] = {RECEIPT_STATE: receipt}

        async def receive() -> Message:
            return {"type": "http.disconnect"}

        asyncio.run(stack(scope, receive, server_send))
    assert received == returned[1:], "each body message's awaitable is the server's own"
    assert [m.get("body") for m in sent[1:]] == body
    headers = dict(sent[0]["headers"])
    assert headers[b"x-inferno-tee"] == b"PENDING"
    assert headers[b"audit-entry"] == receipt.header_value().encode()
