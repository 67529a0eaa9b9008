"""The capture worker: one child process per gateway process that assembles large answers (ids,
logprobs, message) off the gateway's event loop.

A plain child started with `python -c`, not a multiprocessing pool: spawn and forkserver
children (and the forkserver itself) import the parent's `__main__` again, which re-runs a user
script that calls `run_rollout` at top level without an `if __name__ == "__main__":` guard.
This child loads only this file and `capture.py` (msgspec and the standard library), by path
and under their package names, so it starts fast and what it pickles the parent unpickles as its
own classes: it never imports the `pi_env` package, whose `__init__` pulls in pydantic and aiohttp.

Frames on its stdin/stdout: a 4-byte big-endian length, then a pickle (our own child, our own
bytes: nothing untrusted is unpickled).
"""

from __future__ import annotations

import atexit
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

    def assemble(self, raw: bytes, streaming: bool) -> TurnCapture:
        """Blocking: call it from a thread (the gateway uses its loop's executor)."""
        with self._lock:
            try:
                process = self._ensure_started()
                _write_frame(process.stdin, pickle.dumps((raw, streaming), protocol=pickle.HIGHEST_PROTOCOL))
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
        self._process = subprocess.Popen([sys.executable, "-P", "-c", _CHILD, __file__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, close_fds=True)
        self._child_cpu_s = 0.0
        return self._process

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
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
    """The child's loop: assemble each framed (raw, streaming) until end of input."""
    assemble_answer = _load_alone("pi_env.proxy.capture", str(Path(__file__).with_name("capture.py"))).assemble_answer
    source, sink = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    while True:
        try:
            raw, streaming = pickle.loads(_read_frame(source))
        except EOFError:
            return
        try:
            reply = (True, assemble_answer(raw, streaming))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which parses inline
            reply = (False, f"{type(error).__name__}: {error}")
        _write_frame(sink, pickle.dumps((*reply, time.process_time()), protocol=pickle.HIGHEST_PROTOCOL))


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


_worker: CaptureWorker | None = None
_worker_lock = threading.Lock()


def capture_worker() -> CaptureWorker:
    """The process's one worker (its child starts on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = CaptureWorker()
            atexit.register(_worker.close)
        return _worker
