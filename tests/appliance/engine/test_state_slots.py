"""Recurrent-state slots through the scheduler: taken at admission, given back on finish,
cancellation and preemption, never two running sequences on one slot."""

from __future__ import annotations

import pytest

from appliance.engine.block_manager import BlockManager
from appliance.engine.errors import EngineConfigError
from appliance.engine.scheduler import Scheduler, SchedulerConfig
from appliance.engine.sequence import SequenceStatus
from appliance.engine.state_slots import StateSlots

from .test_scheduler import make_seq, sample_for


def _scheduler(num_blocks: int, num_slots: int = 2) -> Scheduler:
    config = SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    block_manager = BlockManager(num_blocks, 2, enable_prefix_caching=False)
    return Scheduler(config, block_manager, StateSlots(num_slots))


def test_admitted_sequences_hold_distinct_slots_and_finishing_frees_them() -> None:
    sched = _scheduler(num_blocks=16)
    first, second, third = (make_seq(3, arrival=i) for i in range(3))
    for seq in (first, second, third):
        sched.add(seq)
    sample_for(sched.schedule())
    assert {first.state_slot, second.state_slot} == {0, 1}
    assert third.state_slot is None  # waiting: max_num_seqs running already
    slot = first.state_slot
    sched.finish(first, SequenceStatus.FINISHED_STOPPED)
    assert first.state_slot is None and sched.state_slots.num_free == 1
    sample_for(sched.schedule())
    assert third.state_slot == slot


def test_preemption_and_cancellation_give_the_slot_back() -> None:
    # Four blocks of two tokens: both prompts fit, then `first` needs a third block.
    sched = _scheduler(num_blocks=4)
    first, second = make_seq(4, arrival=0), make_seq(3, arrival=1)
    sched.add(first)
    sched.add(second)
    sample_for(sched.schedule())
    out = sched.schedule()
    assert out.preempted == [second]
    assert second.state_slot is None and sched.state_slots.num_free == 1
    sched.finish(second, SequenceStatus.FINISHED_ABORTED)  # cancelled while waiting
    assert sched.state_slots.num_free == 1
    sched.finish(first, SequenceStatus.FINISHED_ABORTED)
    assert sched.state_slots.num_free == 2


def test_fewer_slots_than_running_sequences_is_refused() -> None:
    with pytest.raises(EngineConfigError, match="max_num_seqs"):
        _scheduler(num_blocks=4, num_slots=1)
