"""A rollout's clock and its live events: `PhaseClock`.

`PiSession` (pi_env.rollout.session) names its phases (pi_env.rollout.phases) (runtime, sandbox_create, setup, agent_start, agent,
verify, keep_workdir, collect); the clock times each into `result.timings` (a phase entered
more than once, as verify is in a multi-step task, adds up) and tells the caller's `on_event`
listener of its start and end (`RolloutEvent`), as it does of each model call and of the end.
Every event carries the time since the session began. The listener is the caller's: whatever
it raises is logged, never the rollout's failure. Kept apart from the lifecycle so that the
session says what it does, not how it is timed and reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..results import EventKind, RolloutEvent

log = logging.getLogger(__name__)


class PhaseClock:
    """Started with the session: `phase(name)` times a phase into `timings` and reports it,
    `emit` reports anything else, `elapsed()` is the time since the start."""

    def __init__(self, timings: dict[str, float], on_event: Callable[[RolloutEvent], None] | None):
        self.started = time.monotonic()
        self.timings = timings  # the result's: the clock adds to it
        self.on_event = on_event

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 4)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        self.emit("phase_start", phase=name)
        try:
            yield
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.monotonic() - start, 4)
            self.emit("phase_end", phase=name)

    def emit(self, kind: EventKind, **fields) -> None:
        """Tell the listener (if any) of `kind`, on the calling thread."""
        if self.on_event is None:
            return
        try:
            self.on_event(RolloutEvent(kind=kind, elapsed_s=self.elapsed(), **fields))
        except Exception:
            log.exception("on_event listener failed on %s", kind)
