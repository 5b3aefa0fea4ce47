"""One inference request from admission to its answer, the same for completions, chat and
responses.

`Server.serve` is the one request path of the three routes: check the request, plan its choices
(which validates every engine request, salted with the caller's prefix-cache domain), admit it under
its caller's limits (appliance.api.limits), take places in the admission queue, log
`inference.request` to the audit log before anything is generated (a failed append gives the
places back: not logged, not served), then answer whole or as a stream; either way the places
are released, the caller's limits are charged its tokens, and the audit record is closed when it
ends. What differs between the routes is an `Endpoint`: its prompt and choices, and the `Output`
that turns engine outputs into its response and chunks (or, an `EventOutput`, into its own
stream of events).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any, Literal, Protocol, TypeVar, runtime_checkable

from fastapi import Depends, Request
from pydantic import BaseModel

from appliance.api.admission import Admission, AdmissionControl, Ticket
from appliance.api.audit_trail import AuditTrail, InferenceRecord, Trail, sampling_record
from appliance.api.cache_domains import PrefixCacheDomain
from appliance.api.errors import ERROR_RESPONSES, APIError, api_error_for
from appliance.api.generation import (
    Choice,
    CollectedChoice,
    Generation,
    cancel_on_disconnect,
    require_tokenizer,
)
from appliance.api.limits import CallerLimits, Charge, Limits
from appliance.api.metrics import Metrics
from appliance.api.models import Model, ServedModel
from appliance.api.readiness import ReadyEngine
from appliance.api.schemas import StreamOptions
from appliance.api.streaming import (
    DONE,
    ChunkChoice,
    ChunkWriter,
    EventStreamResponse,
    StreamHead,
    event,
)
from appliance.engine.errors import EngineError
from appliance.engine.outputs import RequestOutput
from appliance.engine.tokenizer import Tokenizer
from audit.canonical import JsonValue

ResponseT = TypeVar("ResponseT", bound=BaseModel, covariant=True)


class Output(Protocol[ResponseT]):
    """An endpoint's answer to one admitted request, whole or as stream chunks."""

    def opening(self) -> Iterable[ChunkChoice]:
        """The chunks a stream starts with, before any output."""
        ...

    def chunks(self, index: int, out: RequestOutput) -> Iterator[ChunkChoice]:
        """The chunks of choice `index`'s output `out`; raises `cut_off_error()` for an output
        the engine aborted, after the chunks the endpoint still sends for it."""
        ...

    def response(
        self, head: StreamHead, generation: Generation, results: list[CollectedChoice]
    ) -> ResponseT:
        """The whole response, from every choice's collected output."""
        ...


@runtime_checkable
class EventOutput(Protocol):
    """An output that writes its own server-sent events (the Responses API's typed events)
    rather than chat or completion chunks."""

    def events(self, head: StreamHead, generation: Generation) -> AsyncGenerator[bytes, None]:
        """The whole stream; errors after the status was sent become error events."""
        ...

    def is_final(self, event: bytes) -> bool:
        """Whether `event` ends the stream: it is sent only once the audit log stored the
        request's end."""
        ...


class ServedBody(Protocol):
    """What the shared path reads of a request body."""

    @property
    def model(self) -> str: ...
    @property
    def n(self) -> int: ...
    @property
    def stream(self) -> bool: ...
    @property
    def stream_options(self) -> StreamOptions | None: ...
    @property
    def cache_salt(self) -> str | None: ...


class Endpoint(Protocol[ResponseT]):
    """What one route adds to the shared path, for one request `body`."""

    path: str
    id_prefix: str  # of the response's id: "<id_prefix>-<random hex>"
    chunk_object: Literal["text_completion", "chat.completion.chunk", "response"]
    prompt_param: str  # the request field a prompt that does not fit is blamed on
    body: ServedBody

    @property
    def uses_tools(self) -> bool:
        """Whether the request lets the model call tools (known once `choices` ran)."""
        ...

    def verify_supported(self) -> None:
        """Raise an APIError for what the request asks and this server does not do."""
        ...

    def choices(self, model: ServedModel, tokenizer: Tokenizer, max_model_len: int) -> list[Choice]:
        """Every engine request of the request, for the served `model`; may raise EngineError (a
        prompt the tokenizer refuses)."""
        ...

    def prompt_record(self) -> JsonValue:
        """The prompt as the audit log commits to it."""
        ...

    def output(self, tokenizer: Tokenizer, choices: list[Choice]) -> Output[ResponseT]:
        """The request's output, once its engine requests are validated and it is admitted."""
        ...


# What both routes answer besides their errors: a JSON body, or server-sent events.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "with stream: true"},
    **ERROR_RESPONSES,
}


class Server:
    """What serving a request needs of the app and its caller: the engine, model, caller's
    limits, admission, metrics, audit trail and the caller's prefix-cache domain (FastAPI
    dependencies)."""

    def __init__(
        self,
        engine: ReadyEngine,
        model: Model,
        limits: Limits,
        admission: AdmissionControl,
        metrics: Metrics,
        audit: Trail,
        cache: PrefixCacheDomain,
    ):
        self.engine = engine
        self.model = model
        self.limits = limits
        self.admission = admission
        self.metrics = metrics
        self.audit = audit
        self.cache = cache

    async def serve(
        self, request: Request, endpoint: Endpoint[ResponseT]
    ) -> ResponseT | EventStreamResponse:
        """Answer one request of `endpoint`: whole, or streamed when `stream` is true."""
        arrival_s = time.monotonic()
        body = endpoint.body
        self.model.verify(body.model)
        endpoint.verify_supported()
        tokenizer = require_tokenizer(self.engine)
        response_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        try:
            choices = endpoint.choices(self.model, tokenizer, self.engine.max_model_len)
            generation = Generation(
                self.engine,
                self.metrics,
                response_id,
                choices,
                arrival_s=arrival_s,
                cache_salt=self.cache.salt(body.cache_salt),
            )
        except EngineError as exc:
            raise api_error_for(exc, prompt_param=endpoint.prompt_param) from exc
        admitted = await AdmittedRequest.admit(
            request,
            generation,
            self.limits,
            self.admission,
            self.audit,
            request_id=response_id,
            endpoint=endpoint.path,
            prompt=endpoint.prompt_record(),
            sampling=sampling_record(choices[0].params, n=body.n, stream=body.stream),
            arrival_s=arrival_s,
        )
        if endpoint.uses_tools:
            self.metrics.count_tool_request(endpoint.path)
        structured = choices[0].params.structured
        if structured is not None:
            self.metrics.count_structured_request(endpoint.path, structured.kind)
        output = endpoint.output(tokenizer, choices)
        head = StreamHead(response_id, endpoint.chunk_object, int(time.time()), self.model.card.id)
        if body.stream and isinstance(output, EventOutput):
            return admitted.stream(output.events(head, generation), is_final=output.is_final)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            writer = ChunkWriter(head, include_usage=include_usage)
            return admitted.stream(_events(generation, writer, output))
        return output.response(head, generation, await admitted.collect())


Serving = Annotated[Server, Depends()]


async def _events(
    generation: Generation, writer: ChunkWriter, output: Output[BaseModel]
) -> AsyncGenerator[bytes, None]:
    """The output's opening chunks, then its chunks as the engine produces them; then the usage
    (if asked for) and [DONE]. An error after the status was sent becomes an error event.

    What is ready together goes out in one write: an engine output carries every token ready
    for its request (a decode burst's, or all those queued while this stream was busy), and its
    chunks (text, then finish) are joined, so the transport sends one TLS record for them."""
    for choice in output.opening():
        yield writer.chunk(choice)
    try:
        async for index, out in generation.outputs():
            ready = b"".join(writer.chunk(choice) for choice in output.chunks(index, out))
            if ready:
                yield ready
        if writer.include_usage:
            yield writer.usage(generation.usage())
    except APIError as exc:
        yield event(exc.body())
    except EngineError as exc:
        yield event(api_error_for(exc).body())
    yield DONE


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

    def stream(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        is_final: Callable[[bytes], bool] = DONE.__eq__,
    ) -> EventStreamResponse:
        """The server-sent events `events` of the generation, recorded as they go; the one
        `is_final` picks is sent once the request's end is logged."""

        def closed() -> None:
            self._ticket.release()
            self._charge.release(self._generation.usage().total_tokens)
            self._record.close_stream(self._generation)

        recorded = self._record.stream(self._generation, events, is_final=is_final)
        return EventStreamResponse(recorded, on_close=closed)

    async def collect(self) -> list[CollectedChoice]:
        """Every choice's whole output; a client that leaves cancels the generation."""
        try:
            with self._ticket:
                async with self._record.recording(self._generation):
                    return await cancel_on_disconnect(self._request, self._generation.collect())
        finally:
            self._charge.release(self._generation.usage().total_tokens)
