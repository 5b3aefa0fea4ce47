"""The composition root: `build(settings, audit_log)` wires the TEE service, the start-up
sequence, the audit trail, access control, the API routes, metrics, limits, the console and
middleware into one FastAPI app. Nothing here runs at import, and nothing here decides: the
start-up sequence (appliance.boot.startup) and the console's time series
(appliance.console.series) run with the app's lifespan and stop with it, and the audit log
closes after them.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from appliance.api import (
    attestation,
    audit_proofs,
    chat,
    completions,
    console_login,
    health,
    metrics,
    models,
    responses,
)
from appliance.api.access import ROUTE_ACCESS, AccessControl, document_access
from appliance.api.access_log import AccessLog
from appliance.api.admission import Admission
from appliance.api.audit_trail import AuditTrail
from appliance.api.errors import install_error_handlers
from appliance.api.limits import CallerLimits
from appliance.api.metrics import ServerMetrics
from appliance.api.middleware import AuditEntryHeader, BodySizeLimit, TeeStateHeader
from appliance.api.models import ServedModel
from appliance.api.readiness import Readiness
from appliance.attestation.service import TeeService
from appliance.auth.authenticator import Authenticator
from appliance.auth.denials import DenialReporter
from appliance.auth.idp_http import IdpHttp, idp_tls_context
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.oidc_login import ConsoleLogin
from appliance.auth.sessions import SessionStore
from appliance.boot.collector_pause import CollectorPause
from appliance.boot.engine_preload import EnginePreload
from appliance.boot.startup import StartUp
from appliance.config import Settings
from appliance.console import attestation_records, audit_export, ticket_sign_in, tokens, usage_page
from appliance.console import routes as console
from appliance.console.gpus import GpuMonitor
from appliance.console.pages import ConsolePages, SignIn
from appliance.console.series import SAMPLE_INTERVAL_S, SeriesSampler
from attestation.keys import KeyProvider
from audit.log import AuditLog

if TYPE_CHECKING:  # torch: the start-up's preload thread imports it (appliance.boot.engine_preload)
    from appliance.boot.weights import LoadedModel

logger = logging.getLogger(__name__)

# How long shutdown waits, after the engine stopped, for requests to hand their end to the log.
_AUDIT_CLOSE_TIMEOUT_S = 10.0


def build(
    settings: Settings,
    audit_log: AuditLog,
    *,
    model: LoadedModel | None = None,
    tee: TeeService | None = None,
    keys: KeyProvider | None = None,
    preload: EnginePreload | None = None,
    collector: CollectorPause | None = None,
    series_interval_s: float = SAMPLE_INTERVAL_S,
) -> FastAPI:
    """The appliance's HTTP app.

    `audit_log` is open and has recorded `boot.start` (appliance.boot.startup.start_audit_log);
    the app owns it from here: every API request is logged to it, and the app's shutdown closes
    it after the requests in flight, signing the final checkpoint.

    When the app starts, so does the start-up sequence (appliance.boot.startup): the TEE gate
    (`tee`, by default the machine's own devices as `settings.tee` configures them), then the
    key release and the model load, while `/live` already answers and `/health` says which step
    runs (or why one failed). With `model` (the demo, tests, benchmarks: insecure-dev only),
    that model is served; its engine is not closed afterwards, so several apps in turn can share
    one. A sealed model's data key comes from `keys`, by default the provider `settings.sealed`
    names. `preload`: the engine's once-only work, started in the background before the app was
    built (`inferno serve`: appliance.boot.engine_preload); the start-up sequence lets it use
    the GPUs once they are attested, and waits for it before the engine's first step.
    `collector`: the cyclic garbage collector, paused since the process started (`inferno
    serve`: appliance.boot.collector_pause), which the start-up sequence resumes once the
    server is ready or the start has stopped. The console's time series is sampled every
    `series_interval_s` while the app runs (tests shorten it). Raises BootError for what could
    never start (StartUp.prepare).
    """
    readiness = Readiness(lambda: audit_log.failure)
    admission = Admission(settings.server.max_concurrent_requests, settings.server.retry_after_s)
    server_metrics = ServerMetrics(settings.served_model_name)
    trail = AuditTrail(audit_log, server_metrics, settings.served_model_name)
    start_up = StartUp.prepare(
        settings,
        trail=trail,
        readiness=readiness,
        admission=admission,
        metrics=server_metrics,
        tee=tee,
        model=model,
        keys=keys,
        preload=preload,
        collector=collector,
    )
    sampler = SeriesSampler(server_metrics, GpuMonitor(), series_interval_s)
    auth = settings.auth
    if auth.local_issuer == "break-glass":
        logger.warning("auth.local_issuer = break-glass: tokens of `inferno token` are accepted")
    idp_http = IdpHttp(idp_tls_context(auth.ca_file), auth.fetch_timeout_s)
    local_issuer = LocalIssuer.from_settings(auth)
    authenticator = Authenticator.from_settings(auth, idp_http, local_issuer, time.time)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(start_up.run())
        sampler.start()
        try:
            yield
        finally:
            await sampler.stop()
            await starting  # a load in progress cannot be interrupted
            await start_up.stop()
            await trail.close(timeout_s=_AUDIT_CLOSE_TIMEOUT_S)
            await idp_http.aclose()
            sessions.close()

    app = FastAPI(
        title="Inferno",
        summary="OpenAI-compatible inference on a confidential appliance",
        version=importlib.metadata.version("inferno"),
        lifespan=lifespan,
        # The interactive docs pages load scripts from a CDN: not on an air-gapped appliance.
        docs_url=None,
        redoc_url=None,
    )
    app.state.readiness = readiness
    app.state.tee = start_up.tee
    app.state.metrics = server_metrics
    app.state.audit_trail = trail
    app.state.admission = admission
    app.state.prefix_cache_isolation = settings.engine.prefix_cache_isolation
    app.state.limits = CallerLimits(
        settings.limits, trail, server_metrics, retry_after_s=settings.server.retry_after_s
    )
    app.state.served_model = ServedModel.from_settings(
        settings.served_model_name, settings.model, created=int(time.time())
    )
    sessions = SessionStore.open(
        settings.audit.effective_database_url,
        auth.session_idle_timeout_s,
        auth.session_absolute_timeout_s,
        time.time,
    )
    app.state.sessions = sessions
    login = ConsoleLogin.from_settings(auth, idp_http, authenticator, time.time)
    app.state.console_login = login
    install_error_handlers(app)
    denials = DenialReporter(trail.append, auth.failure_events_per_minute, time.monotonic)
    # Logout continues at the identity provider: the console's forms may lead there.
    pages = ConsolePages(
        () if login is None else (login.issuer_origin,),
        sign_in=SignIn(idp=login is not None, local=local_issuer is not None),
    )
    console.install(
        app,
        console.ConsoleServices(
            pages=pages,
            settings=settings,
            version=app.version,
            sessions=sessions,
            trail=trail,
            tee=start_up.tee,
            readiness=readiness,
            metrics=server_metrics,
            authenticator=authenticator,
            sampler=sampler,
            sealed_manifest=lambda: start_up.sealed_manifest,
            denials=denials,
            local_issuer=local_issuer,
        ),
    )
    routers = (models, chat, completions, responses, audit_proofs, attestation, health, metrics,
               console_login)  # fmt: skip
    # The console's pages beside routes.py's, each module with its own router.
    console_pages = (tokens, ticket_sign_in, attestation_records, audit_export, usage_page)
    for module in (*routers, *console_pages):
        app.include_router(module.router)
    app.openapi = partial(_openapi, app)  # type: ignore[method-assign]
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_request_body_bytes)
    # Outside the size limit: an unauthenticated upload is refused before its body is read.
    app.add_middleware(
        AccessControl,
        rules=ROUTE_ACCESS,
        authenticator=authenticator,
        sessions=sessions,
        denials=denials,
        console_page=pages.error,
    )
    # Each added around the previous: a 413 or a refusal is logged and carries both headers.
    app.add_middleware(AuditEntryHeader, trail=trail)
    app.add_middleware(
        TeeStateHeader, state=start_up.tee.state, attestation=start_up.tee.attestation_header
    )
    if settings.log.access:
        app.add_middleware(AccessLog)  # outermost: it logs every answer as the client got it
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 it documents for every route with a body (this API
    answers invalid requests 400, as OpenAI does: appliance.api.errors), with the bearer
    scheme and the 401/403 of every route that needs a token."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
        document_access(schema)
        _restore_integer_bounds(schema)
    return app.openapi_schema


def _restore_integer_bounds(node: object) -> None:
    """FastAPI's OpenAPI model types every bound as a float, so `seed < 2**63` would be written
    9.223372036854776e+18: a bound of an integer field is written back as the integer it is.
    (Exact for every bound this API has: below 2**53, or 2**63 itself.)"""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(bound := node.get(key), float) and bound.is_integer():
                    node[key] = int(bound)
        for value in node.values():
            _restore_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _restore_integer_bounds(value)
