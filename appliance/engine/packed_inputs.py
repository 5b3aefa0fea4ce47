"""A step's integer inputs on the device through one host-to-device copy.

Each copy is a few microseconds of the device's time and more of the host's, and a step has a
dozen small arrays (token ids, positions, slots, block tables, lengths, ...). They are packed
into one int32 buffer, copied once, and each becomes a view of the device's copy in its own
dtype and shape.

The host buffer is pinned, so the copy runs asynchronously with the host's next work, and
both buffers are reused rather than pinned and allocated anew every step: under W3's load on
the H100 that took the upload's share of the engine thread's samples from 7.4% to 5.3%
(docs/BENCHMARKS.md, round 6). A few pairs take turns; a host buffer is written again only once
the copy that last read it has finished (with asynchronous scheduling one step's copy may still
be queued while the next step is packed).

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
        # Per turn: the pinned host buffer, the device buffer it is copied into, and an event
        # marking the end of that copy. A device buffer needs no event: the next copy into it
        # is queued behind every kernel that read it.
        self._host: list[torch.Tensor | None] = [None] * _NUM_BUFFERS
        self._device: list[torch.Tensor | None] = [None] * _NUM_BUFFERS
        self._copied = (
            [torch.cuda.Event() for _ in range(_NUM_BUFFERS)] if device.type == "cuda" else []
        )
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
        if self.device.type == "cuda":
            host, copy = self._host_buffer(total), self._device_buffer(total)
        else:
            host = copy = torch.zeros(total, dtype=torch.int32)
        packed = host.numpy()
        for name, part in words.items():
            packed[starts[name] : starts[name] + part.size] = part
        if self.device.type == "cuda":
            self._send(host, copy)
        views = {}
        for name, part in words.items():
            view = copy[starts[name] : starts[name] + part.size]
            views[name] = (
                view.view(torch.int64) if name in int64s else view.view(int32s[name].shape)
            )
        return views

    def copy_into(self, packed: np.ndarray, target: torch.Tensor) -> None:
        """Copy int32 words `packed` into the start of the device tensor `target` (int32, at
        least as long), through this turn's pinned buffer, without waiting for the copy."""
        host = self._host_buffer(packed.size)
        host.numpy()[:] = packed
        self._send(host, target[: packed.size])

    def _send(self, host: torch.Tensor, device: torch.Tensor) -> None:
        """Queue this turn's copy and pass the turn on."""
        device.copy_(host, non_blocking=True)
        self._copied[self._turn].record()
        self._turn = (self._turn + 1) % _NUM_BUFFERS

    def _host_buffer(self, words: int) -> torch.Tensor:
        """This turn's pinned host buffer, `words` int32s, no longer read by the copy that last
        used it."""
        turn = self._turn
        self._copied[turn].synchronize()  # long done but in the rarest case: a step ago
        host = self._host[turn]
        if host is None or host.numel() < words:
            # Twice the need, so a growing batch does not allocate anew every step.
            host = torch.empty(2 * words, dtype=torch.int32, pin_memory=True)
            self._host[turn] = host
        return host[:words]

    def _device_buffer(self, words: int) -> torch.Tensor:
        """This turn's device buffer, `words` int32s (its next copy is queued behind every
        kernel that read it)."""
        device = self._device[self._turn]
        if device is None or device.numel() < words:
            device = torch.empty(2 * words, dtype=torch.int32, device=self.device)
            self._device[self._turn] = device
        return device[:words]
