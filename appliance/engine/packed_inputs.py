"""A step's integer inputs on the device through one host-to-device copy.

Each copy is a few microseconds of the device's time and more of the host's, and a step has a
dozen small arrays (token ids, positions, slots, block tables, lengths, ...). They are packed
into one int32 buffer, copied once, and each becomes a view of the device's copy in its own
dtype and shape.

Every array starts on a 16-byte boundary: Triton specializes a kernel on whether each pointer
argument is 16-byte aligned, so a view at any other offset would compile another variant of
every kernel it reaches, in the middle of serving (docs/BENCHMARKS.md, "Issue 17, round 4").
"""

from __future__ import annotations

import numpy as np
import torch

# Every array starts at a multiple of this many int32 words (16 bytes).
_ALIGN_WORDS = 4


def upload(
    int64s: dict[str, np.ndarray], int32s: dict[str, np.ndarray], device: torch.device
) -> dict[str, torch.Tensor]:
    """Each array by name, a view of one copy on `device` (pinned staging on a GPU, so the
    copy runs asynchronously with the host's next work; on the CPU the packed host buffer
    itself). Arrays are contiguous; int64s keep int64, int32s int32 and their shapes."""
    words = {name: a.view(np.int32).ravel() for name, a in int64s.items()}
    words |= {name: a.ravel() for name, a in int32s.items()}
    starts, total = {}, 0
    for name, part in words.items():
        starts[name] = total
        total += -(-part.size // _ALIGN_WORDS) * _ALIGN_WORDS
    packed = np.zeros(total, np.int32)
    for name, part in words.items():
        packed[starts[name] : starts[name] + part.size] = part
    copy = torch.from_numpy(packed)
    if device.type == "cuda":
        copy = copy.pin_memory().to(device, non_blocking=True)
    views = {}
    for name, part in words.items():
        view = copy[starts[name] : starts[name] + part.size]
        views[name] = view.view(torch.int64) if name in int64s else view.view(int32s[name].shape)
    return views
