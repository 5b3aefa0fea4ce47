"""When the log signs a checkpoint, and when an idle log appends a heartbeat.

Pure decisions over times and counts, so they are tested without threads or clocks. A checkpoint
is due once `every_entries` entries wait for one, or once any entry has waited `every_s`. An idle
log still appends a heartbeat entry (and signs it) every `heartbeat_s`: as with CloudTrail's
hourly digest files, a verifier can then tell a quiet hour from an hour of deleted records.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPolicy:
    every_entries: int = 1000
    every_s: float = 10.0
    heartbeat_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.every_entries < 1 or self.every_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError(f"checkpoint policy needs positive intervals, got {self}")

    def checkpoint_due(self, *, num_pending: int, oldest_pending_at: float, now: float) -> bool:
        """Whether entries waiting since `oldest_pending_at` (monotonic seconds) need signing."""
        return num_pending > 0 and (
            num_pending >= self.every_entries or now - oldest_pending_at >= self.every_s
        )

    def heartbeat_due(self, *, last_append_at: float, now: float) -> bool:
        return now - last_append_at >= self.heartbeat_s

    def seconds_until_due(
        self, *, num_pending: int, oldest_pending_at: float, last_append_at: float, now: float
    ) -> float:
        """How long the writer may sleep before one of the two becomes due."""
        wake = last_append_at + self.heartbeat_s
        if num_pending:
            wake = min(wake, oldest_pending_at + self.every_s)
        return max(0.0, wake - now)
