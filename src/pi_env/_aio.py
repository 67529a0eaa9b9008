"""One process-wide asyncio event loop, running in a daemon thread.

The gateway and the scripted test server are asyncio servers, but pi-env's public API is
synchronous (and is called from many threads at once). Every server runs on this one loop, so a
single thread multiplexes all sessions, and sync callers hand it coroutines with `run_sync`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def background_loop() -> asyncio.AbstractEventLoop:
    """The shared loop, started on first use (thread-safe)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():  # set together
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="pi-env-event-loop", daemon=True)
            thread.start()
            _loop, _thread = loop, thread
        return _loop


def run_sync(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run `coro` on the background loop and wait for its result from synchronous code.

    On timeout the coroutine is cancelled and TimeoutError raised. Calling this from the loop's
    own thread would deadlock, so it raises RuntimeError instead.
    """
    loop = background_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("run_sync() called from the pi-env event loop thread; await instead")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"coroutine did not finish within {timeout} s") from None
