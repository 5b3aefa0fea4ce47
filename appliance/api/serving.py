"""One inference request from admission to its answer, the same for completions and chat.

It takes places in the admission queue, then logs `inference.request` to the audit log before
anything is generated (a failed append gives the places back: not logged, not served). The
output then goes out whole or as a stream; either way the places are released and the audit
record is closed when it ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

from fastapi import Request

from appliance.api.admission import Admission, Ticket
from appliance.api.audit_trail import AuditTrail, InferenceRecord
from appliance.api.generation import CollectedChoice, Generation, cancel_on_disconnect
from appliance.api.streaming import EventStreamResponse
from audit.canonical import JsonValue


class AdmittedRequest:
    def __init__(
        self, request: Request, ticket: Ticket, record: InferenceRecord, generation: Generation
    ):
        self._request = request
        self._ticket = ticket
        self._record = record
        self._generation = generation

    @classmethod
    async def admit(
        cls,
        request: Request,
        generation: Generation,
        admission: Admission,
        audit: AuditTrail,
        *,
        request_id: str,
        endpoint: str,
        prompt: JsonValue,
        sampling: Mapping[str, JsonValue],
        arrival_s: float,
    ) -> AdmittedRequest:
        """Admit one place per choice and log the request. Raises the admission's 429 or the
        audit log's 503 (then holding no place)."""
        ticket = admission.admit(len(generation.choices))
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
            raise
        return cls(request, ticket, record, generation)

    def stream(self, events: AsyncGenerator[bytes, None]) -> EventStreamResponse:
        """The server-sent events `events` of the generation, recorded as they go."""

        def closed() -> None:
            self._ticket.release()
            self._record.close_stream(self._generation)

        return EventStreamResponse(self._record.stream(self._generation, events), on_close=closed)

    async def collect(self) -> list[CollectedChoice]:
        """Every choice's whole output; a client that leaves cancels the generation."""
        with self._ticket:
            async with self._record.recording(self._generation):
                return await cancel_on_disconnect(self._request, self._generation.collect())
