"""The composition root: `build(settings, audit_log)` wires the TEE gate, the engine, the audit
trail, access control, the API routes, metrics, limits and middleware into one FastAPI app.
Nothing here runs at import; the start-up sequence (appliance.boot: attest, release the key,
load the weights, serve, re-attest) runs with the app's lifespan and stops with it, and the
audit log closes after it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI

from appliance.api import attestation, audit_proofs, chat, completions, health, metrics, models
from appliance.api.access import ROUTE_ACCESS, AccessControl, document_access
from appliance.api.access_log import AccessLog
from appliance.api.admission import Admission
from appliance.api.audit_trail import AuditTrail
from appliance.api.errors import install_error_handlers
from appliance.api.metrics import ServerMetrics
from appliance.api.middleware import AuditEntryHeader, BodySizeLimit, TeeStateHeader
from appliance.api.models import ServedModel
from appliance.api.readiness import Readiness
from appliance.attestation.release import key_provider, release_and_load
from appliance.attestation.service import TeeService
from appliance.auth.authenticator import Authenticator
from appliance.auth.denials import DenialReporter
from appliance.auth.idp_http import IdpHttp, idp_tls_context
from appliance.auth.local_issuer import LocalIssuer
from appliance.auth.login import ConsoleLogin
from appliance.auth.sessions import SessionStore
from appliance.boot import (
    TeeGateError,
    boot_phase_failed,
    boot_ready,
    pass_tee_gate,
    reattest_periodically,
)
from appliance.config import Settings
from appliance.console import login as console_login
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.engine import EngineConfig
from appliance.engine.errors import EngineError
from appliance.engine.models.config import ModelConfig
from appliance.errors import BootError, ModelFilesError
from appliance.weights import LoadedModel
from attestation.errors import AttestationError, KeyReleaseError
from attestation.keys import KeyProvider
from audit.errors import AuditError
from audit.log import AuditLog

logger = logging.getLogger(__name__)

# How long shutdown waits, after the engine stopped, for requests to hand their end to the log.
_AUDIT_CLOSE_TIMEOUT_S = 10.0


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's config, checked as far as it can be without loading the model (device,
    dtype, the model's config.json), so that such errors stop the start at once."""
    config = EngineConfig(model_dir=settings.model.dir, **settings.engine.model_dump())
    _ = (config.torch_device, config.torch_dtype)  # each raises EngineConfigError if unusable
    ModelConfig.from_model_dir(config.model_dir)
    return config


def build(
    settings: Settings,
    audit_log: AuditLog,
    *,
    model: LoadedModel | None = None,
    tee: TeeService | None = None,
    keys: KeyProvider | None = None,
) -> FastAPI:
    """The appliance's HTTP app.

    `audit_log` is open and has recorded `boot.start` (appliance.boot.start_audit_log); the app
    owns it from here: every API request is logged to it, and the app's shutdown closes it after
    the requests in flight, signing the final checkpoint.

    When the app starts, the TEE gate runs first (`tee`, by default the machine's own devices
    as `settings.tee` configures them); only after it passes, or in insecure-dev mode, does the
    model of `settings` load, in a thread, while `/live` already answers and `/health` says
    "loading" (or why the gate or the load failed). With `model` (the demo, tests, benchmarks),
    that model is served once the gate passes; its engine is not closed afterwards, so several
    apps in turn can share one. A model loaded before the gate ran is refused unless
    `tee.mode = insecure-dev`: weights must never be in memory before a verdict. A sealed
    model's data key comes from `keys`, by default the provider `settings.sealed` names.
    """
    if tee is None:
        tee = _tee_service(settings)
    if tee.mode != settings.tee.mode:
        raise BootError(f"the TEE service runs {tee.mode!r}; tee.mode is {settings.tee.mode!r}")
    if model is not None and tee.mode != "insecure-dev":
        raise BootError(
            'a model loaded before the TEE gate is refused with tee.mode = "required": the '
            "weights load only after a passing verdict"
        )
    config = engine_config(settings) if model is None else None
    if keys is None and settings.sealed.enabled:
        try:
            keys = key_provider(
                settings.sealed, production=settings.appliance.profile == "production"
            )
        except AttestationError as exc:
            raise BootError(f"the key provider cannot be used: {exc}") from exc
    readiness = Readiness(lambda: audit_log.failure)
    admission = Admission(settings.server.max_concurrent_requests, settings.server.retry_after_s)
    server_metrics = ServerMetrics(settings.served_model_name)
    trail = AuditTrail(audit_log, server_metrics, settings.served_model_name)
    auth = settings.auth
    if auth.local_issuer == "break-glass":
        logger.warning("auth.local_issuer = break-glass: tokens of `inferno token` are accepted")
    idp_http = IdpHttp(idp_tls_context(auth.ca_file), auth.fetch_timeout_s)
    authenticator = Authenticator.from_settings(
        auth, idp_http, LocalIssuer.from_settings(auth), time.time
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = _StartUp(
            settings, tee, config, model, keys, readiness, admission, server_metrics, trail
        )
        starting = asyncio.create_task(start.run())
        try:
            yield
        finally:
            async_engine = await starting  # a load in progress cannot be interrupted
            start.stop()
            readiness.set_stopped()
            if async_engine is not None:
                await async_engine.shutdown()  # requests still running end aborted
            await trail.close(timeout_s=_AUDIT_CLOSE_TIMEOUT_S)
            await idp_http.aclose()

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
    app.state.tee = tee
    app.state.metrics = server_metrics
    app.state.audit_trail = trail
    app.state.admission = admission
    app.state.served_model = ServedModel(settings.served_model_name, created=int(time.time()))
    sessions = SessionStore(auth.session_idle_timeout_s, auth.session_absolute_timeout_s, time.time)
    app.state.sessions = sessions
    app.state.console_login = ConsoleLogin.from_settings(auth, idp_http, authenticator, time.time)
    install_error_handlers(app)
    routers = (models, chat, completions, audit_proofs, attestation, health, metrics, console_login)
    for module in routers:
        app.include_router(module.router)
    app.openapi = partial(_openapi, app)  # type: ignore[method-assign]
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_request_body_bytes)
    # Outside the size limit: an unauthenticated upload is refused before its body is read.
    app.add_middleware(
        AccessControl,
        rules=ROUTE_ACCESS,
        authenticator=authenticator,
        sessions=sessions,
        denials=DenialReporter(trail.append, auth.failure_events_per_minute, time.monotonic),
    )
    # Each added around the previous: a 413 or a refusal is logged and carries both headers.
    app.add_middleware(AuditEntryHeader, trail=trail)
    app.add_middleware(TeeStateHeader, state=tee.state)
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
    return app.openapi_schema


def _tee_service(settings: Settings) -> TeeService:
    """The TEE service of `settings`: attesting this machine's own devices, or none at all in
    insecure-dev mode."""
    if settings.tee.mode == "insecure-dev":
        return TeeService("insecure-dev", None, None)
    from appliance.attestation.devices import device_tee_service  # NVML, configfs-tsm

    return device_tee_service(settings.tee)


@dataclass
class _StartUp:
    """The start-up sequence after the audit log (appliance.boot), run by the app's lifespan:
    the TEE gate; only after it passes, the key release and the model load; then serving and
    the re-attestation timer. A closed gate, a refused key or a failed load leaves the server
    up, failed, with the reason."""

    settings: Settings
    tee: TeeService
    config: EngineConfig | None
    model: LoadedModel | None
    keys: KeyProvider | None
    readiness: Readiness
    admission: Admission
    metrics: ServerMetrics
    trail: AuditTrail
    reattesting: asyncio.Task[None] | None = None
    attestation_ms: float | None = None

    async def run(self) -> AsyncEngine | None:
        readiness, tee = self.readiness, self.tee
        attesting = tee.mode == "required"
        readiness.set_loading("attesting the TEE" if attesting else "the model is loading")
        started_s = time.monotonic()
        try:
            attestation = await pass_tee_gate(tee, self.trail.log)
        except TeeGateError as exc:
            logger.error("the TEE gate is closed: %s", exc)
            readiness.set_failed(str(exc))
            return None
        except Exception as exc:  # fail closed, visibly: never stay "loading" forever
            logger.exception("the TEE gate failed unexpectedly")
            readiness.set_failed(f"the TEE gate failed ({type(exc).__name__}); see the server log")
            return None
        if attesting:
            self.attestation_ms = (time.monotonic() - started_s) * 1000
        readiness.set_loading("the model is loading")
        load = None
        if self.model is None:
            assert self.config is not None, "build() passes a config when it is given no model"
            load = partial(LoadedModel.load, self.config)
            if self.settings.sealed.enabled:
                assert attestation is not None and self.keys is not None, "checked by Settings"
                load = partial(
                    release_and_load,
                    self.config,
                    self.settings.sealed,
                    self.keys,
                    attestation.verdict,
                )
        async_engine = await _start_engine(load, self.model, self)
        if async_engine is not None and tee.mode == "required":
            self.reattesting = asyncio.create_task(self._reattest(async_engine))
        return async_engine

    async def _reattest(self, async_engine: AsyncEngine) -> None:
        async def stop_inference(reason: str) -> None:
            self.readiness.set_failed(reason)
            await _drain(self.admission, self.settings.server.drain_timeout_s)
            await async_engine.shutdown()

        interval_s = self.settings.tee.reattest_interval_s
        await reattest_periodically(self.tee, self.trail.log, interval_s, stop_inference)

    def stop(self) -> None:
        if self.reattesting is not None:
            self.reattesting.cancel()


async def _drain(admission: Admission, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the requests admitted before inference stopped to end."""
    deadline = time.monotonic() + timeout_s
    while admission.num_admitted > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _start_engine(
    load: Callable[[], LoadedModel] | None, model: LoadedModel | None, start: _StartUp
) -> AsyncEngine | None:
    """Start `model`, or `load()` it first; record `boot.ready`; then mark the server ready. On
    a refused key or a failed load, or a log that cannot record it, mark the server failed with
    the reason (it stays up to report it)."""
    readiness, trail = start.readiness, start.trail
    load_ms = None
    if model is None:
        assert load is not None, "a loader is given when a model is not"
        started_s = time.monotonic()
        try:
            model = await asyncio.to_thread(load)
        except (EngineError, ModelFilesError, AttestationError) as exc:
            logger.error("the model could not be loaded: %s", exc)
            await _record_failed_load(trail.log, exc)
            readiness.set_failed(f"the model could not be loaded: {exc}")
            return None
        except Exception as exc:
            logger.exception("the model could not be loaded")
            await _record_failed_load(trail.log, exc)
            readiness.set_failed(f"the model could not be loaded ({type(exc).__name__}); see log")
            return None
        load_ms = (time.monotonic() - started_s) * 1000
    trail.weights_digest = model.weights_digest
    ready = boot_ready(
        model=trail.model_name,
        weights_digest=model.weights_digest,
        model_load_ms=load_ms,
        attestation_ms=start.attestation_ms,
        tee=start.tee.state(),
    )
    try:
        await trail.log.append_async(ready)
    except AuditError as exc:
        logger.error("the audit log cannot record boot.ready: %s", exc)
        readiness.set_failed(f"the audit log cannot record boot.ready, so nothing is served: {exc}")
        return None
    async_engine = AsyncEngine(model.engine)
    async_engine.start()
    start.metrics.watch(model.engine)
    readiness.set_ready(async_engine)
    return async_engine


async def _record_failed_load(log: AuditLog, exc: BaseException) -> None:
    try:
        phase = "key_release" if isinstance(exc, KeyReleaseError) else "model_load"
        await log.append_async(boot_phase_failed(phase, exc))
    except AuditError as audit_exc:
        logger.error("the audit log cannot record the failed model load: %s", audit_exc)
