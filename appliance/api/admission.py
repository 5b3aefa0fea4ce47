"""Admission control: at most `max_sequences` sequences in the engine at once.

A request over the limit is answered 429 with `Retry-After` at once, instead of joining an
unbounded queue where it would only time out later. A request with `n` choices takes `n`
places. Everything runs on the event loop, so no lock is needed.
"""

from __future__ import annotations

from typing import Annotated, Self

from fastapi import Depends, Request

from appliance.api.errors import APIError


class Admission:
    def __init__(self, max_sequences: int, retry_after_s: int):
        self.max_sequences = max_sequences
        self.retry_after_s = retry_after_s
        self.num_admitted = 0

    def admit(self, num_sequences: int) -> Ticket:
        """Take `num_sequences` places, or raise the 429 (or the 400 for a request that could
        never fit)."""
        if num_sequences > self.max_sequences:
            raise APIError(
                400,
                f"n = {num_sequences} is more than the {self.max_sequences} sequences this server "
                "runs at once; lower n",
                param="n",
            )
        if self.num_admitted + num_sequences > self.max_sequences:
            raise APIError(
                429,
                f"the server is running its limit of {self.max_sequences} sequences; "
                f"retry after {self.retry_after_s} s",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.num_admitted += num_sequences
        return Ticket(self, num_sequences)


class Ticket:
    """Places held by one request; `release` gives them back (once, however often called)."""

    def __init__(self, admission: Admission, num_sequences: int):
        self._admission = admission
        self._num_sequences = num_sequences

    def release(self) -> None:
        self._admission.num_admitted -= self._num_sequences
        self._num_sequences = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


async def _admission(request: Request) -> Admission:
    return request.app.state.admission


AdmissionControl = Annotated[Admission, Depends(_admission)]
