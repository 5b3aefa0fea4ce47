"""The fail-closed start-up sequence (docs/ARCHITECTURE.md, "Start-up"), in one place: no key,
no weights and no inference without a passing, recorded verdict.

Before the server starts (the `inferno serve` and `inferno demo` commands):
 1. The settings are loaded and validated (`appliance.config.load_settings`): the production
    profile refuses insecure settings there, and `StartUp.prepare` refuses what cannot start
    (an unusable engine config, a key provider that cannot be used, weights loaded before the
    gate outside insecure-dev).
 2. The audit log opens and records `boot.start` (`start_audit_log`). If either fails, the
    appliance exits without serving.
Then, as the server starts (`StartUp.run`; `/live` answers and `/health` says which step runs):
 3. Attest: evidence for a fresh challenge, bound to the serving TLS certificate's key and the
    audit log's vkey (the channel), verified offline against the policy and the pinned roots;
    the verdict is recorded. A failing verdict, or one the log cannot record, closes the
    gate. In insecure-dev nothing is attested, and the log records that.
 4. Only after a recorded pass: the GPUs are set ready; then the verdict must cover exactly
    the GPUs the engine's ranks will use, by count and UUID (`appliance.boot.gpu_coverage`).
    The tensor-parallel workers, one per further GPU, are started only in step 6.
 5. A sealed model's data key is released to that verdict by the key provider.
 6. The weights are decrypted straight into memory (sealed) or read from `model.dir`, and the
    engine is built around them. The engine's preload (`inferno serve`:
    appliance.boot.engine_preload), importing the engine since the process started, is let onto
    the GPUs after step 4 and waited for before the engine's first step.
 7. Warm-up happens as the engine is built (the KV pool is profiled, the CUDA graphs captured);
    `boot.ready` records the time of each phase, and only then is inference served. The cyclic
    garbage collector, paused since `inferno serve` began (appliance.boot.collector_pause),
    freezes the start's objects and runs again.
 8. Re-attest every `tee.reattest_interval_s`, or at once when a client's attestation failed.
    A failure is recorded, the requests in flight drain, and inference stops until restart.

A step that fails leaves the server up and failed, its reason on `/health`; the log records the
failing verdict, or a failed `boot.phase` for the GPU coverage, the key release and the load;
an engine that stops on an error while serving is recorded as `engine.stopped`. The collector
runs again after a start that stopped, however it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING

from appliance.api.admission import Admission
from appliance.api.audit_trail import AuditTrail
from appliance.api.metrics import ServerMetrics
from appliance.api.readiness import Readiness
from appliance.attestation.service import Attestation, TeeService
from appliance.boot.audit_events import (
    attestation_skipped,
    attestation_verdict,
    boot_phase_failed,
    boot_ready,
    boot_start,
    engine_stopped,
)
from appliance.boot.audit_log import open_audit_log
from appliance.boot.collector_pause import CollectorPause
from appliance.boot.engine_preload import EnginePreload, PreloadError
from appliance.boot.gpu_coverage import GpuCoverageError, engine_gpu_uuids, verify_gpus_covered
from appliance.boot.key_release import key_provider, load_modules, release_and_load
from appliance.config import Settings
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import EngineError
from appliance.engine.models.config import ModelConfig
from appliance.errors import BootError, ModelFilesError, TlsError
from appliance.tls import certificate_spki_sha256
from attestation.binding import Channel
from attestation.errors import AttestationError, CollectionError, KeyReleaseError
from attestation.keys import KeyProvider
from attestation.sealed.manifest import SealedManifest
from audit.errors import AuditError
from audit.event import AuditEvent
from audit.log import AuditLog

if TYPE_CHECKING:  # torch: imported by the engine's preload thread meanwhile (engine_preload)
    from appliance.boot.weights import LoadedModel

logger = logging.getLogger(__name__)

# How long shutdown waits for an engine's failure to be recorded before closing the log.
_RECORD_STOP_TIMEOUT_S = 5.0


class StartUpError(BootError):
    """A step of `StartUp.run` failed: nothing after it runs, and nothing is served."""


def start_audit_log(settings: Settings) -> AuditLog:
    """Step 2: open the audit log and record `boot.start`. Raises BootError if either fails:
    the appliance must not serve without its log."""
    log = open_audit_log(settings.audit)
    try:
        log.append(boot_start(settings))
    except AuditError as exc:
        log.close()
        raise BootError(f"the audit log cannot record boot.start: {exc}") from exc
    return log


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's config, checked as far as it can be without torch or the weights (the
    device's name and the dtype, the model's config.json), so that such errors stop the start
    at once, while the preload imports torch. Whether this machine has the device is checked
    where the engine first looks for it (step 4b for GPUs a verdict must cover, else the load
    of step 6), failing the start there like any step. The server captures the engine's CUDA
    graphs while idle, once it is ready (EngineConfig.capture_graphs_when_idle). Raises
    EngineError."""
    config = EngineConfig(
        model_dir=settings.model.dir,
        capture_graphs_when_idle=True,
        **settings.engine.model_dump(),
    )
    ModelConfig.from_model_dir(config.model_dir)
    return config


def tee_service(settings: Settings) -> TeeService:
    """The TEE service of `settings`: attesting this machine's own devices, or none at all in
    insecure-dev mode."""
    if settings.tee.mode == "insecure-dev":
        return TeeService("insecure-dev", None, None)
    from appliance.attestation.devices import device_tee_service  # NVML, configfs-tsm

    return device_tee_service(settings.tee)


@dataclass
class StartUp:
    """Steps 3 to 8, run by the app as it starts (`run`) and stopped as it stops (`stop`)."""

    settings: Settings
    tee: TeeService
    trail: AuditTrail
    readiness: Readiness
    admission: Admission
    metrics: ServerMetrics
    # A model loaded before the app was built (the demo, tests: insecure-dev only), or the
    # config to load one from once the gate passed.
    model: LoadedModel | None
    config: EngineConfig | None
    keys: KeyProvider | None
    # The engine's once-only work, running in the background since the process started.
    preload: EnginePreload | None = None
    # The cyclic garbage collector, paused since the process started, until ready.
    collector: CollectorPause | None = None
    engine: AsyncEngine | None = None
    # The signed manifest of the sealed model served, once served (None: plain weights).
    sealed_manifest: SealedManifest | None = None
    _reattesting: asyncio.Task[None] | None = field(default=None, repr=False)
    _watching_engine: asyncio.Task[None] | None = field(default=None, repr=False)

    @classmethod
    def prepare(
        cls,
        settings: Settings,
        *,
        trail: AuditTrail,
        readiness: Readiness,
        admission: Admission,
        metrics: ServerMetrics,
        tee: TeeService | None = None,
        model: LoadedModel | None = None,
        keys: KeyProvider | None = None,
        preload: EnginePreload | None = None,
        collector: CollectorPause | None = None,
    ) -> StartUp:
        """The sequence for `settings`, refusing at once what could never pass step 1: a TEE
        service of another mode, weights loaded before the gate outside insecure-dev, an
        unusable engine config, a key provider that cannot be used. `tee` defaults to this
        machine's devices, `keys` to the provider `settings.sealed` names; `preload`, if any,
        is given the GPUs after step 4 and waited for before the engine's first step;
        `collector`, if any, is resumed once the server is ready or the start has stopped.
        Raises BootError."""
        if tee is None:
            tee = tee_service(settings)
        if tee.mode != settings.tee.mode:
            raise BootError(f"the TEE service runs {tee.mode!r}; tee.mode is {settings.tee.mode!r}")
        if model is not None and tee.mode != "insecure-dev":
            raise BootError(
                'a model loaded before the TEE gate is refused with tee.mode = "required": the '
                "weights load only after a passing verdict"
            )
        config = engine_config(settings) if model is None else None
        trail.verdict_in_force = tee.verdict_in_force
        if keys is None and settings.sealed.enabled:
            try:
                keys = key_provider(
                    settings.sealed, production=settings.appliance.profile == "production"
                )
            except AttestationError as exc:
                raise BootError(f"the key provider cannot be used: {exc}") from exc
        if model is not None and preload is not None:
            preload.cancel()  # nothing to load: the model is here already
            preload = None
        return cls(
            settings, tee, trail, readiness, admission, metrics, model, config, keys, preload,
            collector,
        )  # fmt: skip

    async def run(self) -> AsyncEngine | None:
        """Steps 3 to 8; the running engine, or None when a step failed (then `/health` says
        why, and the server stays up to report it)."""
        try:
            # 3. Attest; the verdict is recorded, and only a recorded pass goes on.
            started_s = time.monotonic()
            attestation = await self._attest()
            # 4. The GPUs accept work only now.
            if attestation is not None:
                await self._set_gpus_ready()
                # 4b. The verdict covers exactly the GPUs the engine's ranks will use.
                await self._verify_gpu_coverage(attestation)
            attestation_ms = _ms_since(started_s) if attestation is not None else None
            # The preload may now use the GPUs, while the key is released and the weights load.
            if self.preload is not None:
                assert self.config is not None, "a preload only comes with a model to load"
                self.preload.warm_device(self.config)
            # 5-6. The key is released to the verdict; the weights are loaded (and 7, warmed up).
            started_s = time.monotonic()
            model = await self._load_model(attestation)
            load_ms = _ms_since(started_s) if self.model is None else None
            # 7. boot.ready is recorded; only then is inference served. What the start made is
            # frozen, and the collector runs again (appliance.boot.collector_pause).
            self.engine = await self._serve(model, load_ms, attestation_ms)
            if self.collector is not None:
                self.collector.ready()
        except Exception as exc:  # a stopped start, or an error no step expected (never
            # "loading" forever: the server stays up, not ready, saying why)
            stopped = exc if isinstance(exc, StartUpError) else _unexpected("the start-up", exc)
            if self.preload is not None:
                self.preload.cancel()
            logger.error("start-up stopped: %s", stopped)
            self.readiness.set_failed(str(stopped))
            return None
        finally:
            # A start that stopped, expectedly or not, leaves the process up (not ready): the
            # collector runs again, and frees what the start left in cycles.
            if self.engine is None and self.collector is not None:
                self.collector.stopped()
        # 8. Re-attestation on a timer, for as long as the engine serves.
        if self.tee.mode == "required":
            self._reattesting = asyncio.create_task(self._reattest(self.engine))
        return self.engine

    async def stop(self) -> None:
        """Stop re-attesting and serving; requests still running in the engine end aborted."""
        if self._reattesting is not None:
            self._reattesting.cancel()
        if self._watching_engine is not None:
            if self.engine is not None and self.engine.has_failed:
                # Let the engine's failure reach the log before it closes.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._watching_engine, _RECORD_STOP_TIMEOUT_S)
            self._watching_engine.cancel()
        self.readiness.set_stopped()
        if self.engine is not None:
            await self.engine.shutdown()
            await asyncio.to_thread(self.engine.close_engine)  # its tensor-parallel workers

    async def _attest(self) -> Attestation | None:
        """Step 3: the passing attestation, or None in insecure-dev. Raises StartUpError saying
        why the gate is closed: a failing verdict (its failed checks), one the audit log cannot
        record (an unrecorded pass is no pass), or an unexpected error."""
        if self.tee.mode == "insecure-dev":
            logger.warning("tee.mode = insecure-dev: the TEE is not attested; serving UNVERIFIED")
            await self._record(attestation_skipped(), "the skipped attestation")
            return None
        self.readiness.set_loading("attesting the TEE")
        self.tee.bind_channel(self._channel())
        try:
            attestation = await self.tee.attest("boot")
        except Exception as exc:  # TeeService makes every expected failure a failed check
            raise _unexpected("the TEE gate", exc) from exc
        verdict = attestation_verdict(attestation, self.tee.state())
        await self._record(verdict, "the attestation verdict")
        if not attestation.verdict.trusted:
            raise StartUpError(f"attestation failed: {attestation.summary()}")
        return attestation

    def _channel(self) -> Channel:
        """What every attestation binds besides its challenge: the SPKI hash of the certificate
        the server presents (read now, as the server listens: uvicorn loaded the same file), or
        none over plain HTTP (`server.insecure_http`: no client can check a channel there), and
        the audit log's vkey. Raises StartUpError if the certificate cannot be read."""
        spki_sha256 = None
        if not self.settings.server.insecure_http:
            assert self.settings.tls.cert_file is not None, "checked by Settings"
            try:
                spki_sha256 = certificate_spki_sha256(self.settings.tls.cert_file)
            except TlsError as exc:
                raise StartUpError(
                    f"the TLS key cannot be bound to the attestation: {exc}"
                ) from exc
        return Channel(spki_sha256, self.trail.log.vkey)

    async def _set_gpus_ready(self) -> None:
        """Step 4. Raises StartUpError: the gate stays shut."""
        try:
            await self.tee.set_gpus_ready()
        except CollectionError as exc:
            raise StartUpError(
                f"the GPUs could not be set ready after a passing verdict: {exc}"
            ) from exc
        except Exception as exc:
            raise _unexpected("the TEE gate", exc) from exc

    async def _verify_gpu_coverage(self, attestation: Attestation) -> None:
        """Step 4b (appliance.boot.gpu_coverage), for an engine on GPUs. A mismatch is
        recorded as a failed `boot.phase` (gpu_coverage). Raises StartUpError: no key, no
        weights, and no tensor-parallel worker is ever started."""
        config = self.config
        try:
            if config is None or not config.on_gpu:
                return  # a CPU engine puts no weight on any GPU
            evidence = attestation.evidence
            attested = [] if evidence is None else [gpu.uuid for gpu in evidence.gpu]
            # In a thread (CUDA's driver starts: 0.1 s on the H100), so that `/live` and
            # `/health` keep answering meanwhile.
            used = await asyncio.to_thread(
                engine_gpu_uuids, config.device, config.tensor_parallel_size
            )
            verify_gpus_covered(attested, used)
        except (GpuCoverageError, EngineError) as exc:
            with contextlib.suppress(StartUpError):  # the failure to report is the mismatch
                await self._record(boot_phase_failed("gpu_coverage", exc), "the GPU mismatch")
            raise StartUpError(f"the verdict does not cover the engine's GPUs: {exc}") from exc

    async def _load_model(self, attestation: Attestation | None) -> LoadedModel:
        """Steps 5 and 6 in a thread (the event loop keeps answering `/live` and `/health`), or
        the model given ready-made. A failure is recorded as a failed `boot.phase` (key_release
        or model_load). Raises StartUpError."""
        if self.model is not None:
            return self.model
        self.readiness.set_loading("the model is loading")
        assert self.config is not None, "prepare() makes a config when it is given no model"
        config, preload = self.config, self.preload

        def load_plain() -> LoadedModel:
            loaded_model, waited_ms = load_modules()
            loaded = loaded_model.load(config, preload=preload)
            return loaded if preload is None else loaded.with_phase("torch_wait_ms", waited_ms)

        load = load_plain
        if self.settings.sealed.enabled:
            assert attestation is not None and self.keys is not None, "checked by Settings"
            load = partial(
                release_and_load,
                config,
                self.settings.sealed,
                self.keys,
                attestation.verdict,
                preload=preload,
            )
        try:
            return await asyncio.to_thread(load)
        except Exception as exc:
            phase = "key_release" if isinstance(exc, KeyReleaseError) else "model_load"
            with contextlib.suppress(StartUpError):  # the failure to report is the load's
                await self._record(boot_phase_failed(phase, exc), "the failed model load")
            if isinstance(exc, EngineError | ModelFilesError | AttestationError | PreloadError):
                raise StartUpError(f"the model could not be loaded: {exc}") from exc
            raise _unexpected("the model load", exc) from exc

    async def _serve(
        self, model: LoadedModel, load_ms: float | None, attestation_ms: float | None
    ) -> AsyncEngine:
        """Step 7: record `boot.ready`, then start the engine and mark the server ready."""
        self.trail.weights_digest = model.weights_digest
        self.sealed_manifest = model.sealed_manifest
        ready = boot_ready(
            model=self.trail.model_name,
            weights_digest=model.weights_digest,
            model_load_ms=load_ms,
            attestation_ms=attestation_ms,
            load_phases_ms=model.phases_ms if load_ms is not None else None,
            tee=self.tee.state(),
        )
        try:
            await self.trail.log.append_async(ready)
        except AuditError as exc:
            raise StartUpError(
                f"the audit log cannot record boot.ready, so nothing is served: {exc}"
            ) from exc
        engine = AsyncEngine(model.engine)
        engine.start()
        self._watching_engine = asyncio.create_task(self._record_engine_stop(engine))
        self.metrics.watch(engine)
        self.readiness.set_ready(engine)
        # The line operators and scripts wait for (shown at any log.level: appliance.logs).
        logger.info(
            "ready: the model is loaded and inference is served (%s, TEE %s)",
            self.trail.model_name,
            self.tee.state(),
        )
        return engine

    async def _record_engine_stop(self, engine: AsyncEngine) -> None:
        """An engine that stops on an error while serving is recorded (`/health` reports it
        stopped already, from the engine itself)."""
        exc = await engine.wait_failed()
        logger.error("the engine stopped (%s); nothing is served until restart", exc)
        with contextlib.suppress(StartUpError):  # the log's own failure is reported by /health
            await self._record(engine_stopped(exc), "the engine's stop")

    async def _reattest(self, engine: AsyncEngine) -> None:
        """Step 8, until cancelled or the first failure, which drains and stops inference."""

        async def stop_inference(reason: str) -> None:
            self.readiness.set_failed(reason)
            await _drain(self.admission, self.settings.server.drain_timeout_s)
            await engine.shutdown()

        interval_s = self.settings.tee.reattest_interval_s
        await reattest_periodically(self.tee, self.trail.log, interval_s, stop_inference)

    async def _record(self, event: AuditEvent, what: str) -> None:
        """Append `event`, or raise StartUpError: a step the log cannot record did not pass."""
        try:
            await self.trail.log.append_async(event)
        except AuditError as exc:
            raise StartUpError(f"the audit log cannot record {what}: {exc}") from exc


async def reattest_periodically(
    tee: TeeService,
    log: AuditLog,
    interval_s: float,
    on_failure: Callable[[str], Awaitable[None]],
) -> None:
    """Step 8: every `interval_s`, or at once when a client's attestation failed
    (`tee.reattest_requested`), attest again and record the verdict. On the first failure (or a
    verdict the log cannot record, or anything unexpected: a timer that dies silently would be
    a gate left open) await `on_failure(reason)` and return: inference stays stopped until
    restart. Runs until cancelled. While it waits, `tee.next_reattestation` says until when."""
    try:
        while True:
            tee.next_reattestation = tee.clock() + timedelta(seconds=interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tee.reattest_requested.wait(), timeout=interval_s)
            tee.next_reattestation = None
            tee.reattest_requested.clear()
            try:
                reason = await _reattest_once(tee, log)
            except Exception as exc:
                logger.exception("re-attestation failed unexpectedly")
                reason = f"re-attestation failed ({type(exc).__name__}); see the server log"
            if reason is not None:
                logger.error("%s; inference stops", reason)
                await on_failure(reason)
                return
    finally:
        tee.next_reattestation = None


async def _reattest_once(tee: TeeService, log: AuditLog) -> str | None:
    """One re-attestation, recorded; the reason to stop inference, or None."""
    attestation = await tee.attest("reattest")
    reason = None
    if not attestation.verdict.trusted:
        reason = f"re-attestation failed: {attestation.summary()}"
    try:
        await log.append_async(attestation_verdict(attestation, tee.state()))
    except AuditError as exc:
        reason = reason or f"the audit log cannot record a re-attestation verdict: {exc}"
    return reason


async def _drain(admission: Admission, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the requests admitted before inference stopped to end."""
    deadline = time.monotonic() + timeout_s
    while admission.num_admitted > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _unexpected(step: str, exc: Exception) -> StartUpError:
    """A failure no step expects: fail closed, visibly (never "loading" forever), with the
    traceback in the server log and only the error's class on /health."""
    logger.error("%s failed unexpectedly", step, exc_info=exc)
    return StartUpError(f"{step} failed ({type(exc).__name__}); see the server log")


def _ms_since(start_s: float) -> float:
    return (time.monotonic() - start_s) * 1000
