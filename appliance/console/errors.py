"""The console's one error: what it answers with its error page (an HTML page, never JSON)."""

from __future__ import annotations


class ConsoleError(Exception):
    """A page or action the console cannot serve; `message` says why and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
