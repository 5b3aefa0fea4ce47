"""Recurrent-state slots: which running sequence owns which slot of the linear-attention layers'
state (models.recurrent_state).

A hybrid model's linear layers keep a fixed-size state per sequence instead of KV blocks. The
engine sizes the state for `max_num_seqs` slots, so every sequence the scheduler admits finds
one free: a sequence takes a slot when it is first scheduled and gives it back when it finishes,
is cancelled or is preempted (preemption recomputes: the state is rebuilt from the prompt and
the generated tokens when the sequence runs again).
"""

from __future__ import annotations

from appliance.engine.errors import EngineConfigError
from appliance.engine.sequence import Sequence


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise EngineConfigError(f"need at least one recurrent-state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of slots held by a sequence, 0 to 1."""
        return 1.0 - len(self._free) / self.num_slots

    def take(self, seq: Sequence) -> None:
        """Give `seq` a slot. The scheduler admits at most `num_slots` sequences at once, so
        one is always free."""
        assert seq.state_slot is None, "a sequence holds one slot at a time"
        assert self._free, "no more running sequences than slots"
        seq.state_slot = self._free.pop()

    def free(self, seq: Sequence) -> None:
        """Give back `seq`'s slot, if it holds one."""
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None
