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

Each worker shares an in-memory file with its parent (a memfd): the answer's bytes, as the relay
kept them (a list of pieces, never joined), go into it in one gathered write, and the pickle of
the assembled capture comes back through it (our own child, our own bytes: nothing untrusted is
unpickled). The pipes carry only the headers that say so. A pipe would move the same bytes at
about five times the CPU on each side (pages allocated and freed per write, the reader woken
per page run); it still carries an answer or a reply past SHARED_MAX_BYTES, and everything where
there is no memfd (not Linux). Both pipes are driven by the caller's event loop (non-blocking,
readiness callbacks): no thread, no hand-off between threads.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pi_env.errors import InfraError

if TYPE_CHECKING:
    from pi_env.proxy.capture import TurnCapture

_REQUEST = struct.Struct(">I??")  # answer length, streamed, in the shared file (else it follows)
_REPLY = struct.Struct(">I?")  # pickle length, in the shared file (else it follows)
SHARED_MAX_BYTES = 64 << 20  # larger answers and replies go through the pipe
SHARED_KEEP_BYTES = 8 << 20  # a shared file grown past this is emptied after the answer (pages freed)
PIPE_BYTES = 1 << 20  # Linux's default limit for an unprivileged pipe
IOV_MAX = 1024  # pieces one writev() takes (Linux's UIO_MAXIOV)
MAX_WORKERS = 8
# glibc's malloc, in the child only: an answer's few large buffers (its bytes, the joined JSON)
# come from a heap kept between answers, not from fresh mmaps (and page faults) each time.
# Ignored by other C libraries. Measured with bench/proxy_overhead.py (worker CPU per token).
CHILD_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}
COLLECT_EVERY = 256  # answers between the child's cycle collections (its garbage has no cycles)
CLOSE_WAIT_S = 5.0  # how long closing the pool waits for answers in flight (see CapturePool.close)


class CaptureWorkerError(InfraError, RuntimeError):
    """The worker could not assemble an answer (it could not start, died or raised)."""


class CaptureWorker:
    """One child process, one answer at a time (its pool hands it to one caller); the child
    starts on first use and again after it died."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._shared: int | None = None  # the memfd this child shares, when there is one
        self.assembled = 0  # answers the child assembled
        self.failures = 0  # answers it could not (the caller then parses them inline)
        self.cpu_s = 0.0  # the child's CPU seconds so far (every child this object started)
        self._child_cpu_s = 0.0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def assemble(self, pieces: Sequence[bytes | bytearray], streaming: bool) -> TurnCapture:
        """The capture of the answer whose bytes are `pieces`, in order."""
        finished = False
        try:
            if self._process is None or self._process.poll() is not None:
                # Off the loop: starting a process blocks until it has exec'd.
                await asyncio.get_running_loop().run_in_executor(None, self._start)
            assert self._process is not None and self._process.stdin is not None and self._process.stdout is not None
            length, shared = sum(map(len, pieces)), self._shared
            in_shared = shared is not None and length <= SHARED_MAX_BYTES
            if shared is not None and in_shared:
                _write_all(shared, [memoryview(piece) for piece in pieces], offset=0)
            header = _REQUEST.pack(length, streaming, in_shared)
            frame = [header] if in_shared else [header, *pieces]
            reply = await _exchange(self._process.stdin.fileno(), self._process.stdout.fileno(), frame, shared)
            ok, value, cpu_s = pickle.loads(reply)
            if self._shared is not None and max(length, len(reply)) > SHARED_KEEP_BYTES:
                os.ftruncate(self._shared, 0)  # the child is idle: free what one large answer grew
            finished = True
        except (OSError, EOFError, ValueError, pickle.UnpicklingError) as error:
            self.failures += 1
            raise CaptureWorkerError(f"capture worker failed: {type(error).__name__}: {error}") from error
        finally:
            if not finished:  # failed, or cancelled mid-exchange: its pipes are in no known state
                self._kill()
        self.cpu_s += cpu_s - self._child_cpu_s
        self._child_cpu_s = cpu_s
        if not ok:
            self.failures += 1
            raise CaptureWorkerError(f"capture worker raised: {value}")
        self.assembled += 1
        return value

    def _start(self) -> None:
        self.close()
        shared = _shared_file()
        # -P: the working directory is not put on sys.path (a user's struct.py must not shadow ours)
        try:
            process = subprocess.Popen(
                [sys.executable, "-P", "-c", _CHILD, __file__, "-" if shared is None else str(shared)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
                pass_fds=() if shared is None else (shared,),
                env={**os.environ, **CHILD_MALLOC},
            )
        except BaseException:
            if shared is not None:
                os.close(shared)
            raise
        for pipe in (process.stdin, process.stdout):
            assert pipe is not None  # stdin and stdout are PIPE
            try:  # a large answer goes across in one write, not in 64 KB turns of both processes
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # the default size works, only with more turns
            os.set_blocking(pipe.fileno(), False)
        self._process, self._shared, self._child_cpu_s = process, shared, 0.0

    def _kill(self) -> None:
        process, self._process = self._process, None
        self._close_shared()
        if process is not None:
            process.kill()  # at once: a graceful close could hold the loop while the child finishes
            process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()

    def stop_child(self) -> None:
        """Kill the child and leave the rest to the caller mid-answer, which then reads EOF and
        closes this worker's pipes and file on its own thread (see CapturePool.close)."""
        process = self._process
        if process is not None:
            process.kill()

    def close(self) -> None:
        process, self._process = self._process, None
        self._close_shared()
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

    def _close_shared(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            os.close(shared)


def _shared_file() -> int | None:
    """A new in-memory file to share with one child (close-on-exec: only that child gets it, by
    pass_fds), or None where there is none (not Linux): then the pipes carry everything."""
    try:
        return os.memfd_create("pi-env-capture", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None


async def _exchange(write_fd: int, read_fd: int, pieces: list, shared: int | None = None) -> bytes:
    """Write `pieces` to `write_fd` and read one reply from `read_fd`, both non-blocking pipes,
    through the running loop's readiness callbacks. The reply's header says where its bytes
    are: after it on the pipe, or in the `shared` file."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[bytes] = loop.create_future()
    unsent = [memoryview(piece) for piece in pieces]
    received = bytearray()

    def send() -> None:
        try:
            _write_all(write_fd, unsent)
        except BlockingIOError:  # the pipe is full: the child is reading, go on when it has room
            loop.add_writer(write_fd, send)
            return
        except OSError as error:
            if not reply.done():
                reply.set_exception(error)
        loop.remove_writer(write_fd)

    def receive() -> None:
        try:
            data = os.read(read_fd, PIPE_BYTES)
        except BlockingIOError:
            return
        except OSError as error:
            if not reply.done():
                reply.set_exception(error)
            return
        if not data:
            if not reply.done():
                reply.set_exception(EOFError("the capture worker's pipe closed" + (" mid-frame" if received else "")))
            return
        received.extend(data)
        if len(received) < _REPLY.size or reply.done():
            return
        length, in_shared = _REPLY.unpack_from(received)
        if in_shared:
            if shared is None:
                reply.set_exception(ValueError("the capture worker answered in a shared file it was not given"))
                return
            try:
                data = os.pread(shared, length, 0)
            except OSError as error:  # raised here, it would be lost in the loop's log and the caller hang
                reply.set_exception(error)
                return
            if len(data) < length:
                reply.set_exception(EOFError(f"the capture worker's shared file holds {len(data)} of {length} bytes"))
            else:
                reply.set_result(data)
        elif len(received) >= _REPLY.size + length:
            reply.set_result(bytes(received[_REPLY.size : _REPLY.size + length]))

    loop.add_reader(read_fd, receive)
    try:
        send()
        return await reply
    finally:
        loop.remove_reader(read_fd)
        loop.remove_writer(write_fd)


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
    shared = None if sys.argv[2] == "-" else int(sys.argv[2])  # the memfd the parent passed, if any
    source, sink = sys.stdin.buffer, os.dup(sys.stdout.fileno())
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    # An answer decodes into thousands of lists, each an allocation the cyclic collector counts:
    # it would run many times per answer over objects that are freed by reference counting
    # anyway (a quarter of the child's CPU). It runs between answers instead, now and then.
    gc.freeze()
    gc.disable()
    # Batch scheduling: the same CPU share as any process, but a wake-up of this worker does not
    # preempt a running one. Its work is never urgent (a record may complete milliseconds later),
    # while the engine, the agent and the gateway's loop are: at one stream with the engine's
    # cores full, transparent_proxy's throughput rose ~7 % side by side (bench/proxy_overhead.py).
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        pass
    answers = 0
    while True:
        header = source.read(_REQUEST.size)
        if len(header) < _REQUEST.size:
            return
        length, streaming, in_shared = _REQUEST.unpack(header)
        if not in_shared:
            raw = source.read(length)
        elif shared is not None:
            raw = os.pread(shared, length, 0)
        else:
            return  # a frame this child cannot read: exit, the parent parses inline
        if len(raw) < length:
            return
        try:
            reply = (True, assemble_answer(raw, streaming))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which parses inline
            reply = (False, f"{type(error).__name__}: {error}")
        _write_reply(sink, shared, pickle.dumps((*reply, time.process_time()), protocol=pickle.HIGHEST_PROTOCOL))
        answers += 1
        if answers % COLLECT_EVERY == 0:
            gc.collect()


def _write_reply(sink: int, shared: int | None, data: bytes) -> None:
    """The reply into the shared file and its header on the pipe; or, without one (or past
    SHARED_MAX_BYTES), header and data on the pipe in one write (the parent wakes once)."""
    if shared is not None and len(data) <= SHARED_MAX_BYTES:
        _write_all(shared, [memoryview(data)], offset=0)
        _write_all(sink, [memoryview(_REPLY.pack(len(data), True))])
    else:
        _write_all(sink, [memoryview(_REPLY.pack(len(data), False)), memoryview(data)])


def _write_all(fd: int, unsent: list[memoryview], offset: int | None = None) -> None:
    """Write `unsent` to `fd` in gathered writes, dropping what went out from the list: on a
    non-blocking fd a full pipe raises BlockingIOError with the rest left in `unsent`. With an
    `offset`, into a file from there on (pwritev)."""
    while unsent:
        if offset is None:
            sent = os.writev(fd, unsent[:IOV_MAX])
        else:
            sent = os.pwritev(fd, unsent[:IOV_MAX], offset)
            offset += sent
        while unsent and sent >= len(unsent[0]):
            sent -= len(unsent.pop(0))
        if sent:
            unsent[0] = unsent[0][sent:]


class CapturePoolClosed(CaptureWorkerError):
    """The pool was closed (the process is exiting): the caller parses inline."""


class CapturePool:
    """Up to `size` workers. An answer goes to an idle worker; a new one starts only when every
    started one is busy, and a caller waits when all `size` are. Callers may be on several event
    loops (threads): the bookkeeping is under a lock, a worker is handed to a waiter on its loop."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a capture pool needs at least one worker, got {size}")
        self.size = size
        self.workers: list[CaptureWorker] = []
        self._idle: list[CaptureWorker] = []
        self._waiting: collections.deque[asyncio.Future[CaptureWorker]] = collections.deque()
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # a worker came back to the idle list
        self._closed = False
        self._pid = os.getpid()  # a forked copy must not stop the parent's workers

    async def assemble(self, pieces: Sequence[bytes | bytearray], streaming: bool) -> TurnCapture:
        """As CaptureWorker.assemble, on the first worker free."""
        worker = await self._take()
        try:
            return await worker.assemble(pieces, streaming)
        finally:
            self._give_back(worker)

    async def _take(self) -> CaptureWorker:
        with self._lock:
            if self._closed:
                raise CapturePoolClosed("the capture pool is closed")
            if self._idle:
                return self._idle.pop()
            if len(self.workers) < self.size:
                worker = CaptureWorker()
                self.workers.append(worker)
                return worker
            waiter: asyncio.Future[CaptureWorker] = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a worker just as it was cancelled
                self._give_back(waiter.result())
            raise

    def _give_back(self, worker: CaptureWorker) -> None:
        with self._lock:
            while self._waiting:  # empty once closed: close() takes them and _take() adds no more
                waiter = self._waiting.popleft()
                if not waiter.done():
                    waiter.get_loop().call_soon_threadsafe(self._hand, waiter, worker)
                    return
            self._idle.append(worker)
            self._returned.notify_all()

    def _hand(self, waiter: asyncio.Future[CaptureWorker], worker: CaptureWorker) -> None:
        if waiter.done():  # cancelled meanwhile: the next waiter (or the idle list) gets it
            self._give_back(worker)
        else:
            waiter.set_result(worker)

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

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop every worker; later answers get CapturePoolClosed (and are parsed inline). It runs
        at exit while other threads' loops may be mid-answer: those answers are waited for (up to
        `wait_s`; not at all from a thread running a loop, which would hold its own answers back).
        A worker busy past that has its child killed, so its caller's exchange ends (EOF: parsed
        inline) and that caller closes the worker's files: closing them here could hand their
        numbers to another file while the caller still writes to them."""
        if self._pid != os.getpid():
            return
        try:
            asyncio.get_running_loop()
            wait_s = 0.0
        except RuntimeError:
            pass
        deadline = time.monotonic() + wait_s
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        for waiter in waiting:  # callers queued for a worker: told at once, not after the wait
            try:
                waiter.get_loop().call_soon_threadsafe(_fail, waiter)
            except RuntimeError:  # its loop is closed: nobody awaits it any more
                pass
        with self._lock:
            while len(self._idle) < len(self.workers) and (left := deadline - time.monotonic()) > 0:
                self._returned.wait(left)
            idle, busy = list(self._idle), [worker for worker in self.workers if worker not in self._idle]
        for worker in idle:
            worker.close()
        for worker in busy:
            worker.stop_child()


def _fail(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(CapturePoolClosed("the capture pool is closed"))


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
_pool_pid = 0
_pool_lock = threading.Lock()


def capture_pool() -> CapturePool:
    """The process's pool (its workers start on first use). A forked child gets a pool of its
    own: the parent's workers' pipes are the parent's."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = CapturePool(pool_size()), os.getpid()
            atexit.register(_pool.close)
        return _pool
