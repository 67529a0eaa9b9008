"""A host-dir sandbox's commands as host processes: their output drained and bounded, the
limits they run under.

LocalProcess is one running command: a thread writes its stdin and drains its stdout and stderr
into tail buffers (_TailBuffer: the last EXEC_OUTPUT_LIMIT_BYTES, or the caller's limit), so a
command never blocks on a full pipe and one printing gigabytes costs no memory; the backend
says how it is killed. Background commands are spawned from one long-lived thread (_spawner,
see there why). sandbox_rlimits is the RLIMIT_* a sandbox's commands get, shell() the shell
they run in. HostDirSandbox (hostdir.py) launches and tracks them; remote.py keeps a remote
command's output in the same tail buffers.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import resource
import selectors
import subprocess
import threading
import time
from collections.abc import Callable

from pi_env.sandbox.base import ExecResult, SandboxLimits

EXEC_OUTPUT_LIMIT_BYTES = 1 << 20  # per stream; exec() keeps the tail
DRAIN_AFTER_KILL_S = 2.0  # output still buffered in pipes after a kill


@functools.cache
def shell() -> str:
    return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


def sandbox_rlimits(limits: SandboxLimits, exclusive_uid: bool) -> dict[int, int]:
    """resource.RLIMIT_* -> the value (soft and hard) a sandbox gets."""
    wanted = {
        resource.RLIMIT_NPROC: limits.max_processes,
        resource.RLIMIT_FSIZE: limits.max_file_bytes,
        resource.RLIMIT_NOFILE: limits.max_open_files,
        resource.RLIMIT_CORE: 0,
    }
    if limits.max_memory_bytes is not None:
        wanted[resource.RLIMIT_DATA] = limits.max_memory_bytes
    if not exclusive_uid:  # the limit counts every process of our uid, not just the sandbox's
        if os.path.isdir("/proc"):
            wanted[resource.RLIMIT_NPROC] += len(_processes_of(os.getuid()))
        else:  # cannot count them: better no limit than one already reached
            del wanted[resource.RLIMIT_NPROC]
    for res, value in wanted.items():
        _, hard = resource.getrlimit(res)  # a limit can only be lowered without privileges
        if hard != resource.RLIM_INFINITY:
            wanted[res] = min(value, hard)
    return wanted


def _processes_of(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except FileNotFoundError:
                pass
    return pids


class _TailBuffer:
    """The last `limit` bytes of a stream, so a command printing gigabytes costs no memory."""

    def __init__(self, limit: int):
        self.limit = limit
        self._data = bytearray()
        self._dropped = 0

    def append(self, chunk: bytes) -> None:
        self._data += chunk
        excess = len(self._data) - self.limit
        if excess > self.limit:  # trim in big steps: amortised O(1) per byte
            del self._data[:excess]
            self._dropped += excess

    def text(self) -> str:
        data = bytes(self._data)
        excess = max(0, len(data) - self.limit)
        tail = data[excess:].decode("utf-8", errors="replace")
        dropped = self._dropped + excess
        return f"[... {dropped} bytes truncated ...]\n{tail}" if dropped else tail


def _pump(stdin_fd: int | None, stdin_data: bytes, readers: dict[int, _TailBuffer]) -> None:
    """Write stdin_data to stdin_fd and drain the output fds until they all reach EOF; closes
    every fd it was given."""
    pending = memoryview(stdin_data)
    with selectors.DefaultSelector() as selector:
        for fd in readers:
            selector.register(fd, selectors.EVENT_READ)
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        while readers:
            for key, _ in selector.select():
                if key.fd in readers:
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        readers[key.fd].append(chunk)
                    else:
                        selector.unregister(key.fd)
                        os.close(key.fd)
                        del readers[key.fd]
                    continue
                try:
                    pending = pending[os.write(key.fd, pending[: 1 << 16]) :]
                except BrokenPipeError:  # the command does not read its stdin: fine
                    pending = pending[:0]
                if not pending:
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    stdin_fd = None
    if stdin_fd is not None:  # the outputs closed before the command read all its input
        os.close(stdin_fd)


class LocalProcess:
    """A command running in a sandbox. A thread drains its output into bounded tail buffers,
    so it never blocks on a full pipe."""

    def __init__(
        self,
        popen: subprocess.Popen,
        terminate: Callable[[subprocess.Popen], None],
        stdin_fd: int | None,
        stdin_data: bytes,
        stdout_fd: int,
        stderr_fd: int,
        output_limit: int,
    ):
        """Takes over the parent's ends of the pipes: stdin_fd (None: no data to send) and the
        two output fds."""
        self._popen = popen
        self._terminate = terminate
        self._started = time.monotonic()
        self._stdout = _TailBuffer(output_limit)
        self._stderr = _TailBuffer(output_limit)
        self._killed = False
        self._kill_lock = threading.Lock()
        self._wait_lock = threading.Lock()
        self._result: ExecResult | None = None
        self._drain = threading.Thread(
            target=_pump,
            args=(stdin_fd, stdin_data, {stdout_fd: self._stdout, stderr_fd: self._stderr}),
            name=f"pi-env-sandbox-output-{popen.pid}",
            daemon=True,
        )
        self._drain.start()

    def poll(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        with self._kill_lock:
            if self._popen.poll() is None:
                self._killed = True
                self._terminate(self._popen)

    def wait(self, timeout_s: float | None = None) -> ExecResult:
        with self._wait_lock:  # later calls return the first result
            if self._result is None:
                self._result = self._wait(timeout_s)
            return self._result

    def _wait(self, timeout_s: float | None) -> ExecResult:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        timed_out = not self._finished_by(deadline)
        if timed_out:
            self.kill()
        self._drain.join(DRAIN_AFTER_KILL_S)
        self._popen.wait()
        return ExecResult(
            exit_code=None if self._killed else self._popen.returncode,
            stdout=self._stdout.text(),
            stderr=self._stderr.text(),
            duration_s=time.monotonic() - self._started,
            timed_out=timed_out,
        )

    def _finished_by(self, deadline: float | None) -> bool:
        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        self._drain.join(remaining())
        if self._drain.is_alive():
            return False
        try:
            self._popen.wait(remaining())
        except subprocess.TimeoutExpired:
            return False
        return True


# Background commands are spawned from one long-lived thread: a parent-death signal (bwrap's
# --die-with-parent) comes when the spawning *thread* exits, so start() called from a
# short-lived thread would otherwise kill its command moments later.
_spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pi-env-sandbox-spawner")
