"""`packed_inputs.Uploader`: every array a view of one copy, 16-byte aligned, with its values;
on a GPU the reused host buffers are not written while a queued copy still reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from appliance.engine.packed_inputs import Uploader


def _arrays(seed: int, rows: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    values = np.arange(seed, seed + 3 * rows)
    int64s = {"ids": values[:rows].astype(np.int64), "slots": values[rows : 2 * rows] * 2**33}
    int32s = {"tables": values[: 3 * rows].astype(np.int32).reshape(rows, 3)}
    return int64s, int32s


def _check(views: dict[str, torch.Tensor], int64s, int32s) -> None:
    for name, expected in (int64s | int32s).items():
        view = views[name]
        assert view.dtype == (torch.int64 if name in int64s else torch.int32), name
        assert view.cpu().tolist() == expected.tolist(), name
        assert view.storage_offset() * view.element_size() % 16 == 0, f"{name} unaligned"


def test_every_array_is_an_aligned_view_of_one_buffer() -> None:
    int64s, int32s = _arrays(7, rows=3)  # odd lengths: unaligned ends
    views = Uploader(torch.device("cpu")).upload(int64s, int32s)
    assert len({v.untyped_storage().data_ptr() for v in views.values()}) == 1
    _check(views, int64s, int32s)


@pytest.mark.gpu
def test_a_host_buffer_is_not_rewritten_under_a_queued_copy() -> None:
    uploader = Uploader(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # ~0.1 s: every copy below queues behind it
    # More steps than buffers: the fourth reuses the first's (it fits), the fifth outgrows the
    # second's.
    steps = [_arrays(100 * i, rows) for i, rows in enumerate([2, 2, 2, 3, 5])]
    snapshots = []
    for int64s, int32s in steps:
        views = uploader.upload(int64s, int32s)
        # Stream-ordered: each snapshot is taken right after its own copy, before a later one
        # lands in the same device buffer.
        snapshots.append({name: view.clone() for name, view in views.items()})
    torch.cuda.synchronize()
    for (int64s, int32s), snapshot in zip(steps, snapshots, strict=True):
        _check(snapshot, int64s, int32s)
