"""The composition root: `build(settings)` wires the engine, the API routes, metrics, limits
and middleware into one FastAPI app. Nothing here runs at import; the engine starts with the
app's lifespan and stops with it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI

from appliance.api import chat, completions, health, metrics, models
from appliance.api.admission import Admission
from appliance.api.errors import install_error_handlers
from appliance.api.metrics import ServerMetrics
from appliance.api.middleware import TEE_UNVERIFIED, BodySizeLimit, TeeStateHeader
from appliance.api.models import ServedModel
from appliance.api.readiness import Readiness
from appliance.config import Settings
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.engine import Engine, EngineConfig
from appliance.engine.errors import EngineError
from appliance.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's config, checked as far as it can be without loading the model (device,
    dtype, the model's config.json), so that such errors stop the start at once."""
    config = EngineConfig(model_dir=settings.model.dir, **settings.engine.model_dump())
    _ = (config.torch_device, config.torch_dtype)  # each raises EngineConfigError if unusable
    ModelConfig.from_model_dir(config.model_dir)
    return config


def build(settings: Settings, *, engine: Engine | None = None) -> FastAPI:
    """The appliance's HTTP app.

    Without `engine`, the model of `settings` loads in a thread when the app starts, while
    `/live` already answers and `/health` says "loading" (or why loading failed). With
    `engine` (tests, benchmarks), that engine is served at once; it is not closed afterwards,
    so several apps in turn can share one.
    """
    config = engine_config(settings) if engine is None else None
    readiness = Readiness()
    server_metrics = ServerMetrics(settings.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(_start_engine(config, engine, readiness, server_metrics))
        try:
            yield
        finally:
            async_engine = await starting  # a load in progress cannot be interrupted
            readiness.set_stopped()
            if async_engine is not None:
                await async_engine.shutdown()

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
    app.state.metrics = server_metrics
    app.state.admission = Admission(
        settings.server.max_concurrent_requests, settings.server.retry_after_s
    )
    app.state.served_model = ServedModel(settings.served_model_name, created=int(time.time()))
    install_error_handlers(app)
    for module in (models, chat, completions, health, metrics):
        app.include_router(module.router)
    app.openapi = partial(_openapi, app)  # type: ignore[method-assign]
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_request_body_bytes)
    # Added last, so outermost: even a 413 from the size limit carries the header.
    app.add_middleware(TeeStateHeader, state=TEE_UNVERIFIED)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 it documents for every route with a body: this API
    answers invalid requests 400, as OpenAI does (appliance.api.errors)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
    return app.openapi_schema


async def _start_engine(
    config: EngineConfig | None,
    engine: Engine | None,
    readiness: Readiness,
    metrics: ServerMetrics,
) -> AsyncEngine | None:
    """Start `engine`, or load it from `config` first; then mark the server ready. On a failed
    load, mark it failed with the reason (the server stays up to report it)."""
    if engine is None:
        assert config is not None, "build() passes a config when it is given no engine"
        try:
            engine = await asyncio.to_thread(Engine.from_config, config)
        except EngineError as exc:
            logger.error("the model could not be loaded: %s", exc)
            readiness.set_failed(f"the model could not be loaded: {exc}")
            return None
        except Exception as exc:
            logger.exception("the model could not be loaded")
            readiness.set_failed(f"the model could not be loaded ({type(exc).__name__}); see log")
            return None
    async_engine = AsyncEngine(engine)
    async_engine.start()
    metrics.watch(engine)
    readiness.set_ready(async_engine)
    return async_engine
