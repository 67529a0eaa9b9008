"""One limit on concurrent rollouts, shared by every door into the server (MCP over HTTP,
OpenEnv's JSON-RPC and /ws, the web UI).

Policy: at most `max_running` rollouts run; up to `max_waiting` more wait in a FIFO queue; a
call beyond that gets `ServerBusy` at once, never an unbounded wait. A waiter that is cancelled
(its client went away) leaves the queue.

Thread-safe and event-loop-agnostic (OpenEnv runs some tool calls on other loops): the counts
live under a lock and waiters poll every 20 ms, which costs nothing next to a rollout.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import deque
from contextlib import asynccontextmanager

from ..errors import InfraError


class ServerBusy(InfraError, RuntimeError):
    """Every rollout slot and queue place is taken: retry later."""


class RolloutLimiter:
    POLL_S = 0.02

    def __init__(self, max_running: int, max_waiting: int):
        if max_running < 1 or max_waiting < 0:
            raise ValueError(
                f"MAX_CONCURRENT_ENVS must be >= 1 and the queue >= 0 (got {max_running} and {max_waiting})"
            )
        self.max_running, self.max_waiting = max_running, max_waiting
        self.running = 0
        self._queue: deque[int] = deque()
        self._tickets = itertools.count()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "running": self.running,
                "waiting": len(self._queue),
                "max_running": self.max_running,
                "max_waiting": self.max_waiting,
            }

    @asynccontextmanager
    async def slot(self, on_queued=None, gone: threading.Event | None = None):
        """Hold one rollout slot for the body. `on_queued(position)` is called when the call
        has to wait (position 1 = next). A waiter whose `gone` is set (its client hung up)
        leaves the queue: asyncio.CancelledError."""
        await self._acquire(on_queued, gone)
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1

    async def _acquire(self, on_queued, gone: threading.Event | None) -> None:
        with self._lock:
            if self.running < self.max_running and not self._queue:
                self.running += 1
                return
            if len(self._queue) >= self.max_waiting:
                raise ServerBusy(
                    f"busy: {self.running} rollouts running (MAX_CONCURRENT_ENVS={self.max_running}) "
                    f"and {len(self._queue)} waiting (PI_ENV_MAX_QUEUE={self.max_waiting}); "
                    "retry later"
                )
            ticket = next(self._tickets)
            self._queue.append(ticket)
            position = len(self._queue)
        if on_queued is not None:
            on_queued(position)
        try:
            while True:
                await asyncio.sleep(self.POLL_S)
                if gone is not None and gone.is_set():
                    raise asyncio.CancelledError("the client went away while queued")
                with self._lock:
                    if self._queue[0] == ticket and self.running < self.max_running:
                        self._queue.popleft()
                        self.running += 1
                        return
        except BaseException:
            with self._lock:
                if ticket in self._queue:
                    self._queue.remove(ticket)
            raise


DEFAULT_IDLE_TIMEOUT_S = 300.0


def idle_timeout_s() -> float:
    """PI_ENV_IDLE_TIMEOUT_S (default 300): how long a session may sit idle before it is closed."""
    try:
        value = float(os.environ.get("PI_ENV_IDLE_TIMEOUT_S") or DEFAULT_IDLE_TIMEOUT_S)
    except ValueError:
        raise ValueError("PI_ENV_IDLE_TIMEOUT_S must be a number of seconds") from None
    if not value > 0:
        raise ValueError("PI_ENV_IDLE_TIMEOUT_S must be more than 0 seconds")
    return value
