"""The audit-entry middleware on a minimal app in-process (the real server's routes do not fail
unexpectedly on purpose): even an unexpected error's 500 names the entry that records it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from fastapi import FastAPI

from appliance.api.audit_trail import AuditTrail
from appliance.api.errors import install_error_handlers
from appliance.api.metrics import ServerMetrics
from appliance.api.middleware import AuditEntryHeader
from audit.log import AuditLog, AuditLogSettings


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
