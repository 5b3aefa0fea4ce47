"""`cuda_graphs.collector_paused`: the cyclic collector stays off through graph captures (a
collection could destroy another engine's graph mid-capture and fail it), and comes back as it
was, also when the capture raises."""

from __future__ import annotations

import gc

import pytest

from appliance.engine.cuda_graphs import collector_paused


@pytest.fixture(autouse=True)
def _restore_collector():
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_off_inside_and_on_again_after() -> None:
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_failed_capture_turns_it_back_on() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()


def test_a_collector_paused_already_stays_paused() -> None:
    """`inferno serve` pauses it through its whole start (appliance.boot.collector_pause)."""
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
