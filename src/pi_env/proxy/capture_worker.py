"""The capture workers: child processes that assemble large answers (ids, logprobs, message)
off the gateway's event loop, a pool of them per gateway process so that capture is not bound to
one core (`PI_ENV_CAPTURE_WORKERS`, default: the CPUs this process may use, at most 8). A
worker starts only when every started one is busy: a gateway at one stream runs one.

A plain child started with `python -c`, not a multiprocessing pool: spawn and forkserver
children (and the forkserver itself) import the parent's `__main__` again, which re-runs a user
script that calls `run_rollout` at top level without an `if __name__ == "__main__":` guard.
This child loads only this file and `capture.py` (msgspec and the standard library), by path
and under their package names, so it starts fast and what it pickles the parent unpickles as its
own classes: it never imports the `pi_env` package, whose `__init__` pulls in pydantic and aiohttp.

To the worker goes the answer's bytes as they are, behind a 5-byte header (length, streamed),
through a pipe enlarged to hold a large answer at once; back comes a 4-byte length and a pickle of
the assembled capture (our own child, our own bytes: nothing untrusted is unpickled).
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import importlib.util
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pi_env.proxy.capture import TurnCapture

_LENGTH = struct.Struct(">I")
_REQUEST = struct.Struct(">I?")  # answer length, streamed
PIPE_BYTES = 1 << 20  # Linux's default limit for an unprivileged pipe
MAX_WORKERS = 8
# glibc's malloc, in the child only: an answer's few large buffers (its bytes, the joined JSON)
# come from a heap kept between answers, not from fresh mmaps (and page faults) each time.
# Ignored by other C libraries. Measured with bench/proxy_overhead.py (worker CPU per token).
CHILD_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}
COLLECT_EVERY = 256  # answers between the child's cycle collections (its garbage has no cycles)


class CaptureWorkerError(RuntimeError):
    """The worker could not assemble an answer (it could not start, died or raised)."""


class CaptureWorker:
    """Answers are assembled one at a time (a lock), in order; the child starts on first use
    and again after it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self.assembled = 0  # answers the child assembled
        self.failures = 0  # answers it could not (the caller then parses them inline)
        self.cpu_s = 0.0  # the child's CPU seconds so far (every child this object started)
        self._child_cpu_s = 0.0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def assemble(self, raw: bytes | bytearray, streaming: bool) -> TurnCapture:
        """Blocking: call it from a thread (the gateway uses its loop's executor)."""
        with self._lock:
            try:
                process = self._ensure_started()
                assert process.stdin is not None and process.stdout is not None  # started with both pipes
                process.stdin.write(_REQUEST.pack(len(raw), streaming))
                process.stdin.write(raw)
                process.stdin.flush()
                ok, value, cpu_s = pickle.loads(_read_frame(process.stdout))
            except (OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
                self.failures += 1
                self._stop()
                raise CaptureWorkerError(f"capture worker failed: {type(error).__name__}: {error}") from error
            self.cpu_s += cpu_s - self._child_cpu_s
            self._child_cpu_s = cpu_s
            if not ok:
                self.failures += 1
                raise CaptureWorkerError(f"capture worker raised: {value}")
            self.assembled += 1
            return value

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._stop()
        # -P: the working directory is not put on sys.path (a user's struct.py must not shadow ours)
        self._process = subprocess.Popen(
            [sys.executable, "-P", "-c", _CHILD, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            env={**os.environ, **CHILD_MALLOC},
        )
        for pipe in (self._process.stdin, self._process.stdout):
            assert pipe is not None  # stdin and stdout are PIPE
            try:  # a large answer goes across in one write, not in 64 KB turns of both processes
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # the default size works, only with more turns
        self._child_cpu_s = 0.0
        return self._process

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None  # started with both pipes
        try:
            process.stdin.close()  # the child exits at end of input
            process.wait(2)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
        process.stdout.close()


def _load_alone(name: str, path: str):
    """Load one module file under its package name, without importing its packages."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path} is not a loadable module file"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The child's program: this file, loaded by path (as _load_alone does), then its serve().
_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("pi_env.proxy.capture_worker", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
module.serve()
"""


def serve() -> None:
    """The child's loop: assemble each answer until end of input."""
    assemble_answer = _load_alone("pi_env.proxy.capture", str(Path(__file__).with_name("capture.py"))).assemble_answer
    source, sink = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    # An answer decodes into thousands of lists, each an allocation the cyclic collector counts:
    # it would run many times per answer over objects that are freed by reference counting
    # anyway (a quarter of the child's CPU). It runs between answers instead, now and then.
    gc.freeze()
    gc.disable()
    answers = 0
    while True:
        header = source.read(_REQUEST.size)
        if len(header) < _REQUEST.size:
            return
        length, streaming = _REQUEST.unpack(header)
        raw = source.read(length)
        if len(raw) < length:
            return
        try:
            reply = (True, assemble_answer(raw, streaming))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which parses inline
            reply = (False, f"{type(error).__name__}: {error}")
        _write_frame(sink, pickle.dumps((*reply, time.process_time()), protocol=pickle.HIGHEST_PROTOCOL))
        answers += 1
        if answers % COLLECT_EVERY == 0:
            gc.collect()


def _write_frame(stream, data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream) -> bytes:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("the capture worker's pipe closed")
    (length,) = _LENGTH.unpack(header)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the capture worker's pipe closed mid-frame")
    return data


class CapturePool:
    """Up to `size` workers. An answer goes to an idle worker; a new one starts only when every
    started one is busy, and a caller waits when all `size` are."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a capture pool needs at least one worker, got {size}")
        self.size = size
        self.workers: list[CaptureWorker] = []
        self._idle: list[CaptureWorker] = []
        self._free = threading.Condition()

    def assemble(self, raw: bytes | bytearray, streaming: bool) -> TurnCapture:
        """Blocking, as CaptureWorker.assemble."""
        worker = self._take()
        try:
            return worker.assemble(raw, streaming)
        finally:
            with self._free:
                self._idle.append(worker)
                self._free.notify()

    def _take(self) -> CaptureWorker:
        with self._free:
            while not self._idle and len(self.workers) >= self.size:
                self._free.wait()
            if self._idle:
                return self._idle.pop()
            worker = CaptureWorker()
            self.workers.append(worker)
            return worker

    @property
    def assembled(self) -> int:
        return sum(worker.assembled for worker in self.workers)

    @property
    def failures(self) -> int:
        return sum(worker.failures for worker in self.workers)

    @property
    def cpu_s(self) -> float:
        return sum(worker.cpu_s for worker in self.workers)

    @property
    def pids(self) -> list[int]:
        return [worker.pid for worker in self.workers if worker.pid is not None]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def pool_size() -> int:
    """PI_ENV_CAPTURE_WORKERS, else the CPUs this process may run on (at most MAX_WORKERS)."""
    configured = os.environ.get("PI_ENV_CAPTURE_WORKERS", "").strip()
    if configured:
        try:
            size = int(configured)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"PI_ENV_CAPTURE_WORKERS must be a whole number >= 1, got {configured!r}")
        return size
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


_pool: CapturePool | None = None
_pool_lock = threading.Lock()


def capture_pool() -> CapturePool:
    """The process's pool (its workers start on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = CapturePool(pool_size())
            atexit.register(_pool.close)
        return _pool
