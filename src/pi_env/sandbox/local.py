"""Local sandbox backend: every command runs in a fresh bubblewrap (bwrap) sandbox.

What a command sees
    A minimal, read-only view of the host: /usr (with /bin, /lib, ... as on the host), a few
    /etc entries, a generated /etc/passwd and /etc/group, `spec.ro_mounts`, and new /proc and
    /dev. Writable: /root (the sandbox home, a host dir that persists across commands until
    close()), and /tmp, /run and /dev/shm, which are size-capped tmpfs mounts private to each
    command. No capabilities, a fresh pid/ipc/uts/net/user namespace per command, no host
    environment variables. Everything a command starts dies when the command exits: use
    start() for servers that must outlive one call.

Who it runs as
    As root, each sandbox leases an exclusive uid from a range (default 200000-259999,
    `PI_ENV_SANDBOX_UIDS=FIRST-LAST` to change it) with a flock that every process on the
    machine honours, and runs bwrap as that uid (`setpriv --reuid=U ... prlimit ... bwrap ...`
    with the limits of spec.limits). Inside, the command is uid 0 of its own user namespace,
    but on the host it is an unprivileged uid that owns nothing but its home, so RLIMIT_NPROC
    really holds and `kill(-1)` as that uid reaches every process the sandbox made.
    Not as root, bwrap runs as the caller: RLIMIT_NPROC then counts all the caller's processes
    (it is set to the sandbox limit plus what is already running), and kill_all() relies on the
    pid namespaces alone.

    Because bwrap runs unprivileged, every host path it binds must be reachable by the sandbox
    uid: a ro_mount directory needs o+x on every parent and o+rX on its content (a single file
    that is not reachable, say inside a package installed under /root, is bound from a copy),
    and so does the sandbox root (`PI_ENV_SANDBOX_ROOT`, default $TMPDIR/pi-env-sandboxes, or
    $TMPDIR/pi-env-sandboxes-<uid> when not root). create() checks this and says what to fix.

The gateway socket (network="gateway")
    Connecting to a Unix socket needs write permission on it, so as root create() adds o+w to
    the gateway's socket (pi-env's gateway already makes it 0o666). It then hard-links the
    socket into a directory only the sandbox uid can enter, so the gateway may keep its socket
    in a private directory. A socket on another filesystem than the sandbox root cannot be
    hard-linked: it is bound from its own path, whose parents must then be o+x.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import functools
import logging
import os
import posixpath
import random
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pi_env.sandbox.base import (
    GATEWAY_SOCKET,
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    ExecResult,
    Network,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
    SandboxUnavailable,
)

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "Install bubblewrap (`apt-get install bubblewrap` on Debian/Ubuntu, `dnf install bubblewrap` "
    "on Fedora/RHEL), or opt in explicitly to the `unsafe-local` backend, which runs commands "
    "directly on this machine without any isolation."
)
DEFAULT_UID_RANGE = (200000, 259999)
EXEC_OUTPUT_LIMIT_BYTES = 1 << 20  # per stream; exec() keeps the tail
SMALL_TMPFS_BYTES = 64 << 20  # /run and /dev/shm
KILL_WAIT_S = 5.0  # how long a killed sandbox may take to disappear
DRAIN_AFTER_KILL_S = 2.0  # output still buffered in pipes after a kill

# fmt: off
_HOST_ETC_ENTRIES = (
    "alternatives", "ssl", "ca-certificates", "resolv.conf", "hosts", "nsswitch.conf",
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "mime.types", "gai.conf",
    "bash.bashrc", "profile",
)
# fmt: on
# Every sandbox: new namespaces of every kind (the network one too unless network="full"), no
# capabilities, uid 0 inside, killed with its parent, no terminal to inject keystrokes into.
# fmt: off
_SANDBOX_FLAGS = (
    "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
    "--uid", "0", "--gid", "0", "--hostname", "pi-env",
)
# fmt: on
_PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
_GROUP = "root:x:0:\nnogroup:x:65534:\n"
_DEFAULT_ENV = {
    "HOME": SANDBOX_HOME,
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "USER": "root",
}
# With --as-pid-1 the command's first process is the namespace's init: it must reap orphans
# and is immune to signals from inside. A shell with an EXIT trap never exec()s its last
# command, so the shell takes that role and the real command runs as an ordinary process.
_INIT_PREFIX = "trap : EXIT\n"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO the sandbox planted must not hang the host.
_FILE_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# ---------------------------------------------------------------------------------------------
# Facts about the host, computed once per process


@functools.cache
def _shell() -> str:
    return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


@functools.cache
def _host_fs_args() -> tuple[str, ...]:
    """bwrap arguments for the read-only part of the host that every sandbox sees."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: recreate the symlink rather than bind its target
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for entry in _HOST_ETC_ENTRIES:
        path = f"/etc/{entry}"
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return tuple(args)


def _find_bwrap(bwrap: str) -> str:
    path = shutil.which(bwrap)
    if path is None:
        raise SandboxUnavailable(f"bubblewrap ({bwrap!r}) was not found. {INSTALL_HINT}")
    return path


_probe_lock = threading.Lock()
_probe_failures: dict[str, str | None] = {}  # bwrap path -> None if it works, else why not


def _check_user_namespaces(bwrap: str, as_root: bool) -> None:
    """Run one trivial sandbox (once per process) so that a host where bwrap cannot create a
    user namespace fails here, with advice, instead of on every command."""
    with _probe_lock:
        if bwrap not in _probe_failures:
            _probe_failures[bwrap] = _probe(bwrap, as_root)
        failure = _probe_failures[bwrap]
    if failure is not None:
        raise SandboxUnavailable(
            f"bubblewrap cannot create a sandbox on this machine: {failure}. Unprivileged user "
            "namespaces are probably disabled: check `sysctl user.max_user_namespaces`, "
            "`kernel.unprivileged_userns_clone` (Debian) and "
            "`kernel.apparmor_restrict_unprivileged_userns` (Ubuntu 24.04+); in a container, "
            "allow user namespaces (for example a seccomp profile that permits them). Or opt in "
            "explicitly to the `unsafe-local` backend (no isolation)."
        )


def _probe(bwrap: str, as_root: bool) -> str | None:
    lease = _lease_uid() if as_root else None
    argv = [*_as_user(lease.uid if lease else None), bwrap, "--unshare-all", *_SANDBOX_FLAGS,
            *_host_fs_args(), "--", "/bin/sh", "-c", "exit 0"]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, cwd="/", env={})
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if lease:
            lease.release()
    if done.returncode != 0:
        return done.stderr.decode(errors="replace").strip() or f"exit code {done.returncode}"
    return None


def _as_user(uid: int | None) -> list[str]:
    """A command prefix that runs the rest as `uid` (and gid), without groups or capabilities.

    An extra exec of setpriv is cheaper than Popen(user=...): changing ids in the child rules
    out vfork, and forking a big Python process costs more than two small execs."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all"]


def _private_dir(path: str, mode: int) -> None:
    """Create `path` if needed and make sure it is a real directory of ours with `mode`: the
    default root sits in a world-writable /tmp, where anybody could have planted it first."""
    os.makedirs(path, mode=mode, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxError(f"{path} is not a directory owned by uid {os.geteuid()}; remove it")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def _unreachable_why(path: str, *, readable: bool = True) -> str | None:
    """Why an unprivileged sandbox uid, which only has the "other" permission bits, could not
    open `path` (so bwrap running as that uid would fail with a bare 'Permission denied'), or
    None if it can."""
    parent = os.path.dirname(path)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return f"{parent} lacks o+x"
        if parent == "/":
            break
        parent = os.path.dirname(parent)
    if readable and not os.stat(path).st_mode & stat.S_IROTH:
        return f"{path} lacks o+r"
    return None


# ---------------------------------------------------------------------------------------------
# Exclusive sandbox uids


class _UidLease:
    """An exclusive claim on one sandbox uid: a flock on `<lock dir>/<uid>` that every process
    of this machine honours. Closing the fd (or dying) releases it."""

    def __init__(self, uid: int, fd: int):
        self.uid = uid
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lease_uid() -> _UidLease:
    lock_dir = "/run/lock/pi-env-uids" if os.path.isdir("/run/lock") else "/tmp/pi-env-uids"
    _private_dir(lock_dir, 0o700)
    uids = _sandbox_uids()
    start = random.randrange(len(uids))  # concurrent allocators rarely probe the same locks
    for i in range(len(uids)):
        uid = uids[(start + i) % len(uids)]
        path = os.path.join(lock_dir, str(uid))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return _UidLease(uid, fd)
    raise SandboxError(f"all {len(uids)} sandbox uids are in use (see PI_ENV_SANDBOX_UIDS)")


@functools.cache
def _sandbox_uids() -> list[int]:
    """The uid range minus every id this machine already gives to someone: users, groups and
    subordinate ranges of rootless containers. Sharing a uid with them would let kill_all()
    kill their processes."""
    first, last = DEFAULT_UID_RANGE
    if spec := os.environ.get("PI_ENV_SANDBOX_UIDS"):
        first, last = (int(part) for part in spec.split("-"))
    taken: set[int] = set()
    for db in ("/etc/passwd", "/etc/group"):
        for fields in _colon_records(db):
            if len(fields) > 2 and fields[2].isdigit():
                taken.add(int(fields[2]))
    uids = [uid for uid in range(first, last + 1) if uid not in taken]
    for db in ("/etc/subuid", "/etc/subgid"):
        for fields in _colon_records(db):
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                low, count = int(fields[1]), int(fields[2])
                uids = [uid for uid in uids if not low <= uid < low + count]
    if not uids:
        raise SandboxError(f"no free uid in {first}-{last}: set PI_ENV_SANDBOX_UIDS=FIRST-LAST")
    return uids


def _colon_records(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.strip().split(":") for line in f if line.strip()]
    except OSError:
        return []


def _kill_every_process_of(uid: int) -> None:
    """kill(-1, SIGKILL) as `uid`: reaches every process of that uid in every session and
    namespace, atomically with respect to fork() so a fork bomb cannot outrun it."""
    subprocess.run(
        [*_as_user(uid), "/bin/sh", "-c", "kill -9 -1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
        env={},
    )


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
# Resource limits


def _rlimits(limits: SandboxLimits, exclusive_uid: bool) -> dict[int, int]:
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


_PRLIMIT_OPTIONS = {
    resource.RLIMIT_NPROC: "--nproc",
    resource.RLIMIT_FSIZE: "--fsize",
    resource.RLIMIT_NOFILE: "--nofile",
    resource.RLIMIT_CORE: "--core",
    resource.RLIMIT_DATA: "--data",
}


def _with_limits(rlimits: dict[int, int]) -> list[str]:
    """A command prefix that runs the rest under these limits (prlimit, for the same reason as
    setpriv in _as_user: no preexec_fn, so Popen can vfork)."""
    return [
        "prlimit",
        *(f"{_PRLIMIT_OPTIONS[res]}={value}" for res, value in rlimits.items()),
        "--",
    ]


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


def _kill_bwrap(popen: subprocess.Popen) -> None:
    """Kill one sandboxed command and everything it started.

    SIGKILL to the pid namespace's init (bwrap's only child) makes the kernel kill every
    process of the namespace, setsid and double-fork escapes included; bwrap reaps it and
    exits. Killing bwrap first would work too (its child has a parent-death signal) but would
    leave that child as a zombie for the host's init, counted against RLIMIT_NPROC until reaped.
    """
    try:
        pidfd = os.pidfd_open(popen.pid)
    except ProcessLookupError:
        return
    try:
        if popen.returncode is not None:  # reaped just now: the pidfd may be someone else's
            return
        if not _kill_children(popen.pid):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        try:
            popen.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            popen.wait()
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _kill_children(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(child) for child in f.read().split()]
    except OSError:
        return False
    killed = False
    for child in children:
        try:
            pidfd = os.pidfd_open(child)
        except ProcessLookupError:
            continue
        try:
            if _parent_of(child) == pid:  # not a recycled pid: the pidfd is the child's
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed = True
        except (OSError, ValueError):
            pass
        finally:
            os.close(pidfd)
    return killed


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


# Background commands are spawned from one long-lived thread: bwrap's --die-with-parent is a
# parent-death signal, which Linux sends when the spawning *thread* exits, so start() called
# from a short-lived thread would otherwise kill its command moments later.
_spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pi-env-sandbox-spawner")


# ---------------------------------------------------------------------------------------------
# Host-side file access and deletion that never follow a symlink


def _relative_to_home(path: str) -> str:
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
    symlink."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)  # a read-only dir the sandbox made would stop a non-root owner
        for child in os.listdir(fd):
            _remove_entry(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _delete_tree(path: str) -> None:
    parent, name = os.path.split(path)
    parent_fd = os.open(parent, _DIR_FLAGS)
    try:
        _remove_entry(parent_fd, name)
    except (OSError, RecursionError):
        # A tree nested deeper than Python's recursion limit (or the fd limit). Nothing runs in
        # the sandbox any more, so the plain tools are safe here.
        log.warning("deleting %s with rm -rf", path, exc_info=True)
        subprocess.run(["chmod", "-R", "u+rwx", "--", path], stderr=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", "--", path], check=True)
    finally:
        os.close(parent_fd)


def default_root() -> str:
    """$PI_ENV_SANDBOX_ROOT, else a directory in the temp dir (one per user but root, since
    each user must own theirs)."""
    if root := os.environ.get("PI_ENV_SANDBOX_ROOT"):
        return root
    uid = os.geteuid()
    return os.path.join(tempfile.gettempdir(), "pi-env-sandboxes" + (f"-{uid}" if uid else ""))


def _mkdir(path: str, mode: int, owner: int | None = None) -> None:
    os.mkdir(path)
    os.chmod(path, mode)  # whatever the umask
    if owner is not None:
        os.chown(path, owner, owner)


def _make_host_dir(root: str, owner: int | None) -> str:
    """<root>/<id>/ (0o711) with home/ and home/workdir/ owned by `owner` (None: by us)."""
    host_dir = os.path.join(root, "sb-" + secrets.token_hex(8))
    _mkdir(host_dir, 0o711)
    _mkdir(os.path.join(host_dir, "home"), 0o700, owner)
    _mkdir(os.path.join(host_dir, "home", "workdir"), 0o755, owner)
    return host_dir


class _HostDirSandbox:
    """What the local and unsafe-local sandboxes share: a host dir whose `home/` is the
    sandbox's /root, host-side file access that never follows a symlink the sandbox planted,
    and the bookkeeping of running commands. Subclasses say how a command is spawned/killed."""

    def __init__(self, host_dir: str, owner: int | None):
        self.id = os.path.basename(host_dir)
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

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(
                **popen_args,
                stdin=stdin_r,
                stdout=stdout_w,
                stderr=stderr_w,
                start_new_session=True,
            )

        try:
            with self._lock:  # close() cannot slip in between the check and the tracking
                self._check_open()
                popen = _spawner.submit(spawn).result() if background else spawn()
                process = LocalProcess(
                    popen, self._terminate, stdin_w, stdin_data, stdout_r, stderr_r, output_limit
                )
                self._processes = {p for p in self._processes if p.poll() is None}
                self._processes.add(process)
        except BaseException:
            for fd in (stdout_r, stderr_r, stdin_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:  # the child's ends: it has its own copies now
            for fd in (stdout_w, stderr_w, stdin_r if stdin_data else None):
                if fd is not None:
                    os.close(fd)
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
            _delete_tree(self.host_dir)
        finally:
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    # -- files

    @contextmanager
    def _parent_dir(self, path: str, *, create: bool) -> Iterator[tuple[int, str]]:
        """(fd of the parent directory, final name) for a sandbox path, reached from the home
        one component at a time with O_NOFOLLOW: a symlink the sandbox planted is never
        followed (the host would resolve it against the host's own filesystem)."""
        self._check_open()
        relative = _relative_to_home(path)
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
            if create:
                raise SandboxError(
                    f"refusing to write {path}: {name} is a symlink or a file"
                ) from exc
            raise FileNotFoundError(f"{path}: {name} is a symlink or a file") from exc
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
        if not _relative_to_home(path):
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
        self, path: str, *, max_files: int = 200, max_file_bytes: int = 256 << 10
    ) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        relative = _relative_to_home(path)
        try:
            if relative:
                with self._parent_dir(path, create=False) as (dir_fd, name):
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            else:
                fd = os.open(".", _DIR_FLAGS, dir_fd=self._home_fd)
        except OSError:  # missing, a symlink or a file: no tree under it
            return files
        try:
            self._collect(fd, "", files, max_files, max_file_bytes)
        finally:
            os.close(fd)
        return files

    def _collect(
        self, dir_fd: int, prefix: str, files: dict[str, bytes], max_files: int, max_file_bytes: int
    ) -> None:
        for name in sorted(os.listdir(dir_fd)):
            if len(files) >= max_files:
                return
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        self._collect(fd, f"{prefix}{name}/", files, max_files, max_file_bytes)
                    finally:
                        os.close(fd)
                elif stat.S_ISREG(st.st_mode) and st.st_size <= max_file_bytes:
                    fd = os.open(name, _FILE_READ_FLAGS, dir_fd=dir_fd)
                    with open(fd, "rb") as f:
                        if stat.S_ISREG(os.fstat(fd).st_mode):  # not swapped for a FIFO
                            data = f.read(max_file_bytes + 1)
                            if len(data) <= max_file_bytes:
                                files[prefix + name] = data
            except OSError:  # changed under our feet by a running command: skip it
                continue


# ---------------------------------------------------------------------------------------------
# The bubblewrap sandbox


class LocalSandbox(_HostDirSandbox):
    """A sandbox whose commands each run in a fresh bwrap namespace set (see the module doc)."""

    def __init__(
        self,
        host_dir: str,
        spec: SandboxSpec,
        ro_mounts: dict[str, str],
        gateway_socket: str | None,
        bwrap: str,
        lease: _UidLease | None,
    ):
        """ro_mounts and gateway_socket: host paths that bwrap can bind as the sandbox uid."""
        super().__init__(host_dir, lease.uid if lease else None)
        self.uid = lease.uid if lease else os.getuid()  # the host uid its processes run as
        self._spec = spec
        self._bwrap = bwrap
        self._lease = lease
        self._launcher = [
            *_as_user(lease.uid if lease else None),
            *_with_limits(_rlimits(spec.limits, lease is not None)),
        ]
        self._mount_args = self._build_mount_args(spec.limits, ro_mounts)
        self._gateway_args: list[str] = []
        if gateway_socket:
            self._gateway_args = ["--ro-bind", gateway_socket, GATEWAY_SOCKET]
            for masked in spec.agent_masked_paths:
                self._gateway_args += ["--tmpfs", masked]

    def _build_mount_args(self, limits: SandboxLimits, ro_mounts: dict[str, str]) -> list[str]:
        files = os.path.join(self.host_dir, "files")
        # fmt: off
        args = [
            *_host_fs_args(),
            "--ro-bind", f"{files}/passwd", "/etc/passwd",
            "--ro-bind", f"{files}/group", "/etc/group",
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(SMALL_TMPFS_BYTES), "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev",  # else its tmpfs takes files without any size limit
            "--size", str(limits.max_file_bytes), "--tmpfs", "/tmp",
            "--size", str(SMALL_TMPFS_BYTES), "--tmpfs", "/run",
            "--bind", self.host_home, SANDBOX_HOME,
        ]
        # fmt: on
        for target in sorted(ro_mounts, key=lambda t: t.count("/")):  # parents first
            args += ["--ro-bind", ro_mounts[target], target]
        return args

    def _popen_args(
        self,
        command: str | list[str],
        cwd: str | None,
        env: dict[str, str] | None,
        network: Network,
    ) -> dict:
        argv = [*self._launcher, self._bwrap, "--unshare-all"]
        if network == "full":
            argv.append("--share-net")  # must follow --unshare-all
        argv += [*_SANDBOX_FLAGS, *self._mount_args]
        if network == "gateway":
            if not self._gateway_args:
                raise ValueError('network="gateway" needs spec.gateway_socket')
            argv += self._gateway_args
        elif network not in ("none", "full"):
            raise ValueError(f"unknown network mode {network!r}")
        argv += ["--remount-ro", "/", "--clearenv"]
        for name, value in {**_DEFAULT_ENV, **self._spec.env, **(env or {})}.items():
            argv += ["--setenv", name, value]
        argv += ["--chdir", posixpath.normpath(posixpath.join(SANDBOX_WORKDIR, cwd or "."))]
        if isinstance(command, str):
            argv += ["--", _shell(), "-c", _INIT_PREFIX + command]
        elif command:  # any POSIX shell can be the init here, and sh starts faster than bash
            argv += ["--", "/bin/sh", "-c", _INIT_PREFIX + '"$@"', "sh", *command]
        else:
            raise ValueError("empty command")
        # env={}: bwrap itself needs nothing from the host environment.
        return {"args": argv, "cwd": "/", "env": {}}

    def _terminate(self, popen: subprocess.Popen) -> None:
        _kill_bwrap(popen)

    def _kill_leftovers(self) -> None:
        # Belt and braces: the pid namespaces already took everything down with their init.
        if self._lease:
            _kill_every_process_of(self._lease.uid)

    def _release(self) -> None:
        if self._lease:
            self._lease.release()


class LocalSandboxBackend:
    """Sandboxes on bubblewrap. Raises SandboxUnavailable when bwrap is missing or cannot
    create user namespaces here."""

    name = "local"

    def __init__(self, root: str | None = None, *, bwrap: str = "bwrap"):
        self._bwrap = _find_bwrap(bwrap)
        self._as_root = os.geteuid() == 0
        for tool in ("setpriv", "prlimit") if self._as_root else ("prlimit",):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(
                    f"`{tool}` (util-linux) is not installed; install util-linux"
                )
        self.root = root or default_root()
        _private_dir(self.root, 0o711)
        if self._as_root and (why := _unreachable_why(os.path.abspath(self.root), readable=False)):
            raise SandboxError(f"sandbox uids cannot reach the sandbox root {self.root}: {why}")
        _check_user_namespaces(self._bwrap, self._as_root)

    def create(self, spec: SandboxSpec) -> LocalSandbox:
        for target in (*spec.ro_mounts, *spec.agent_masked_paths):
            if not posixpath.isabs(target) or posixpath.normpath(target) != target:
                raise ValueError(f"sandbox path {target!r} must be a normalised absolute path")
        lease = _lease_uid() if self._as_root else None
        host_dir = None
        try:
            host_dir = _make_host_dir(self.root, lease.uid if lease else None)
            # files/: what the sandbox sees read-only (root-owned, outside its home)
            _mkdir(os.path.join(host_dir, "files"), 0o755)
            for name, content in (("passwd", _PASSWD), ("group", _GROUP)):
                with open(os.path.join(host_dir, "files", name), "w") as f:
                    f.write(content)
                    os.fchmod(f.fileno(), 0o644)
            mounts = self._ro_mount_sources(spec.ro_mounts, host_dir, lease)
            socket = self._gateway_socket(spec.gateway_socket, host_dir, lease)
            return LocalSandbox(host_dir, spec, mounts, socket, self._bwrap, lease)
        except BaseException:
            if host_dir:
                _delete_tree(host_dir)
            if lease:
                lease.release()
            raise

    def _ro_mount_sources(
        self, ro_mounts: dict[str, str], host_dir: str, lease: _UidLease | None
    ) -> dict[str, str]:
        """Sandbox path -> host path bwrap can bind as the sandbox uid."""
        sources = {}
        for target, source in ro_mounts.items():
            source = os.path.abspath(source)
            if not os.path.exists(source):
                raise SandboxError(f"ro_mount source {source} does not exist")
            why = _unreachable_why(source) if lease else None
            if why and os.path.isfile(source):
                # A single file (say one inside a package installed under /root): bind a copy.
                copy = os.path.join(host_dir, "files", f"mount-{len(sources)}")
                shutil.copyfile(source, copy)
                os.chmod(copy, 0o644)
                source = copy
            elif why:
                raise SandboxError(
                    f"ro_mount source {source} is not readable by the unprivileged sandbox uids: "
                    f"{why}. Make it world-readable (chmod o+x on its parents, chmod -R o+rX on "
                    "it) or move it somewhere that is."
                )
            sources[target] = source
        return sources

    def _gateway_socket(
        self, socket: str | None, host_dir: str, lease: _UidLease | None
    ) -> str | None:
        """The host path to bind at GATEWAY_SOCKET, connectable by the sandbox uid."""
        if socket is None:
            return None
        st = os.stat(socket)
        if not stat.S_ISSOCK(st.st_mode):
            raise SandboxError(f"gateway socket {socket} is not a Unix socket")
        if lease is None:  # bwrap runs as us: our own socket is fine as it is
            return socket
        if not st.st_mode & stat.S_IWOTH:  # connect() needs write permission
            log.info("adding o+w to gateway socket %s so sandbox uids can connect", socket)
            os.chmod(socket, stat.S_IMODE(st.st_mode) | stat.S_IWOTH)
        private = os.path.join(host_dir, "private")
        _mkdir(private, 0o700, lease.uid)  # only the sandbox uid (and root) can enter
        link = os.path.join(private, "gateway.sock")
        try:
            os.link(socket, link)
            return link
        except OSError:  # another filesystem: bind it from where it is
            if why := _unreachable_why(os.path.abspath(socket), readable=False):
                raise SandboxError(f"sandbox uids cannot reach the gateway socket: {why}") from None
            return socket
