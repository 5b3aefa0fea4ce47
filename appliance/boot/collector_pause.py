"""The cyclic garbage collector, paused while `inferno serve` starts (docs/ARCHITECTURE.md,
"Start-up"; W5 in docs/BENCHMARKS.md).

A start allocates most of what the process will ever hold: the modules of torch, Triton and the app,
the model's and the engine's objects. CPython's collector runs a full (generation 2) collection each
time the objects that survived the younger ones grow by a quarter, and a full collection visits
every object alive: a start runs 6-7 of them before its first token, each longer than the last
(0.36-0.48 s in all on the 2-CPU development machine, in a W5 of 2.6-2.8 s), and finds almost
nothing, since what a start makes, it keeps. Without them, W5 there is 0.7-0.8 s shorter
(docs/BENCHMARKS.md, "W5's garbage collections"); on the H100's host it did not move
(7.3-7.8 s either way, "Issue 17, round 4").

So the collector is paused from the start of `inferno serve` until the server is ready
(`boot.ready` recorded, the engine serving); then everything alive is frozen (`gc.freeze()`,
CPython's gc documentation: moved to a permanent generation that no collection visits again)
and the collector runs again, for what requests allocate, over a heap without the start's
objects: a later full collection took 163-237 ms over them on the CPU machine, under 0.01 ms
once they were frozen, a stall (the GIL held) that requests and the engine's steps no longer
meet. This is the pattern Instagram's servers follow (disable at start, freeze once the
long-lived state is built).

Memory. Reference counting never pauses: an object is freed when its last reference goes,
frozen or not. Only objects in reference cycles wait for a collection, and a cycle that is
garbage when it is frozen is never freed. What a start leaves in cycles, measured at ready on
the CPU machine: about 7,000 objects, 0.8 MB (the frames and tracebacks of imports that fail on
purpose, closures, typing aliases), no tensor, nothing holding the data key. A collection
before the freeze would free that 0.8 MB for 0.2 s on the path to the first token, so there is
none. The start's large buffers (the staging ring's pinned slots, the decrypted images of the
weight files, the objects holding the data key) are freed by reference counting alone when the
load returns (tests/appliance/engine/models/test_sealed_images.py,
tests/appliance/boot/test_sealed_weights.py); that is what makes the freeze safe, and what a
change to the load must keep.

Secrets. The data key is `bytes`, which cannot be zeroed: it lives until its last reference
goes (the load's frames, `SealedImages`, `ChunkReader`), which the freeze does not change;
only a cycle holding it at the freeze would keep it, and the tests above hold that none does.

A start that stops (a refused verdict or key release, a bad sealed file, an unexpected error)
leaves the process up and not ready, saying why on /health: the collector runs again at once,
nothing is frozen, and one full collection frees now whatever the failed start left in cycles
(an exception's frames holding partly loaded weights, say). Nothing is served then, so its cost
(0.2 s on the CPU machine) is on no path. What can stop later (a failed re-attestation, an
engine that fails) comes after ready, with the collector running already.
"""

from __future__ import annotations

import gc
from types import TracebackType


class CollectorPause:
    """The collector paused by `begin` until `ready` or `stopped`, or the end of a `with` block
    around the whole start (a start that never reached the server: the process is ending). A
    collector that was not running at `begin` is left alone throughout."""

    def __init__(self, paused: bool) -> None:
        self._paused = paused  # whether this pause stopped a running collector, until resumed

    @classmethod
    def begin(cls) -> CollectorPause:
        pause = cls(gc.isenabled())
        gc.disable()
        return pause

    def ready(self) -> None:
        """The server is ready: freeze everything alive (the start's state), then let the
        collector run."""
        if self._paused:
            gc.freeze()
            self._resume()

    def stopped(self) -> None:
        """The start stopped and the process goes on: let the collector run, and collect once
        what the start left in cycles (the module docstring)."""
        if self._paused:
            self._resume()
            gc.collect()

    def __enter__(self) -> CollectorPause:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._resume()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            gc.enable()
