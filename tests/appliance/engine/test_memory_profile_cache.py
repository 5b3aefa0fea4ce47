"""A kept memory profile is read back only as it was written, for its own key: anything else is
ignored with a warning (the engine then measures), and a directory that cannot take one costs a
warning, never the build. The GPU side (a second build reading what the first measured) is in
test_memory_profile_gpu.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from appliance.engine.memory_profile_cache import (
    FORMAT,
    MAX_FILE_BYTES,
    MemoryProfileCache,
    ProfiledPeaks,
)

KEY = {"model_config_sha256": "ab" * 32, "engine": {"max_num_seqs": 64}, "gpu": ["H100", 80]}
PEAKS = ProfiledPeaks(forward_peak=3 << 30, sampling_peak=1 << 30, step_reserved=4 << 30,
                      graph_pool=150 << 20, first_steps_growth=300 << 20)  # fmt: skip
DEVICE_MEMORY = 80 << 30


def _document(**changes: object) -> dict[str, object]:
    peaks = {name: getattr(PEAKS, name) for name in ProfiledPeaks.__slots__}
    return {"format": FORMAT, "key": KEY, "peaks": peaks} | changes


def test_peaks_come_back_as_they_were_kept(tmp_path: Path) -> None:
    cache = MemoryProfileCache(tmp_path / "triton-cache", KEY)
    assert cache.load(DEVICE_MEMORY) is None  # nothing kept yet: measure, silently
    cache.store(PEAKS)
    assert MemoryProfileCache(tmp_path / "triton-cache", dict(KEY)).load(DEVICE_MEMORY) == PEAKS
    assert [p.name for p in cache.path.parent.iterdir()] == [cache.path.name]  # no temporary
    assert cache.path.name.startswith("inferno-memory-profile-")


def test_each_key_has_its_own_file(tmp_path: Path) -> None:
    cache = MemoryProfileCache(tmp_path, KEY)
    cache.store(PEAKS)
    other = MemoryProfileCache(tmp_path, KEY | {"engine": {"max_num_seqs": 128}})
    assert other.path != cache.path
    assert other.load(DEVICE_MEMORY) is None


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "not JSON"),
        (json.dumps([1, 2]).encode(), "not a memory profile"),
        (json.dumps(_document(format="inferno-memory-profile/0")).encode(), "format"),
        (json.dumps(_document(key=KEY | {"gpu": ["H200", 141]})).encode(), "another engine"),
        (json.dumps(_document(peaks={"forward_peak": 1})).encode(), "its peaks are not"),
        (json.dumps(_document(extra=1)).encode(), "not a memory profile"),
    ],
)
def test_an_unusable_file_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str
) -> None:
    cache = MemoryProfileCache(tmp_path, KEY)
    cache.path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert cache.load(DEVICE_MEMORY) is None
    assert why in caplog.text and "measuring" in caplog.text


@pytest.mark.parametrize("value", [-1, DEVICE_MEMORY + 1, 1.5, True, "1024", None])
def test_a_figure_outside_the_gpus_memory_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: object
) -> None:
    document = _document()
    document["peaks"] = dict(document["peaks"], graph_pool=value)  # type: ignore[call-overload]
    cache = MemoryProfileCache(tmp_path, KEY)
    cache.path.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING):
        assert cache.load(DEVICE_MEMORY) is None
    assert "graph_pool" in caplog.text


def test_an_oversized_file_is_not_parsed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = MemoryProfileCache(tmp_path, KEY)
    cache.path.write_bytes(json.dumps(_document()).encode() + b" " * MAX_FILE_BYTES)
    with caplog.at_level(logging.WARNING):
        assert cache.load(DEVICE_MEMORY) is None
    assert f"larger than {MAX_FILE_BYTES} bytes" in caplog.text


def test_a_directory_that_cannot_take_the_file_costs_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = MemoryProfileCache(blocker / "triton-cache", KEY)  # its parent is a file
    with caplog.at_level(logging.WARNING):
        cache.store(PEAKS)
    assert "memory profile not kept" in caplog.text
    assert cache.load(DEVICE_MEMORY) is None
