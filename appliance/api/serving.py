"""One inference request from admission to its answer, the same for completions and chat.

It is admitted under its caller's limits (appliance.api.limits), takes places in the admission
queue, then logs `inference.request` to the audit log before anything is generated (a failed
append gives the places back: not logged, not served). The output then goes out whole or as a
stream; either way the places are released, the caller's limits are charged its tokens, and the
audit record is closed when it ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

from fastapi import Request

from appliance.api.admission import Admission, Ticket
from appliance.api.audit_trail import AuditTrail, InferenceRecord
from appliance.api.generation import CollectedChoice, Generation, cancel_on_disconnect
from appliance.api.limits import CallerLimits, Charge
from appliance.api.streaming import EventStreamResponse
from audit.canonical import JsonValue


class AdmittedRequest:
    def __init__(
        self,
        request: Request,
        charge: Charge,
        ticket: Ticket,
        record: InferenceRecord,
        generation: Generation,
    ):
        self._request = request
        self._charge = charge
        self._ticket = ticket
        self._record = record
        self._generation = generation

    @classmethod
    async def admit(
        cls,
        request: Request,
        generation: Generation,
        limits: CallerLimits,
        admission: Admission,
        audit: AuditTrail,
        *,
        request_id: str,
        endpoint: str,
        prompt: JsonValue,
        sampling: Mapping[str, JsonValue],
        arrival_s: float,
    ) -> AdmittedRequest:
        """Admit the request under its caller's limits, one place per choice, and log the
        request. Raises a limit's or the admission's 429, or the audit log's 503 (then holding
        no place)."""
        charge = await limits.admit(request)
        try:
            ticket = admission.admit(len(generation.choices))
        except BaseException:
            charge.release(0)
            raise
        try:
            record = await audit.accept(
                request,
                request_id=request_id,
                endpoint=endpoint,
                prompt=prompt,
                sampling=sampling,
                arrival_s=arrival_s,
            )
        except BaseException:
            ticket.release()  # not logged, so not served: nothing was generated
            charge.release(0)
            raise
        return cls(request, charge, ticket, record, generation)

    def stream(self, events: AsyncGenerator[bytes, None]) -> EventStreamResponse:
        """The server-sent events `events` of the generation, recorded as they go."""

        def closed() -> None:
            self._ticket.release()
            self._charge.release(self._generation.usage().total_tokens)
            self._record.close_stream(self._generation)

        return EventStreamResponse(self._record.stream(self._generation, events), on_close=closed)

    async def collect(self) -> list[CollectedChoice]:
        """Every choice's whole output; a client that leaves cancels the generation."""
        try:
            with self._ticket:
                async with self._record.recording(self._generation):
                    return await cancel_on_disconnect(self._request, self._generation.collect())
        finally:
            self._charge.release(self._generation.usage().total_tokens)
