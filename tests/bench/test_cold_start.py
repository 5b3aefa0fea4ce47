"""bench/cold_start.py's split of W5's "rest": the intervals between the audit log's boot
entries, less the phases measured inside each, add up to what the phases leave unexplained."""

from __future__ import annotations

import datetime

import pytest

from bench.cold_start import rest_split


def _entry(at_s: float) -> dict[str, str]:
    """An entry at `at_s` seconds after 2026-11-26T00:00:00Z, as the audit log writes times."""
    seconds, micros = divmod(round(at_s * 1e6), 1_000_000)
    return {"time": f"2026-11-26T00:{seconds // 60:02d}:{seconds % 60:02d}.{micros:06d}Z"}


def test_the_intervals_less_their_phases_add_up_to_the_rest():
    epoch = datetime.datetime(2026, 11, 26, tzinfo=datetime.UTC).timestamp()
    boot = {
        "boot.start": _entry(2.5),
        "attestation.verdict": _entry(4.0),
        "boot.ready": _entry(9.0),
    }
    split = rest_split(
        boot,
        epoch + 0.1,  # the process's start (devices taken out)
        epoch + 9.25,  # /health's first 200
        before_s=2.3,  # python start, imports, audit open
        attestation_s=0.3,
        loading_s=4.5,
        app_build_s=1.0,
        listen_s=0.01,
    )
    assert split == pytest.approx(
        {
            "  before boot.start (settings, TEE service)": 0.1,
            "  boot.start to the verdict, of which:": 1.2,
            "    the app's build": 1.0,
            "    listening (TLS context, socket)": 0.01,
            "  verdict to boot.ready (sealed open, ring, records)": 0.5,
            "  boot.ready to /health 200 (engine thread, poll)": 0.25,
        }
    )
    wall, path = 9.25 - 0.1, 2.3 + 0.3 + 4.5
    parts = [v for k, v in split.items() if not k.startswith("    ")]
    assert sum(parts) == pytest.approx(wall - path)
