"""The request path's side of the audit log (docs/AUDIT.md, "The server").

Every request under `/v1/` is recorded by exactly one audit entry, which its response names in
an `Audit-Entry: <origin> <index> <base64 leaf hash>` header (appliance.api.middleware):

- an inference request, once admitted, is logged `inference.request` (accepted) before anything
  is generated; if that append fails, it is answered 503 and nothing is generated. Its end is
  logged `inference.complete` (success, failure or aborted): a response that is not streamed is
  sent only once that entry is stored, and a stream sends its `[DONE]` only then;
- any other request, and an inference request refused before it was admitted (400, 404, 429,
  503 ...), is logged `api.request`, with its route and status, as its response starts.

Entries hold HMAC commitments to prompts and responses (audit.commitment), never their text.

Seams for authentication: middleware that authenticates a request sets `request.state.actor`
(an `audit.event.Actor`); until something does, a request is logged as UNAUTHENTICATED. Code
that logs a request's entry itself (a refused token, say) sets `request.state.audit_receipt`,
and the response names that entry instead of adding an `api.request`.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from contextlib import aclosing, asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, Request
from starlette.types import Scope

from appliance.api.errors import APIError, api_error_for_audit
from appliance.api.generation import Generation
from appliance.api.metrics import ServerMetrics
from appliance.api.streaming import DONE, event
from appliance.engine.sampling_params import SamplingParams
from audit.canonical import MAX_SAFE_INTEGER, JsonValue
from audit.errors import AuditError
from audit.event import (
    Actor,
    AuditEvent,
    Outcome,
    api_request,
    inference_complete,
    inference_request,
)
from audit.log import AuditLog
from audit.store import AuditReceipt

logger = logging.getLogger(__name__)

UNAUTHENTICATED = Actor()
"""The actor of a request nobody authenticated: no issuer, subject or client, and no roles."""

ACTOR_STATE = "actor"
RECEIPT_STATE = "audit_receipt"


def request_actor(scope: Scope) -> Actor:
    """Who sent the request, as authentication recorded it in `request.state.actor`."""
    return scope.get("state", {}).get(ACTOR_STATE, UNAUTHENTICATED)


def request_receipt(scope: Scope) -> AuditReceipt | None:
    """The entry already logged for this request, if any (`request.state.audit_receipt`)."""
    return scope.get("state", {}).get(RECEIPT_STATE)


def client_address(scope: Scope) -> str | None:
    """The peer's IP address; None where there is none (a unix socket)."""
    client = scope.get("client")
    if client is None:
        return None
    try:
        return str(ipaddress.ip_address(client[0]))
    except ValueError:
        return None


def sampling_record(params: SamplingParams, *, n: int, stream: bool) -> dict[str, JsonValue]:
    """The sampling parameters an inference entry records: the first choice's (choice i uses
    seed + i); stop strings are counted, not quoted, since they can be content, and so are
    stop token ids and logit_bias entries. A structured output is recorded by its kind and the
    SHA-256 of its specification (a schema can be content too)."""
    structured = params.structured
    return {
        "n": n,
        "max_tokens": _exact(params.max_tokens),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": _exact(params.top_k),
        "min_p": params.min_p,
        "seed": None if params.seed is None else _exact(params.seed),
        "num_stop": len(params.stop),
        "num_stop_token_ids": len(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "min_tokens": _exact(params.min_tokens),
        "num_logit_bias": len(params.logit_bias),
        "repetition_penalty": params.repetition_penalty,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "structured": None
        if structured is None
        else {
            "kind": structured.kind,
            "sha256": hashlib.sha256(structured.spec.encode()).hexdigest(),
        },
        "stream": stream,
    }


def _exact(value: int) -> int | str:
    """`value` as canonical JSON carries it exactly: an integer up to 2**53 - 1 in magnitude, a
    decimal string beyond (a client may send a seed or top_k that large)."""
    return value if abs(value) <= MAX_SAFE_INTEGER else str(value)


class AuditTrail:
    """Appends the entries of API requests to `log`. It also counts the accepted inference
    requests whose end is not yet logged, so that shutdown closes the log only after them."""

    def __init__(self, log: AuditLog, metrics: ServerMetrics, model_name: str):
        self.log = log
        self.model_name = model_name
        # Set once the model is loaded; inference is served only from then on.
        self.weights_digest: str | None = None
        # The id of the attestation verdict in force, which every inference entry names
        # (TeeService.verdict_in_force, wired by the start-up); None: nothing attested.
        self.verdict_in_force: Callable[[], str | None] = lambda: None
        self._metrics = metrics
        self._num_open = 0
        self._none_open = asyncio.Event()
        self._none_open.set()

    async def append(self, audit_event: AuditEvent) -> AuditReceipt:
        """Store `audit_event`; raises AuditError if it cannot be (the caller fails closed)."""
        started_s = time.perf_counter()
        receipt = await self.log.append_async(audit_event)
        self._metrics.observe_audit_append(audit_event.action, time.perf_counter() - started_s)
        return receipt

    async def accept(
        self,
        request: Request,
        *,
        request_id: str,
        endpoint: str,
        prompt: JsonValue,
        sampling: Mapping[str, JsonValue],
        arrival_s: float,
    ) -> InferenceRecord:
        """Log an admitted inference request before it runs, and name its entry in the
        response. Raises AuditError if the entry cannot be stored: do not generate."""
        assert self.weights_digest is not None, "inference is served only once the model loaded"
        actor, source = request_actor(request.scope), client_address(request.scope)
        prompt_commitment = self.log.committer.commit("prompt", prompt)
        receipt = await self.append(
            inference_request(
                time=datetime.now(UTC),
                actor=actor,
                source_address=source,
                request_id=request_id,
                endpoint=endpoint,
                model=self.model_name,
                weights_digest=self.weights_digest,
                sampling=sampling,
                prompt_commitment=prompt_commitment,
                verdict_id=self.verdict_in_force(),
            )
        )
        setattr(request.state, RECEIPT_STATE, receipt)
        self._num_open += 1
        self._none_open.clear()
        return InferenceRecord(
            self,
            receipt,
            request_id,
            actor,
            source,
            self.weights_digest,
            prompt_commitment,
            arrival_s=arrival_s,
        )

    async def record_api_request(self, scope: Scope, status: int) -> AuditReceipt:
        """Log a request that is not an accepted inference, as its response (`status`)
        starts."""
        route = scope.get("route")
        return await self.append(
            api_request(
                time=datetime.now(UTC),
                actor=request_actor(scope),
                source_address=client_address(scope),
                method=scope["method"],
                route=getattr(route, "path", None),
                status=status,
            )
        )

    def _request_ended(self) -> None:
        self._num_open -= 1
        if not self._num_open:
            self._none_open.set()

    async def close(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every accepted request to hand its end to the log, then
        close the log (which stores what it was handed and signs a final checkpoint)."""
        try:
            await asyncio.wait_for(self._none_open.wait(), timeout_s)
        except TimeoutError:
            logger.error(
                "closing the audit log with %d requests whose end is not logged", self._num_open
            )
        await asyncio.to_thread(self.log.close)


class InferenceRecord:
    """The audit entries of one accepted inference request. Its end is logged exactly once."""

    def __init__(
        self,
        trail: AuditTrail,
        receipt: AuditReceipt,
        request_id: str,
        actor: Actor,
        source_address: str | None,
        weights_digest: str,
        prompt_commitment: str,
        *,
        arrival_s: float,
    ):
        self.receipt = receipt
        self._trail = trail
        self._request_id = request_id
        self._actor = actor
        self._source_address = source_address
        self._weights_digest = weights_digest
        self._prompt_commitment = prompt_commitment
        self._arrival_s = arrival_s
        self._ended = False

    @asynccontextmanager
    async def recording(self, generation: Generation) -> AsyncIterator[None]:
        """Around a whole (not streamed) generation: on success, log its end and return only
        once that is stored (else AuditError: the response is not sent); on an exception, log
        the end it had and re-raise."""
        try:
            yield
        except BaseException as exc:
            self.abandon(generation, exc)
            raise
        await self.finish(generation)

    async def stream(
        self,
        generation: Generation,
        events: AsyncGenerator[bytes, None],
        *,
        is_final: Callable[[bytes], bool] = DONE.__eq__,
    ) -> AsyncGenerator[bytes, None]:
        """`events` (a streamed response) with the request's end logged before its final event
        (`[DONE]`, or the one `is_final` picks); if that entry cannot be stored, an error event
        goes first. A stream closed early (the client left, a shutdown cancelled it) logs the
        request aborted."""
        try:
            async with aclosing(events) as chunks:
                async for chunk in chunks:
                    if is_final(chunk):
                        try:
                            await self.finish(generation)
                        except AuditError as exc:
                            yield event(api_error_for_audit(exc).body())
                    yield chunk
        except BaseException as exc:
            self.abandon(generation, exc)
            raise

    def close_stream(self, generation: Generation) -> None:
        """For a streamed response that has closed: if its stream never ran (the client left
        before the first byte), log the request aborted."""
        if not self._ended:
            self._submit(self._complete(generation, Outcome.ABORTED, None))

    async def finish(self, generation: Generation) -> None:
        """Log the end of a generation that no exception stopped (its outcome may still be a
        failure, sent as an error event); raises AuditError if the entry cannot be stored."""
        await self._trail.append(self._complete(generation, *_ending(generation, None)))

    def abandon(self, generation: Generation, exc: BaseException) -> None:
        """Log the end of a generation stopped by `exc`, without waiting: the request is over
        whatever the log does, and a closing log stores what was handed to it first."""
        if not self._ended:
            self._submit(self._complete(generation, *_ending(generation, exc)))

    def _submit(self, audit_event: AuditEvent) -> None:
        self._trail.log.submit(audit_event).add_done_callback(self._report_failure)

    def _complete(self, generation: Generation, outcome: Outcome, error: str | None) -> AuditEvent:
        assert not self._ended, "a request's end is logged once"
        self._ended = True
        self._trail._request_ended()
        usage = generation.usage()
        committer = self._trail.log.committer
        return inference_complete(
            time=datetime.now(UTC),
            actor=self._actor,
            source_address=self._source_address,
            request_id=self._request_id,
            outcome=outcome,
            model=self._trail.model_name,
            weights_digest=self._weights_digest,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            finish_reason=",".join(r or "unfinished" for r in generation.finish_reasons()),
            latency_ms=(time.monotonic() - self._arrival_s) * 1000,
            prompt_commitment=self._prompt_commitment,
            response_commitment=committer.commit("response", generation.texts()),
            error=error,
            verdict_id=self._trail.verdict_in_force(),
        )

    def _report_failure(self, future: Future[AuditReceipt]) -> None:
        if (exc := future.exception()) is not None:
            logger.error("the end of request %s could not be logged: %s", self._request_id, exc)


def _ending(generation: Generation, exc: BaseException | None) -> tuple[Outcome, str | None]:
    """The outcome an `inference.complete` records, and the class of the error behind a
    failure (never its message)."""
    reasons = generation.finish_reasons()
    client_left = isinstance(exc, APIError) and exc.status == 499
    if "abort" in reasons or client_left or isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return Outcome.ABORTED, None
    if exc is None and all(reason in ("stop", "length") for reason in reasons):
        return Outcome.SUCCESS, None
    error = generation.error or exc
    return Outcome.FAILURE, None if error is None else type(error).__name__


async def _audit_trail(request: Request) -> AuditTrail:
    return request.app.state.audit_trail


Trail = Annotated[AuditTrail, Depends(_audit_trail)]
