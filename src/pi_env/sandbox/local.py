"""Local sandbox backend: every command runs in a fresh bubblewrap (bwrap) sandbox.

This module is the bubblewrap part; the host dir standing for /root, the host-side file
operations and the tracking of running commands are shared with unsafe-local (hostdir.py).

What a command sees
    A minimal, read-only view of the host: /usr (with /bin, /lib, ... as on the host), a few
    /etc entries, a generated /etc/passwd and /etc/group, `spec.ro_mounts`, and new /proc and
    /dev. Writable: /root (the sandbox home, a host dir that persists across commands until
    close(); as root a tmpfs of limits.max_disk_bytes), and /tmp, /run and /dev/shm, which are
    size-capped tmpfs mounts private to each command. No capabilities, a fresh
    pid/ipc/uts/net/user namespace per command, no host environment variables. network="full"
    keeps its own network namespace too, given the internet (not the host) by slirp4netns
    (usernet.py). As root, every command also runs in the sandbox's own memory cgroup
    (limits.max_total_memory_bytes for all it forks; totals.py). Everything a command starts dies when the command exits: use
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

import dataclasses
import fcntl
import functools
import logging
import os
import posixpath
import random
import resource
import shutil
import signal
import stat
import subprocess
import threading
import time

from pi_env.sandbox.base import (
    GATEWAY_SOCKET,
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    EnvironmentSpec,
    EnvironmentUnsupported,
    Network,
    SandboxError,
    SandboxLimits,
    SandboxSpec,
    SandboxUnavailable,
)
from pi_env.sandbox.hostdir import HostDirSandbox
from pi_env.sandbox.layers import DOCKER_CAPS, Layer, ensure_layer, parse_dockerfile, unsupported_base
from pi_env.sandbox.owned_dirs import (
    default_root,
    discard_host_dir,
    make_dir,
    make_host_dir,
    private_dir,
    sweep_stale_host_dirs,
)
from pi_env.sandbox.processes import LocalProcess, sandbox_rlimits, shell
from pi_env.sandbox.totals import SandboxCgroup, sandbox_cgroup
from pi_env.sandbox.usernet import RESOLV_CONF, UserNet, slirp4netns

__all__ = ["LocalProcess", "LocalSandbox", "LocalSandboxBackend", "default_root"]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "Install bubblewrap (`apt-get install bubblewrap` on Debian/Ubuntu, `dnf install bubblewrap` "
    "on Fedora/RHEL), or opt in explicitly to the `unsafe-local` backend, which runs commands "
    "directly on this machine without any isolation."
)
DEFAULT_UID_RANGE = (200000, 259999)
SMALL_TMPFS_BYTES = 64 << 20  # /run and /dev/shm
KILL_WAIT_S = 5.0  # how long a killed sandbox may take to disappear

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
_PASSWD = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
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


def init_argv(command: str | list[str]) -> list[str]:
    """The argv that runs `command` (a str through the shell) under a shell fit to be the
    namespace's init (also the podman backend's container init)."""
    if isinstance(command, str):
        return [shell(), "-c", _INIT_PREFIX + command]
    if command:  # any POSIX shell can be the init here, and sh starts faster than bash
        return ["/bin/sh", "-c", _INIT_PREFIX + '"$@"', "sh", *command]
    raise ValueError("empty command")


_PRLIMIT_OPTIONS = {
    resource.RLIMIT_NPROC: "--nproc",
    resource.RLIMIT_FSIZE: "--fsize",
    resource.RLIMIT_NOFILE: "--nofile",
    resource.RLIMIT_CORE: "--core",
    resource.RLIMIT_DATA: "--data",
}


# ---------------------------------------------------------------------------------------------
# Facts about the host, computed once per process


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


def _make_userns(uid: int, nobody_uid: int) -> int:
    """An fd of a new user namespace owned by `uid` (so bwrap running as `uid` may join it) with
    0 -> uid and 65534 -> nobody_uid, for uids and gids. Writing a map of other ids than one's
    own needs CAP_SETUID in the parent namespace: we are root."""
    holder = subprocess.Popen(
        [*_as_user(uid), "unshare", "--user", "sleep", "60"],
        cwd="/",
        env={},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        mine = os.stat("/proc/self/ns/user").st_ino
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{holder.pid}/ns/user").st_ino == mine or _comm(holder.pid) != "sleep":
            if holder.poll() is not None or time.monotonic() > deadline:
                assert holder.stderr is not None  # stderr=PIPE
                raise SandboxError(f"could not make a user namespace: {holder.stderr.read().decode()[-300:]}")
            time.sleep(0.001)
        mapping = f"0 {uid} 1\n65534 {nobody_uid} 1\n".encode()
        for name in ("uid_map", "gid_map"):
            fd = os.open(f"/proc/{holder.pid}/{name}", os.O_WRONLY)
            try:
                os.write(fd, mapping)  # one write: a map is written once, whole
            finally:
                os.close(fd)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _copy_tree(source: str, target: str, owner: int | None) -> None:
    """What the layer build left in the work dir, copied into a new sandbox's work dir (owned by
    the sandbox uid); in-process: a process spawn would cost more than a small tree."""
    for root, dirs, files in os.walk(source):
        rel = os.path.relpath(root, source)
        into = target if rel == "." else os.path.join(target, rel)
        if rel != ".":
            os.mkdir(into, stat.S_IMODE(os.stat(root).st_mode) | 0o700)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            dest = os.path.join(into, name)
            if os.path.islink(path):
                os.symlink(os.readlink(path), dest)
            else:
                shutil.copy2(path, dest)
            if owner is not None:
                os.lchown(dest, owner, owner)
        if owner is not None and rel != ".":
            os.chown(into, owner, owner)


def _make_mount_points(layer: Layer, ro_mounts: dict[str, str]) -> None:
    """bwrap cannot create a mount point inside a read-only bind: make those of `ro_mounts` (the
    Pi runtime under /opt, say) inside the layer's own dirs beforehand."""
    for target, source in ro_mounts.items():
        for top, host in layer.mounts.items():
            if target.startswith(top + "/") and not host.startswith(os.path.join(layer.path, "view")):
                point = os.path.join(host, os.path.relpath(target, top))
                if os.path.isdir(source):
                    os.makedirs(point, mode=0o755, exist_ok=True)
                elif not os.path.exists(point):
                    os.makedirs(os.path.dirname(point), mode=0o755, exist_ok=True)
                    open(point, "a").close()


def _layer_info(layer: Layer | None) -> dict | None:
    if layer is None:
        return None
    return {"layer": layer.key, "built_now": layer.built_now, "build_s": layer.build_s, "workdir": layer.workdir}


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
    uids = _sandbox_uids()
    start = random.randrange(len(uids))  # concurrent allocators rarely probe the same locks
    for i in range(len(uids)):
        if lease := _try_lease(uids[(start + i) % len(uids)]):
            return lease
    raise SandboxError(f"all {len(uids)} sandbox uids are in use (see PI_ENV_SANDBOX_UIDS)")


def _try_lease(uid: int) -> _UidLease | None:
    """The lease of `uid`, or None while somebody holds it."""
    lock_dir = "/run/lock/pi-env-uids" if os.path.isdir("/run/lock") else "/tmp/pi-env-uids"
    private_dir(lock_dir, 0o700)
    fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return _UidLease(uid, fd)


def _kill_all_of(uid: int) -> None:
    # kill(-1, SIGKILL) as the uid reaches every process of that uid in every session and
    # namespace, atomically with respect to fork(): no fork bomb outruns it.
    subprocess.run(
        [*_as_user(uid), "/bin/sh", "-c", "kill -9 -1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
        env={},
    )


def _reclaim_uid_of(host_dir: str) -> None:
    """Before a dead owner's sandbox dir is swept: kill whatever still runs as its uid, unless
    the uid is leased again (then the pid namespaces of the dead sandbox are long gone)."""
    try:
        uid = os.lstat(os.path.join(host_dir, "home")).st_uid
    except FileNotFoundError:
        return  # died before its home was made: nothing ever ran
    if uid not in _sandbox_uids() or not (lease := _try_lease(uid)):
        return
    try:
        _kill_all_of(uid)
    finally:
        lease.release()


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


# ---------------------------------------------------------------------------------------------
# Killing a sandboxed command (see LocalSandbox._terminate)


def _kill_children(pid: int) -> bool:
    """SIGKILL every child of `pid`, each through a pidfd; whether any was killed."""
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


# ---------------------------------------------------------------------------------------------
# The bubblewrap sandbox


class LocalSandbox(HostDirSandbox):
    """A sandbox whose commands each run in a fresh bwrap namespace set (see the module doc)."""

    def __init__(
        self,
        host_dir: str,
        spec: SandboxSpec,
        ro_mounts: dict[str, str],
        gateway_socket: str | None,
        bwrap: str,
        lease: _UidLease | None,
        lock_fd: int,
        cgroup: SandboxCgroup | None = None,
        nobody: _UidLease | None = None,
    ):
        """ro_mounts and gateway_socket: host paths that bwrap can bind as the sandbox uid;
        cgroup: the sandbox's own (memory and process totals), entered by every command;
        nobody: a second uid lease, for container_root (uid 65534 inside)."""
        owner = lease.uid if lease else None
        super().__init__(host_dir, owner, lock_fd)
        self.cgroup = cgroup
        self._nobody = nobody
        self._userns_fd: int | None = None
        self.environment_info: dict | None = None  # the environment layer's, set by LocalBackend.create
        self.uid = lease.uid if lease else os.getuid()  # the host uid its processes run as
        self._spec = spec
        self._bwrap = bwrap
        self._lease = lease
        # prlimit rather than Popen(preexec_fn=...), so that Popen can vfork (as in _as_user).
        rlimits = sandbox_rlimits(spec.limits, exclusive_uid=lease is not None)
        self._launcher = [
            *(cgroup.join_command() if cgroup else []),
            *_as_user(owner),
            "prlimit",
            *(f"{_PRLIMIT_OPTIONS[res]}={value}" for res, value in rlimits.items()),
            "--",
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
        pass_fds: tuple[int, ...] = ()
        if self._nobody is not None and network != "gateway":  # root of a container (see container_root)
            fd = self._container_userns(self._nobody)
            argv = [
                *self._launcher,
                self._bwrap,
                "--userns",
                str(fd),
                "--unshare-pid",
                "--unshare-ipc",
                "--unshare-uts",
                "--unshare-cgroup-try",
                "--unshare-net",
                *_SANDBOX_FLAGS,
                *(arg for cap in DOCKER_CAPS for arg in ("--cap-add", cap)),
                *self._mount_args,
            ]
            pass_fds = (fd,)
        else:
            argv = [*self._launcher, self._bwrap, "--unshare-all", *_SANDBOX_FLAGS, *self._mount_args]
        usernet = None
        if network == "full":  # a network namespace of its own, given the internet by slirp4netns
            usernet = UserNet()
            argv += [*usernet.bwrap_args(), "--ro-bind", f"{self.host_dir}/files/resolv.conf", "/etc/resolv.conf"]
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
        argv += ["--", *init_argv(command)]
        # env={}: bwrap itself needs nothing from the host environment.
        if usernet is None:
            return {"args": argv, "cwd": "/", "env": {}, **({"pass_fds": pass_fds} if pass_fds else {})}
        return {"args": argv, "cwd": "/", "env": {}, "pass_fds": (*usernet.pass_fds, *pass_fds), "usernet": usernet}

    def _container_userns(self, nobody: _UidLease) -> int:
        """A user namespace (made once per sandbox) owned by the sandbox uid, with uid/gid 0
        mapped to it and 65534 (nobody) to the second leased uid: setuid to nobody, chown and
        su work inside, while on the host every process stays one of two unprivileged uids."""
        with self._lock:
            if self._userns_fd is None:
                self._userns_fd = _make_userns(self.uid, nobody.uid)
            return self._userns_fd

    def _terminate(self, popen: subprocess.Popen) -> None:
        """Kill one sandboxed command and everything it started.

        SIGKILL to the pid namespace's init (bwrap's only child) makes the kernel kill every
        process of the namespace, setsid and double-fork escapes included; bwrap reaps it and
        exits. Killing bwrap first would work too (its child has a parent-death signal) but
        would leave that child as a zombie for the host's init, counted against RLIMIT_NPROC
        until reaped.
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

    def _kill_leftovers(self) -> None:
        # Belt and braces: the pid namespaces already took everything down with their init.
        for lease in (self._lease, self._nobody):
            if lease:
                _kill_all_of(lease.uid)

    def _release(self) -> None:
        try:
            if self.cgroup:
                self.cgroup.remove()
        finally:
            if self._userns_fd is not None:
                os.close(self._userns_fd)
            for lease in (self._lease, self._nobody):
                if lease:
                    lease.release()


class LocalSandboxBackend:
    """Sandboxes on bubblewrap (Dockerfile environments as layers, see layers.py). Raises SandboxUnavailable when bwrap is missing or cannot
    create user namespaces here."""

    name = "local"
    builds_environments = True

    def __init__(self, root: str | None = None, *, bwrap: str = "bwrap"):
        found = shutil.which(bwrap)
        if found is None:
            raise SandboxUnavailable(f"bubblewrap ({bwrap!r}) was not found. {INSTALL_HINT}")
        self._bwrap = found
        self._as_root = os.geteuid() == 0
        for tool in ("setpriv", "prlimit") if self._as_root else ("prlimit",):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"`{tool}` (util-linux) is not installed; install util-linux")
        self.root = root or default_root()
        private_dir(self.root, 0o711)
        if self._as_root and (why := _unreachable_why(os.path.abspath(self.root), readable=False)):
            raise SandboxError(f"sandbox uids cannot reach the sandbox root {self.root}: {why}")
        _check_user_namespaces(self._bwrap, self._as_root)
        slirp4netns()  # SandboxUnavailable with advice, rather than on the first setup command
        sweep_stale_host_dirs(self.root, _reclaim_uid_of if self._as_root else None)

    def create(self, spec: SandboxSpec) -> LocalSandbox:
        for target in (*spec.ro_mounts, *spec.agent_masked_paths):
            if not posixpath.isabs(target) or posixpath.normpath(target) != target:
                raise ValueError(f"sandbox path {target!r} must be a normalised absolute path")
        layer = self._layer(spec.environment) if spec.environment else None
        if layer:
            _make_mount_points(layer, spec.ro_mounts)
            spec = dataclasses.replace(
                spec, ro_mounts={**layer.mounts, **spec.ro_mounts}, env={**layer.env, **spec.env}
            )
        lease = _lease_uid() if self._as_root else None
        nobody = _lease_uid() if lease and spec.container_root else None
        host_dir: str | None = None
        lock_fd: int | None = None
        cgroup: SandboxCgroup | None = None
        try:
            host_dir, lock_fd = make_host_dir(self.root, lease.uid if lease else None, spec.limits.max_disk_bytes)
            cgroup = sandbox_cgroup(os.path.basename(host_dir), spec.limits)
            if nobody:  # nobody must reach the work dir, as in a container where /app is not under /root
                os.chmod(os.path.join(host_dir, "home"), 0o711)
            if layer and layer.workdir_tree:
                _copy_tree(layer.workdir_tree, os.path.join(host_dir, "home", "workdir"), lease.uid if lease else None)
            # files/: what the sandbox sees read-only (root-owned, outside its home)
            make_dir(os.path.join(host_dir, "files"), 0o755)
            for name, content in (("passwd", _PASSWD), ("group", _GROUP), ("resolv.conf", RESOLV_CONF)):
                with open(os.path.join(host_dir, "files", name), "w") as f:
                    f.write(content)
                    os.fchmod(f.fileno(), 0o644)
            mounts = self._ro_mount_sources(spec.ro_mounts, host_dir, lease)
            socket = self._gateway_socket(spec.gateway_socket, host_dir, lease)
            sandbox = LocalSandbox(host_dir, spec, mounts, socket, self._bwrap, lease, lock_fd, cgroup, nobody)
            sandbox.environment_info = _layer_info(layer)
            return sandbox
        except BaseException:
            if cgroup:
                cgroup.remove()
            if host_dir and lock_fd is not None:  # make_host_dir sets both
                discard_host_dir(host_dir, lock_fd)
            for claimed in (lease, nobody):
                if claimed:
                    claimed.release()
            raise

    def _layer(self, environment: EnvironmentSpec) -> Layer:
        """The environment layer of a Dockerfile (built once, then from the cache)."""
        if environment.image or not environment.dockerfile:
            raise EnvironmentUnsupported(
                f"image {environment.image!r}: the local backend builds Dockerfiles "
                "into layers and cannot run images; use --backend podman"
            )
        with open(environment.dockerfile, encoding="utf-8") as f:
            plan = parse_dockerfile(f.read())
        if why := unsupported_base(plan):
            raise EnvironmentUnsupported("; ".join(why))
        return ensure_layer(
            plan,
            environment.context or os.path.dirname(environment.dockerfile),
            bwrap=self._bwrap,
            timeout_s=environment.build_timeout_s,
        )

    def _ro_mount_sources(self, ro_mounts: dict[str, str], host_dir: str, lease: _UidLease | None) -> dict[str, str]:
        """Sandbox path -> host path bwrap can bind as the sandbox uid."""
        sources: dict[str, str] = {}
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

    def _gateway_socket(self, socket: str | None, host_dir: str, lease: _UidLease | None) -> str | None:
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
        make_dir(private, 0o700, lease.uid)  # only the sandbox uid (and root) can enter
        link = os.path.join(private, "gateway.sock")
        try:
            os.link(socket, link)
            return link
        except OSError:  # another filesystem: bind it from where it is
            if why := _unreachable_why(os.path.abspath(socket), readable=False):
                raise SandboxError(f"sandbox uids cannot reach the gateway socket: {why}") from None
            return socket
