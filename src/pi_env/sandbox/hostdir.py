"""The host-directory sandbox that both local backends build on (local.py: bubblewrap;
unsafe_local.py: plain subprocesses).

A sandbox is a host dir `<root>/sb-<id>/` whose `home/` stands for the sandbox's /root (and
`home/workdir/` for its work dir). HostDirSandbox gives it
- host-side file access (write_file, read_file, exists, remove, snapshot) that reaches the home
  one path component at a time with O_NOFOLLOW, so a symlink a command planted is never
  followed on the host; writes go to a new file renamed over the target, so an existing
  symlink, FIFO or hard link is replaced rather than written through; reads open with
  O_NONBLOCK, so a FIFO cannot hang the host;
- process plumbing: commands spawned with their output drained by a thread into bounded tail
  buffers, tracked so that kill_all() and close() reach every one of them.
A subclass says how a command is spawned (_popen_args) and killed (_terminate).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import logging
import os
import posixpath
import resource
import secrets
import selectors
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pi_env.sandbox.base import (
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    ExecResult,
    Network,
    SandboxError,
    SandboxLimits,
)
from pi_env.sandbox.totals import host_totals, mount_capped_home, sweep_stale_cgroups, unmount_all

log = logging.getLogger(__name__)

EXEC_OUTPUT_LIMIT_BYTES = 1 << 20  # per stream; exec() keeps the tail
DRAIN_AFTER_KILL_S = 2.0  # output still buffered in pipes after a kill
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO the sandbox planted must not hang the host.
_FILE_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
LOCK_SUFFIX = ".lock"  # <root>/sb-<id>.lock: flocked while <root>/sb-<id>/ has a living owner
STALE_LOCK_AGE_S = 60.0  # a younger free lock may be one being created right now
UNLOCKED_DIR_AGE_S = 86400.0  # a sandbox dir without a lock file (older pi-env) is dead after this
# Host-side walks of a sandbox tree hold at most this many directories open: snapshot() does
# not look deeper; deletion moves deeper subtrees up first.
WALK_MAX_DEPTH = 64
SETUP_HOME = "setup-home"  # <host dir>/setup-home: the home as setup left it (checkpoint_home)
# The agent's home, set aside while verify runs (a multi-step task's next agent gets it back):
# a dir of the home itself, renamed into (never copied: what the agent wrote stays inside its
# disk total and off the host's disk), named so no tool looks inside.
AGENT_HOME = ".pi-env-agent-home"
WORKDIR_NAME = SANDBOX_WORKDIR[len(SANDBOX_HOME) + 1 :]


# ---------------------------------------------------------------------------------------------
# Helpers for the backends


@functools.cache
def shell() -> str:
    return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


def default_root() -> str:
    """$PI_ENV_SANDBOX_ROOT, else a directory in the temp dir (one per user but root, since
    each user must own theirs)."""
    if root := os.environ.get("PI_ENV_SANDBOX_ROOT"):
        return root
    uid = os.geteuid()
    return os.path.join(tempfile.gettempdir(), "pi-env-sandboxes" + (f"-{uid}" if uid else ""))


def make_dir(path: str, mode: int, owner: int | None = None) -> None:
    """mkdir with exactly `mode`, owned by `owner` (uid and gid) if given."""
    os.mkdir(path)
    os.chmod(path, mode)  # whatever the umask
    if owner is not None:
        os.chown(path, owner, owner)


def make_owned_dir(root: str, prefix: str) -> tuple[str, int]:
    """A new dir <root>/<prefix><random>/ (0o711) and the fd of its <dir>.lock, flocked before
    the dir exists and held while its owner lives: a dir whose lock is free belongs to nobody
    (its owner died) and may be swept (sweep_stale_host_dirs). discard_host_dir() undoes it."""
    path = os.path.join(root, prefix + secrets.token_hex(8))
    lock_fd = os.open(path + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        make_dir(path, 0o711)
    except BaseException:
        discard_host_dir(path, lock_fd)
        raise
    return path, lock_fd


def make_host_dir(root: str, owner: int | None, disk_bytes: int | None = None) -> tuple[str, int]:
    """A sandbox's <root>/sb-<id>/ (see make_owned_dir) with home/ and home/workdir/ owned by
    `owner` (None: by us). `disk_bytes`: home/ is a tmpfs of that size where the host allows it
    (sandbox/totals.py)."""
    host_dir, lock_fd = make_owned_dir(root, "sb-")
    try:
        make_dir(os.path.join(host_dir, "home"), 0o700, owner)
        if disk_bytes is not None and host_totals().disk:
            mount_capped_home(os.path.join(host_dir, "home"), disk_bytes, owner)
        make_dir(os.path.join(host_dir, "home", "workdir"), 0o755, owner)
    except BaseException:
        discard_host_dir(host_dir, lock_fd)
        raise
    return host_dir, lock_fd


def discard_host_dir(host_dir: str, lock_fd: int) -> None:
    """Undo make_host_dir: delete the dir (if it was made) and its lock file, then let go of
    the lock."""
    try:
        if os.path.isdir(host_dir):
            unmount_all(host_dir)  # frees a capped home's content at once
            delete_tree(host_dir)
        os.unlink(host_dir + LOCK_SUFFIX)
    finally:
        os.close(lock_fd)


def sweep_stale_host_dirs(root: str, reclaim: Callable[[str], None] | None = None, *, prefix: str = "sb-") -> list[str]:
    """Delete the dirs `<root>/<prefix>*` (sandbox dirs; the gateway's too) whose owner died
    without closing them (SIGKILL, OOM, power loss): their lock is free. `reclaim(host_dir)` runs
    first (the local backend kills what may still run as the dir's uid). Returns the dirs deleted."""
    names = set(os.listdir(root))
    locks = [name for name in names if name.startswith(prefix) and name.endswith(LOCK_SUFFIX)]
    for name in names - {lock[: -len(LOCK_SUFFIX)] for lock in locks}:
        # A dir without a lock file (made by an older pi-env): dead once it is old enough.
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            if (
                name.startswith(prefix)
                and not name.endswith(LOCK_SUFFIX)
                and time.time() - os.lstat(path).st_mtime > UNLOCKED_DIR_AGE_S
            ):
                os.close(os.open(path + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
                os.utime(path + LOCK_SUFFIX, (0, 0))
                locks.append(name + LOCK_SUFFIX)
    swept = []
    for lock in locks:
        lock_path = os.path.join(root, lock)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # deleted meanwhile by its owner or another sweeper
        try:
            if time.time() - os.fstat(fd).st_mtime < STALE_LOCK_AGE_S:
                continue  # maybe created just now, not yet flocked
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives
            host_dir = lock_path[: -len(LOCK_SUFFIX)]
            if os.path.isdir(host_dir):
                if reclaim is not None:
                    reclaim(host_dir)
                unmount_all(host_dir)  # its capped home (and anything stacked on it) is still mounted
                delete_tree(host_dir)
                swept.append(host_dir)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
        except (OSError, subprocess.SubprocessError) as error:  # a dir that resists never stops a backend
            log.warning("could not sweep stale sandbox %s: %s", lock_path, error)
        finally:
            os.close(fd)
    if swept:
        sweep_stale_cgroups({os.path.basename(host_dir) for host_dir in swept})
        log.warning("deleted %d %s* dir(s) left behind by dead processes under %s", len(swept), prefix, root)
    return swept


def private_dir(path: str, mode: int) -> None:
    """Create `path` if needed and make sure it is a real directory of ours with `mode`: the
    default root sits in a world-writable /tmp, where anybody could have planted it first."""
    os.makedirs(path, mode=mode, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxError(f"{path} is not a directory owned by uid {os.geteuid()}; remove it")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


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


# ---------------------------------------------------------------------------------------------
# Processes and their output


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


# ---------------------------------------------------------------------------------------------
# Host-side file access and deletion that never follow a symlink


def relative_to_home(path: str) -> str:
    """'x' or '/root/workdir/x' -> 'workdir/x'; '' for the home itself."""
    full = posixpath.normpath(posixpath.join(SANDBOX_WORKDIR, path))
    if full == SANDBOX_HOME:
        return ""
    if not full.startswith(SANDBOX_HOME + "/"):
        raise ValueError(
            f"{path!r} is outside {SANDBOX_HOME}: host-side file operations only reach the "
            "sandbox home (use exec() for anything else)"
        )
    return full[len(SANDBOX_HOME) + 1 :]


def _remove_entry(dir_fd: int, name: str) -> None:
    """Delete `name` under dir_fd (a file, a symlink or a whole tree), never following a
    symlink. Iterative, with at most WALK_MAX_DEPTH directories open: a subtree deeper than
    that is first moved up next to `name` (a rename never follows a symlink) and deleted in
    its turn, so no nesting depth exhausts the stack or the fds."""
    pending = [name]
    while pending:
        top = pending.pop()
        try:
            os.unlink(top, dir_fd=dir_fd)
            continue
        except FileNotFoundError:
            continue
        except IsADirectoryError:
            pass
        stack = [(top, os.open(top, _DIR_FLAGS, dir_fd=dir_fd))]  # (name in its parent, fd)
        try:
            _make_removable(stack[-1][1])
            entries = [iter(os.listdir(stack[-1][1]))]
            while stack:
                parent_fd = stack[-1][1]
                child = next(entries[-1], None)
                if child is None:  # this directory is empty now
                    done, fd = stack.pop()
                    entries.pop()
                    os.close(fd)
                    os.rmdir(done, dir_fd=stack[-1][1] if stack else dir_fd)
                    continue
                try:
                    os.unlink(child, dir_fd=parent_fd)
                    continue
                except FileNotFoundError:
                    continue
                except IsADirectoryError:
                    pass
                if len(stack) >= WALK_MAX_DEPTH:  # hoist it: delete it later from the top
                    hoisted = f".pi-env-deleting-{secrets.token_hex(6)}"
                    os.rename(child, hoisted, src_dir_fd=parent_fd, dst_dir_fd=dir_fd)
                    pending.append(hoisted)
                    continue
                fd = os.open(child, _DIR_FLAGS, dir_fd=parent_fd)
                stack.append((child, fd))
                _make_removable(fd)
                entries.append(iter(os.listdir(fd)))
        finally:
            for _, fd in stack:
                os.close(fd)


def _make_removable(fd: int) -> None:
    os.fchmod(fd, 0o700)  # a read-only dir the sandbox made would stop a non-root owner


def _copy_entries(source: str, names: list[str], target: str) -> None:
    """Copy the entries `names` of the dir `source` into `target` as they are: symlinks stay
    symlinks (nothing is followed), owners, modes and times are kept; reflinks where the
    filesystem has them. Called with nothing running in the sandbox."""
    if names:
        done = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", *(os.path.join(source, n) for n in names), target + "/"],
            capture_output=True,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        if done.returncode != 0:
            raise SandboxError(f"copying into {target} failed: {done.stderr.decode(errors='replace')[-300:]}")


def delete_tree(path: str) -> None:
    """Delete a sandbox's host dir, never following a symlink inside it."""
    parent, name = os.path.split(path)
    parent_fd = os.open(parent, _DIR_FLAGS)
    try:
        _remove_entry(parent_fd, name)
    except OSError:
        # Nothing runs in the sandbox any more, so the plain tools are safe here; a mount point
        # (EBUSY) is detached first.
        log.warning("deleting %s with rm -rf", path, exc_info=True)
        unmount_all(path)
        subprocess.run(["chmod", "-R", "u+rwx", "--", path], stderr=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", "--", path], check=True)
    finally:
        os.close(parent_fd)


# ---------------------------------------------------------------------------------------------
# The sandbox


class HostDirSandbox:
    """A host dir whose `home/` is the sandbox's /root (see the module doc). Subclasses say
    how a command is spawned (_popen_args) and killed (_terminate)."""

    def __init__(self, host_dir: str, owner: int | None, lock_fd: int):
        self.id = os.path.basename(host_dir)
        self._lock_fd = lock_fd  # held until close(): the dir has a living owner
        self.home = SANDBOX_HOME
        self.workdir = SANDBOX_WORKDIR
        self.host_dir = host_dir
        self.host_home = os.path.join(host_dir, "home")
        self._owner = owner  # uid (and gid) that must own what the host creates; None: ours
        self._home_fd = os.open(self.host_home, _DIR_FLAGS)
        self._lock = threading.Lock()
        self._processes: set[LocalProcess] = set()
        self._closed = False

    # -- subclass hooks

    def _popen_args(
        self,
        command: str | list[str],
        cwd: str | None,
        env: dict[str, str] | None,
        network: Network,
    ) -> dict:
        """subprocess.Popen keyword arguments (args included) that run `command`."""
        raise NotImplementedError

    def _terminate(self, popen: subprocess.Popen) -> None:
        raise NotImplementedError

    def _kill_leftovers(self) -> None:
        """Called by kill_all() after killing every tracked command."""

    def _release(self) -> None:
        """Called once by close() after the host dir is gone."""

    # -- commands

    def exec(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        network: Network = "none",
        stdin: bytes | None = None,
    ) -> ExecResult:
        process = self._launch(
            self._popen_args(command, cwd, env, network),
            stdin_file=None,
            stdin_data=stdin or b"",
            output_limit=EXEC_OUTPUT_LIMIT_BYTES,
            background=False,
        )
        try:
            return process.wait(timeout_s)
        finally:
            with self._lock:
                self._processes.discard(process)

    def start(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        network: Network = "none",
        stdin_path: str | None = None,
        output_limit_bytes: int = 4 << 20,
    ) -> LocalProcess:
        popen_args = self._popen_args(command, cwd, env, network)
        stdin_file = self._open_for_reading(stdin_path) if stdin_path else None
        try:
            return self._launch(
                popen_args,
                stdin_file=stdin_file,
                stdin_data=b"",
                output_limit=output_limit_bytes,
                background=True,
            )
        finally:
            if stdin_file is not None:
                os.close(stdin_file)  # the child has its own copy

    def _launch(
        self,
        popen_args: dict,
        *,
        stdin_file: int | None,
        stdin_data: bytes,
        output_limit: int,
        background: bool,
    ) -> LocalProcess:
        # Pipes of our own, owned by the sandbox uid: a command that reopens its output through
        # /dev/stdout or /dev/stderr (/proc/self/fd/N) needs permission on the pipe itself.
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        stdin_r, stdin_w = os.pipe() if stdin_data else (None, None)
        for fd in (stdout_w, stderr_w, stdin_r):
            if fd is not None:
                self._chown(fd)
        if stdin_r is None:
            stdin_r = subprocess.DEVNULL if stdin_file is None else stdin_file
        usernet = popen_args.pop("usernet", None)  # local.py: a network to attach once spawned

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(
                **popen_args,
                stdin=stdin_r,
                stdout=stdout_w,
                stderr=stderr_w,
                start_new_session=True,
            )

        process = None
        try:
            with self._lock:  # close() cannot slip in between the check and the tracking
                self._check_open()
                popen = _spawner.submit(spawn).result() if background else spawn()
                process = LocalProcess(popen, self._terminate, stdin_w, stdin_data, stdout_r, stderr_r, output_limit)
                self._processes = {p for p in self._processes if p.poll() is None}
                self._processes.add(process)
        except BaseException:
            if usernet is not None:
                usernet.abandon()
            if process is None:
                for fd in (stdout_r, stderr_r, stdin_w):
                    if fd is not None:
                        os.close(fd)
            else:
                process.kill()
            raise
        finally:  # the child's ends: it has its own copies now
            for fd in (stdout_w, stderr_w, stdin_r if stdin_data else None):
                if fd is not None:
                    os.close(fd)
        if usernet is not None:
            try:
                usernet.attach()
            except BaseException:
                process.kill()
                raise
        return process

    def kill_all(self) -> None:
        with self._lock:
            running = [p for p in self._processes if p.poll() is None]
        for process in running:
            process.kill()
        if running:
            self._kill_leftovers()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.kill_all()
            os.close(self._home_fd)
        finally:
            try:
                discard_host_dir(self.host_dir, self._lock_fd)
            finally:
                self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    # -- the world verify runs in (pi_env.rollout: PiSession._verify_world)

    def checkpoint_home(self) -> None:
        """Keep a copy of the home as setup left it, all but the work dir (dotfiles, ~/.local,
        ~/.config, ~/.cache, ...), outside the home where no command reaches it, for
        restore_home(). Call with nothing running."""
        self._check_open()
        saved = os.path.join(self.host_dir, SETUP_HOME)
        if os.path.lexists(saved):
            delete_tree(saved)
        make_dir(saved, 0o700)
        self._setup_home_mode = stat.S_IMODE(os.fstat(self._home_fd).st_mode)
        _copy_entries(self.host_home, [n for n in os.listdir(self._home_fd) if n != WORKDIR_NAME], saved)

    def restore_home(self, keep: tuple[str, ...] = (), *, set_aside: bool = False) -> list[str]:
        """Kill every command and put the home back as checkpoint_home() saved it, but for the
        work dir and the home-relative dirs `keep` (the agent's output: they stay as the agent
        left them; one that is a symlink or a file now is an empty dir). Whatever a command
        planted elsewhere (a usercustomize.py, a .pth, a git config, a shell rc) is gone.
        set_aside: the rest of the agent's home is kept for put_back_agent_home() (a later
        step of a multi-step task continues in it), else deleted. Returns what went wrong on the
        way that the agent could have caused (its output filling a capped home, say): never
        anything of the agent's outside its output, at worst less of setup's home."""
        self._check_open()
        saved = os.path.join(self.host_dir, SETUP_HOME)
        if not os.path.isdir(saved):
            raise SandboxError(f"sandbox {self.id}: restore_home() without checkpoint_home()")
        self.kill_all()
        self._kept_paths = keep
        kept = self._take_out((WORKDIR_NAME, *keep))
        problems = []
        _remove_entry(self._home_fd, AGENT_HOME)  # the agent's own, in the way
        if set_aside:
            os.mkdir(AGENT_HOME, 0o700, dir_fd=self._home_fd)
            for name in os.listdir(self._home_fd):
                if name not in kept and name != AGENT_HOME:
                    os.rename(name, f"{AGENT_HOME}/{name}", src_dir_fd=self._home_fd, dst_dir_fd=self._home_fd)
            kept[AGENT_HOME] = AGENT_HOME
        self._clear_home(kept)  # first: whatever fails below, nothing of the agent's is left in place
        try:
            _copy_entries(saved, os.listdir(saved), self.host_home)
        except SandboxError as error:
            problems.append(f"setup's home was restored only in part for verify ({error})")
        os.fchmod(self._home_fd, self._setup_home_mode)
        self._put_in({temp: path for temp, path in kept.items() if temp != AGENT_HOME})
        return problems

    def put_back_agent_home(self) -> None:
        """Undo restore_home(set_aside=True): the agent's home in place of verify's, but for the
        work dir and `keep` as they are now. Nothing set aside: verify's stays."""
        self._check_open()
        try:
            is_dir = stat.S_ISDIR(os.stat(AGENT_HOME, dir_fd=self._home_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            is_dir = False
        if not is_dir:
            return
        self.kill_all()
        kept = self._take_out((WORKDIR_NAME, *self._kept_paths))
        self._clear_home({**kept, AGENT_HOME: AGENT_HOME})
        aside_fd = os.open(AGENT_HOME, _DIR_FLAGS, dir_fd=self._home_fd)
        try:
            for name in os.listdir(aside_fd):
                if name not in kept:
                    os.rename(name, name, src_dir_fd=aside_fd, dst_dir_fd=self._home_fd)
        finally:
            os.close(aside_fd)
        _remove_entry(self._home_fd, AGENT_HOME)
        self._put_in(kept)

    def _take_out(self, paths: tuple[str, ...]) -> dict[str, str]:
        """Rename each home-relative dir of `paths` to a top-level name of its own (never
        following a symlink on the way): temporary name -> path. A path that is missing, a
        symlink or a file is dropped (and later made an empty dir)."""
        kept: dict[str, str] = {}
        for index, path in enumerate(paths):
            temp = f".pi-env-kept-{index}"
            _remove_entry(self._home_fd, temp)  # a command's, in the way
            try:
                with self._parent_dir(f"{SANDBOX_HOME}/{path}", create=False) as (dir_fd, name):
                    if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        os.rename(name, temp, src_dir_fd=dir_fd, dst_dir_fd=self._home_fd)
            except FileNotFoundError:
                pass
            kept[temp] = path
        return kept

    def _put_in(self, kept: dict[str, str]) -> None:
        for temp, path in kept.items():
            with self._parent_dir(f"{SANDBOX_HOME}/{path}", create=True) as (dir_fd, name):
                _remove_entry(dir_fd, name)
                try:
                    os.rename(temp, name, src_dir_fd=self._home_fd, dst_dir_fd=dir_fd)
                except FileNotFoundError:  # it was not a dir: an empty one
                    os.mkdir(name, 0o755, dir_fd=dir_fd)
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        self._chown(fd)
                    finally:
                        os.close(fd)

    def _clear_home(self, kept: dict[str, str]) -> None:
        for name in os.listdir(self._home_fd):  # deleted in place, never followed
            if name not in kept:
                _remove_entry(self._home_fd, name)

    # -- files

    @contextmanager
    def _parent_dir(self, path: str, *, create: bool) -> Iterator[tuple[int, str]]:
        """(fd of the parent directory, final name) for a sandbox path, reached from the home
        one component at a time with O_NOFOLLOW: a symlink the sandbox planted is never
        followed (the host would resolve it against the host's own filesystem)."""
        self._check_open()
        relative = relative_to_home(path)
        if not relative:
            raise ValueError(f"{path!r} is the sandbox home itself")
        *parents, name = relative.split("/")
        fd = os.open(".", _DIR_FLAGS, dir_fd=self._home_fd)
        try:
            for part in parents:
                child = self._open_subdir(fd, part, create, path)
                os.close(fd)
                fd = child
            yield fd, name
        finally:
            os.close(fd)

    def _open_subdir(self, dir_fd: int, name: str, create: bool, path: str) -> int:
        created = False
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=dir_fd)
                created = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if not create:
                raise FileNotFoundError(f"{path}: {name} is a symlink or a file") from exc
            # Staging owns the path it writes: a symlink or file the sandbox put where a
            # directory goes is replaced (never followed).
            _remove_entry(dir_fd, name)
            os.mkdir(name, 0o755, dir_fd=dir_fd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            created = True
        if created:
            self._chown(fd)
        return fd

    def _chown(self, fd: int) -> None:
        if self._owner is not None:
            os.fchown(fd, self._owner, self._owner)

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode()
        with self._parent_dir(path, create=True) as (dir_fd, name):
            # Write a new file and rename it over the target: an existing entry (a symlink, a
            # FIFO, a hard link) is replaced, never written through.
            temp = f".pi-env-{secrets.token_hex(6)}"
            fd = os.open(
                temp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            try:
                with open(fd, "wb") as f:
                    f.write(data)
                    self._chown(f.fileno())
                    os.fchmod(f.fileno(), mode)
                try:
                    os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except IsADirectoryError:  # a directory where the file goes: replaced too
                    _remove_entry(dir_fd, name)
                    os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                os.unlink(temp, dir_fd=dir_fd)
                raise

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        fd = self._open_for_reading(path)
        with open(fd, "rb") as f:
            return f.read() if max_bytes is None else f.read(max_bytes)

    def _open_for_reading(self, path: str) -> int:
        """A read fd for a regular file of the sandbox (FileNotFoundError for symlinks)."""
        with self._parent_dir(path, create=False) as (dir_fd, name):
            try:
                fd = os.open(name, _FILE_READ_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise FileNotFoundError(f"{path} is a symlink") from exc
                raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(f"{path} is a directory")
            raise FileNotFoundError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return fd

    def exists(self, path: str) -> bool:
        """True for a file or directory; symlinks count as missing, as for read_file()."""
        self._check_open()
        if not relative_to_home(path):
            return True
        try:
            with self._parent_dir(path, create=False) as (dir_fd, name):
                return not stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def remove(self, path: str) -> None:
        try:
            with self._parent_dir(path, create=False) as (dir_fd, name):
                _remove_entry(dir_fd, name)
        except FileNotFoundError:
            pass

    def snapshot(
        self,
        path: str,
        *,
        max_files: int = 200,
        max_file_bytes: int = 256 << 10,
        max_total_bytes: int | None = None,
    ) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        relative = relative_to_home(path)
        try:
            if relative:
                with self._parent_dir(path, create=False) as (dir_fd, name):
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            else:
                fd = os.open(".", _DIR_FLAGS, dir_fd=self._home_fd)
        except OSError:  # missing, a symlink or a file: no tree under it
            return files
        try:
            self._collect(fd, files, max_files, max_file_bytes, max_total_bytes)
        finally:
            os.close(fd)
        return files

    def _collect(
        self,
        top_fd: int,
        files: dict[str, bytes],
        max_files: int,
        max_file_bytes: int,
        max_total_bytes: int | None,
    ) -> None:
        """Depth-first, in name order, iterative and at most WALK_MAX_DEPTH levels deep."""
        left = max_total_bytes
        stack: list[tuple[int, str, Iterator[str]]] = [(top_fd, "", iter(sorted(os.listdir(top_fd))))]
        try:
            while stack and len(files) < max_files:
                dir_fd, prefix, names = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    if dir_fd != top_fd:
                        os.close(dir_fd)
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        if len(stack) < WALK_MAX_DEPTH:
                            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                            try:
                                listing = iter(sorted(os.listdir(fd)))
                            except OSError:
                                os.close(fd)
                                raise
                            stack.append((fd, f"{prefix}{name}/", listing))
                    elif (
                        stat.S_ISREG(st.st_mode)
                        and st.st_size <= max_file_bytes
                        and (left is None or st.st_size <= left)
                    ):
                        limit = max_file_bytes if left is None else min(max_file_bytes, left)
                        fd = os.open(name, _FILE_READ_FLAGS, dir_fd=dir_fd)
                        with open(fd, "rb") as f:
                            if stat.S_ISREG(os.fstat(fd).st_mode):  # not swapped for a FIFO
                                data = f.read(limit + 1)  # it may have grown since the stat
                                if len(data) <= limit:
                                    files[prefix + name] = data
                                    if left is not None:
                                        left -= len(data)
                except OSError:  # changed under our feet by a running command: skip it
                    continue
        finally:
            for dir_fd, _, _ in stack:
                if dir_fd != top_fd:
                    os.close(dir_fd)
