"""What the benchmarks share (each bench is run as `python bench/NAME.py`, so this directory is
on the path)."""

from __future__ import annotations


class BoundedTurns(list):
    """Stands in for a gateway session's `turns`, keeping only the last few records: a long
    benchmark measures latency and throughput, not history, and must not grow without bound."""

    def append(self, item) -> None:
        super().append(item)
        if len(self) > 8:
            del self[0]
