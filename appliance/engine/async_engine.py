"""An asyncio face for the engine: per-request output streams, driven by one engine thread.

The engine itself is single-threaded. A dedicated thread owns it and loops: apply queued
commands (add, abort), run a step, hand each output to its request's output stream on the event
loop (one wake-up of the loop per step). Requests are tokenized and validated on the caller's
side first, so a bad request raises to its caller at once and never reaches the engine thread.

CUDA graphs left from the engine's build (EngineConfig.capture_graphs_when_idle) are captured by
the same thread, one at a time: whenever no request has been unfinished for
`IDLE_CAPTURE_QUIET_S` (since the thread started, or since its last step), and while requests
run, one between two steps every `BUSY_CAPTURE_INTERVAL_S` (a server busy from its start would
otherwise never capture them, and run eagerly for good). The quiet spell keeps a capture out of
the way of a request that comes just after the server is ready (whoever waited for the ready
sends at once: W5's request, docs/BENCHMARKS.md) or in a short gap between requests, where it
would wait for the capture (an 8B model's twenty-odd graphs take 2.4-3 s after the ready on the
H100, so 0.1-0.2 s each).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.engine.errors import EngineError, InvalidRequestError
from appliance.engine.outputs import EngineStats, RequestOutput
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.sequence import RequestId
from appliance.engine.sequence import Sequence as EngineSequence
from appliance.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from appliance.engine.engine import Engine

logger = logging.getLogger(__name__)

# How long shutdown waits for an engine thread that failed by another's report (a dead
# tensor-parallel worker): it may be stuck in a GPU kernel waiting for that peer, for good.
_FAILED_JOIN_S = 10.0

# While requests run, at most one graph capture (tens of ms for an 8B model, every running
# request waiting) in this many seconds: the twenty-odd graphs are in within about fifteen.
BUSY_CAPTURE_INTERVAL_S = 0.5
# While idle, a capture starts only after this long without a step (module docstring).
IDLE_CAPTURE_QUIET_S = 0.2


class EngineDeadError(EngineError):
    """The engine thread stopped on an unexpected error; no request can be served."""


@dataclass(frozen=True, slots=True)
class _Add:
    seq: EngineSequence


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: RequestId


class _OutputStream:
    """One request's outputs (or the error that ends them) on their way from the engine thread
    to the request's one consumer, on the event loop. What `asyncio.Queue` would do with less
    work per item, which is per streamed token: no size bound, no task accounting, one waiter,
    and the consumer takes everything that is ready at once."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[RequestOutput | BaseException] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """On the event loop."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[RequestOutput | BaseException]:
        """Everything put since the last take, in order; waits for at least one item."""
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


def _merged(
    items: list[RequestOutput | BaseException],
) -> tuple[RequestOutput | None, BaseException | None]:
    """The outputs among `items` as one (a consumer that fell behind gets everything queued at
    once: under load each wake-up does a bounded amount of work, instead of one per token), up
    to the error that ended them, if one did."""
    merged: RequestOutput | None = None
    for item in items:
        if isinstance(item, BaseException):
            return merged, item
        merged = item if merged is None else merged.followed_by(item)
    return merged, None


class AsyncEngine:
    """Use as `async with AsyncEngine(engine) as ae: async for out in ae.generate(...)`.

    This is all of the engine the API sees: requests in, outputs out, and the few facts about the
    served model a request needs (its tokenizer and context length) and metrics read.
    """

    def __init__(self, engine: Engine):
        self._engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[RequestId, _OutputStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failing = threading.Lock()
        self._failed: asyncio.Future[BaseException] | None = None

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The served model's tokenizer; None for an engine that takes token ids only."""
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context length in tokens: prompt and output together."""
        return self._engine.max_model_len

    def stats(self) -> EngineStats:
        """The engine's load and cache counters; a snapshot read without stopping the engine."""
        return self._engine.stats()

    @property
    def has_failed(self) -> bool:
        """The engine thread stopped on an error (`wait_failed` has it)."""
        return self._error is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="inferno-engine", daemon=True)
        self._thread.start()
        if self._engine.group is not None:
            # A dead worker fails the engine at once, from the group's watch, even while the
            # engine thread is held in a GPU kernel that waits for the dead peer (a one-shot
            # all-reduce's barrier, which no abort ends): clients and /health learn it now.
            self._engine.group.on_failure(self._fail)

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still running end with an abort."""
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, None if self._error is None else _FAILED_JOIN_S)
        if self._thread.is_alive():
            logger.warning("the failed engine thread did not end; leaving it to the process exit")
        self._thread = None

    async def wait_failed(self) -> BaseException:
        """Wait until the engine thread stops on an error (a dead tensor-parallel worker, a
        GPU fault); that error. Never returns for an engine that only shuts down."""
        assert self._failed is not None, "start() first"
        return await asyncio.shield(self._failed)

    def close_engine(self) -> None:
        """After `shutdown`: stop what the engine holds outside this process's thread (its
        tensor-parallel workers). Blocking; the engine serves nothing after."""
        self._engine.close()

    def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Validate a request now and return its stream of outputs.

        A bad request raises `InvalidRequestError` here, before anything is submitted, so a
        caller can refuse it before answering (an HTTP server: before sending a status). The
        request is submitted when the stream is first iterated. Leaving the iteration early (or
        being cancelled, as when an HTTP client disconnects) aborts the request and frees its KV
        blocks.
        """
        if self._error is not None or not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        seq = self._engine.prepare_request(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        return self._stream(seq)

    async def _stream(self, seq: EngineSequence) -> AsyncIterator[RequestOutput]:
        rid = seq.request_id
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        stream = _OutputStream()
        self._streams[rid] = stream
        seq.queued_at_s = time.monotonic()  # its wait in the engine thread's inbox counts
        self._commands.put(_Add(seq))
        finished = False
        try:
            # The thread sets _error before it fails every registered stream: a stream
            # registered too late for that sees the error here instead of waiting forever.
            if self._error is not None:
                raise EngineDeadError("the engine is not running") from self._error
            while not finished:
                out, error = _merged(await stream.take())
                if out is not None:
                    finished = out.finished
                    yield out
                if error is not None and not finished:
                    if isinstance(error, InvalidRequestError):
                        raise error
                    raise EngineDeadError(
                        "the engine stopped while serving this request"
                    ) from error
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._commands.put(_Abort(rid))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(RequestId(request_id)))

    def _run(self) -> None:
        engine = self._engine
        next_busy_capture_s = time.monotonic() + BUSY_CAPTURE_INTERVAL_S
        quiet_from_s = time.monotonic() + IDLE_CAPTURE_QUIET_S
        try:
            while True:
                # Block for a command when idle: for good with no CUDA graph left to capture,
                # else until the quiet spell is over. Otherwise drain what is there, then step,
                # or capture the next graph.
                timeout: float | None = 0.0
                if not engine.has_unfinished():
                    timeout = None
                    if engine.num_pending_graphs:
                        timeout = max(quiet_from_s - time.monotonic(), 0.0)
                while True:
                    try:
                        command = self._commands.get(block=timeout != 0.0, timeout=timeout)
                    except queue.Empty:
                        break
                    timeout = 0.0
                    if command is None:
                        self._deliver(engine.abort_all())
                        return
                    if isinstance(command, _Add):
                        try:
                            engine.add_sequence(command.seq)
                        except InvalidRequestError as exc:
                            self._push(command.seq.request_id, exc)
                    else:
                        out = engine.abort(command.request_id)
                        if out is not None:
                            self._deliver([out])
                busy = engine.has_unfinished()
                now_s = time.monotonic()
                if engine.num_pending_graphs and now_s >= (
                    next_busy_capture_s if busy else quiet_from_s
                ):
                    self._deliver(engine.capture_pending_graph())
                    next_busy_capture_s = time.monotonic() + BUSY_CAPTURE_INTERVAL_S
                else:
                    self._deliver(engine.step())
                    if busy:
                        quiet_from_s = time.monotonic() + IDLE_CAPTURE_QUIET_S
        except BaseException as exc:  # the thread must report, whatever went wrong
            logger.exception("engine thread failed")
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """The engine serves no more: every stream ends with `exc`, `wait_failed` returns it.
        From the engine thread or the tensor-parallel watch; the first report wins."""
        with self._failing:
            if self._error is not None:
                return
            self._error = exc
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                self._loop.call_soon_threadsafe(self._set_failed, exc)
        for rid in list(self._streams):
            self._push(rid, exc)

    def _set_failed(self, exc: BaseException) -> None:
        if self._failed is not None and not self._failed.done():
            self._failed.set_result(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of the event loop per step, not one per request: each wake-up is a
        # system call, and a step can serve hundreds of requests.
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._put_all, outputs)

    def _put_all(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: hand each output to its stream (gone if its consumer left)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _push(self, rid: RequestId, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put, item)
