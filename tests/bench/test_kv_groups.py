"""bench/kv_groups.py prints the figures docs/BENCHMARKS.md quotes for issue 21 (Gemma-3-12B at
32k tokens, 40 GiB of KV): they come from the engine's sizing code, so this fails when that code
changes them and the page has not followed."""

from __future__ import annotations

import sys

import pytest

from bench import kv_groups


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["kv_groups.py", *args])
    kv_groups.main()
    return capsys.readouterr().out


def test_gemma3_12b_at_32k_holds_three_sequences_in_one_pool_and_nine_with_kv_groups(
    monkeypatch, capsys
):
    out = _run(monkeypatch, capsys, "--model", "gemma-3-12b")
    assert "a 32768-token sequence: 12.00 GiB before, 2.32 GiB after" in out
    assert "window pool 4340 blocks (21.19 GiB), full pool 19260 blocks" in out
    assert out.rstrip().endswith("32768-token sequences held at once: 3 before, 9 after")


def test_fewer_running_sequences_leave_the_full_layers_more(monkeypatch, capsys):
    out = _run(monkeypatch, capsys, "--model", "gemma-3-12b", "--max-num-seqs", "16")
    assert out.rstrip().endswith("held at once: 3 before, 16 after")
