"""Several replicas, one endpoint (docs/async-rl.md, "Several replicas"): the live state of an
endpoint given as several base URLs, shared by every gateway session that uses it.

- A session is assigned a replica at its first call, the least loaded among the healthy ones
  (fewest sessions stuck to it, then fewest calls in flight, then the first listed), and stays on
  it: its prefix cache is there.
- A call whose replica fails before the first byte of an answer (`FAILOVER_STATUSES`, or no
  answer at all: refused, reset, a timeout) is re-sent, byte-identical, to another replica, each
  replica at most once per call; the session then sticks to the one that answered. After the
  first byte nothing is re-sent: the turn fails as with one URL.
- A replica that failed is in back-off (`BACKOFF_S`, doubling with each failure in a row, at most
  `MAX_BACKOFF_S`; a 429's Retry-After when longer) and is tried again on next use once it is
  over; while every replica is in back-off a call still tries them all (the session's own first,
  then the one back soonest), so a call is never refused untried.

State changes come from the gateway's loop (calls) and other threads (sessions closed, the
health read by /endpoints), under one lock per set: a few integer updates per call, none per
chunk. An endpoint with one base URL has no `ReplicaSet` at all (its calls take the path they
always took). Only `host` (host:port) is ever shown: a base URL may carry user:password.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from yarl import URL

# Statuses a proxy or load balancer in front of an engine (or an overloaded engine) answers for
# a replica that cannot take the call, none of them about the request: 502 (bad gateway: the
# engine behind it is gone), 503 (unavailable: starting, draining, dead engine), 504 (gateway
# timeout), 429 (this replica's queue is full; another's may not be). Never a 4xx about the
# request (400, 401, 404, 413, ...: every replica would answer the same), nor a 500 (an engine's
# error on this request: re-sending it would only repeat it, possibly crashing each replica).
FAILOVER_STATUSES = frozenset({429, 502, 503, 504})
BACKOFF_S = 2.0  # a failed replica is skipped this long after its first failure in a row
MAX_BACKOFF_S = 60.0  # ...doubling with each further one, up to this


def public_host(base_url: str) -> str:
    """host:port of a base URL, never its user:password."""
    url = URL(base_url)
    return f"{url.host}:{url.port}"


@dataclass
class Replica:
    """One base URL of an endpoint and what the gateway saw of it (guarded by its set's lock)."""

    index: int
    base_url: str = field(repr=False)  # may hold user:password: never shown
    host: str = ""  # host:port: what records, /endpoints and errors show
    sessions: int = 0  # sessions stuck to it now
    in_flight: int = 0  # calls sent to it and not yet over
    calls: int = 0  # calls sent to it, failed ones included
    failures: int = 0  # calls it failed (before or after their first byte)
    failures_in_a_row: int = 0
    last_error: str | None = None  # the kind: "refused", "reset", "timeout", "http_503", "stream_broken", ...
    down_until: float = 0.0  # monotonic; in back-off until then
    down_until_wall: float | None = None  # the same, as unix time (shown)

    def __post_init__(self):
        self.host = self.host or public_host(self.base_url)


class ReplicaSet:
    """The replicas of one endpoint (see the module docstring)."""

    def __init__(self, base_urls: tuple[str, ...] | list[str]):
        if len(base_urls) < 2:
            raise ValueError("a ReplicaSet has several base URLs; one URL needs none")
        self.replicas = [Replica(index, url) for index, url in enumerate(base_urls)]
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ReplicaSet({[r.host for r in self.replicas]})"

    # -- routing (on the gateway's loop)

    def route(self, current: Replica | None, tried: set[int]) -> Replica | None:
        """Where a session's call goes next: its own replica while it is healthy, else the least
        loaded healthy one not yet tried for this call, else (all in back-off) its own, then the
        one back soonest; None once every replica was tried."""
        now = time.monotonic()
        with self._lock:
            untried = [r for r in self.replicas if r.index not in tried]
            if not untried:
                return None
            if current is not None and current.index not in tried and current.down_until <= now:
                return current
            healthy = [r for r in untried if r.down_until <= now]
            if healthy:
                return min(healthy, key=lambda r: (r.sessions, r.in_flight, r.index))
            if current is not None and current.index not in tried:
                return current
            return min(untried, key=lambda r: (r.down_until, r.index))

    def stick(self, session: Any, new: Replica) -> None:
        """`session` (its `replica` and `closed`) now sticks to `new`: its first call, or a
        failover. A session already closed is counted nowhere."""
        with self._lock:
            if not session.closed:
                if session.replica is not None:
                    session.replica.sessions -= 1
                new.sessions += 1
            session.replica = new

    def leave(self, session: Any) -> None:
        """`session` closed (before setting `closed`, once): it no longer counts on its replica."""
        with self._lock:
            if session.replica is not None and not session.closed:
                session.replica.sessions -= 1
            session.closed = True

    def begin(self, replica: Replica) -> None:
        with self._lock:
            replica.calls += 1
            replica.in_flight += 1

    def end(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1

    def answered(self, replica: Replica) -> None:
        """The replica began an answer: healthy again, its back-off reset."""
        if replica.failures_in_a_row or replica.down_until:  # read without the lock: a hint
            with self._lock:
                replica.failures_in_a_row = 0
                replica.down_until, replica.down_until_wall = 0.0, None

    def failed(self, replica: Replica, kind: str, retry_after_s: float | None = None) -> None:
        """The replica failed a call (`kind`): in back-off from now."""
        with self._lock:
            replica.failures += 1
            replica.failures_in_a_row += 1
            replica.last_error = kind
            backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (replica.failures_in_a_row - 1))
            if retry_after_s is not None:
                backoff = max(backoff, min(retry_after_s, MAX_BACKOFF_S))
            replica.down_until = time.monotonic() + backoff
            replica.down_until_wall = time.time() + backoff

    # -- what is shown (any thread)

    def health(self) -> list[dict[str, Any]]:
        """Each replica's health: host (never credentials), healthy, sessions, calls in flight,
        calls, failures, the last error's kind, and until when it is in back-off (unix time)."""
        now = time.monotonic()
        with self._lock:
            return [
                {
                    "replica": r.host,
                    "healthy": r.down_until <= now,
                    "sessions": r.sessions,
                    "in_flight": r.in_flight,
                    "calls": r.calls,
                    "failures": r.failures,
                    "last_error": r.last_error,
                    "unhealthy_until": r.down_until_wall if r.down_until > now else None,
                }
                for r in self.replicas
            ]


def failure_kind(exc: BaseException) -> str:
    """What kind of failure an exception from sending a request is (shown, never its text)."""
    import aiohttp

    if isinstance(exc, aiohttp.ClientConnectorError):
        return "refused" if isinstance(exc.os_error, ConnectionRefusedError) else "unreachable"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect_timeout"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, ConnectionResetError, aiohttp.ClientOSError)):
        return "reset"
    return "unreachable"


def retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (its date form is not honoured: None)."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
