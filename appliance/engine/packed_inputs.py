"""A step's integer inputs on the device through one host-to-device copy.

Each copy is a few microseconds of the device's time and more of the host's, and a step has a
dozen small arrays (token ids, positions, slots, block tables, lengths, ...). They are packed
into one int32 buffer, copied once, and each becomes a view of the device's copy in its own
dtype and shape.

The host buffer is pinned, so the copy runs asynchronously with the host's next work, and
reused: pinning a fresh buffer every step (torch's `pin_memory`) took about 0.7 ms of the
engine thread's time per step on the H100 host under W3's load (a py-spy profile, docs/
BENCHMARKS.md). A few buffers take turns, each reused only once the copy that last read it
has finished (an event per buffer; with asynchronous scheduling one step's copy may still be
queued while the next step is packed).

Every array starts on a 16-byte boundary: Triton specializes a kernel on whether each pointer
argument is 16-byte aligned, so a view at any other offset would compile another variant of
every kernel it reaches, in the middle of serving (docs/BENCHMARKS.md, "Issue 17, round 4").
"""

from __future__ import annotations

import numpy as np
import torch

# Every array starts at a multiple of this many int32 words (16 bytes).
_ALIGN_WORDS = 4
# Host buffers taking turns: more than the steps that can be in flight at once (two).
_NUM_BUFFERS = 3


class Uploader:
    """Packs and copies a step's inputs to `device` (on the CPU: views of the packed buffer)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * _NUM_BUFFERS
        self._copied: list[torch.cuda.Event | None] = [None] * _NUM_BUFFERS
        self._turn = 0

    def upload(
        self, int64s: dict[str, np.ndarray], int32s: dict[str, np.ndarray]
    ) -> dict[str, torch.Tensor]:
        """Each array by name, a view of one copy on the device. Arrays are contiguous; int64s
        keep int64, int32s int32 and their shapes."""
        words = {name: a.view(np.int32).ravel() for name, a in int64s.items()}
        words |= {name: a.ravel() for name, a in int32s.items()}
        starts, total = {}, 0
        for name, part in words.items():
            starts[name] = total
            total += -(-part.size // _ALIGN_WORDS) * _ALIGN_WORDS
        host = self._host_buffer(total)
        packed = host.numpy()
        for name, part in words.items():
            packed[starts[name] : starts[name] + part.size] = part
        copy = host
        if self.device.type == "cuda":
            copy = host.to(self.device, non_blocking=True)
            self._copied[self._turn].record()
            self._turn = (self._turn + 1) % _NUM_BUFFERS
        views = {}
        for name, part in words.items():
            view = copy[starts[name] : starts[name] + part.size]
            views[name] = (
                view.view(torch.int64) if name in int64s else view.view(int32s[name].shape)
            )
        return views

    def _host_buffer(self, words: int) -> torch.Tensor:
        """`words` int32s of host memory nothing reads any more: this turn's pinned buffer on a
        GPU (after the copy that last read it), a fresh one on the CPU (the device's inputs are
        views of it)."""
        if self.device.type != "cuda":
            return torch.zeros(words, dtype=torch.int32)
        turn = self._turn
        copied = self._copied[turn]
        if copied is None:
            copied = self._copied[turn] = torch.cuda.Event()
        else:
            copied.synchronize()  # long done but in the rarest case: a step ago
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < words:
            # Grown to twice the need, so a growing batch does not pin anew every step.
            buffer = torch.empty(2 * words, dtype=torch.int32, pin_memory=True)
            self._buffers[turn] = buffer
        return buffer[:words]
