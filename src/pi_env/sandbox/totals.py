"""Totals a sandbox cannot exhaust, whatever it forks or writes: a memory total (and a process
total) through a cgroup of its own, and a disk total through a size-capped filesystem for its
home. RLIMITs are per process; these are per sandbox.

Memory: the cgroup `memory` controller, v1 (memory.limit_in_bytes) or v2 (memory.max), with
swap held to the same total; `pids` alongside it when present. The cgroup is made below the
cgroup this process runs in, so it needs that cgroup to be writable (root, or a delegated v2
subtree with the controllers enabled for children). Where neither works, `host_totals()` says
so; the caller warns once and records it in the result.

Disk: the sandbox home (its /root, work dir included) is a tmpfs mounted with `size=`, so a
write past the total fails with ENOSPC inside the sandbox and never fills the host's disk;
teardown is an unmount. tmpfs lives in memory: what the sandbox writes there is charged to its
memory cgroup, so the memory total bounds it as well. Needs root (mount); without it the home
is a plain directory and `host_totals()` says so.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
CGROUP_PREFIX = "pi-env-"
_RMDIR_WAIT_S = 2.0  # a killed process leaves its cgroup a moment after it is reaped


@dataclass(frozen=True)
class HostTotals:
    """What this host can enforce per sandbox, and why not when it cannot."""

    memory: str | None  # "cgroup v1" / "cgroup v2", None: not enforced
    disk: str | None  # "tmpfs", None: not enforced
    why_not: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        done = [
            f"memory total by {self.memory}" if self.memory else "NO memory total",
            f"disk total by {self.disk}" if self.disk else "NO disk total",
        ]
        return "; ".join(done) + (f" ({'; '.join(self.why_not)})" if self.why_not else "")


# ---------------------------------------------------------------------------------------------
# cgroups


@functools.cache
def _cgroup_parents() -> tuple[str, dict[str, str]] | str:
    """("v1"|"v2", controller -> the directory new sandbox cgroups go under), or why none."""
    own: dict[str, str] = {}  # controller ("" for v2) -> path of this process's cgroup
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    own[controller] = path
        mounts: dict[str, str] = {}  # controller -> mount point
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                fstype = fields[fields.index("-") + 1]
                options = fields[fields.index("-") + 3].split(",")
                if fstype == "cgroup":
                    for controller in ("memory", "pids"):
                        if controller in options:
                            mounts[controller] = fields[4]
                elif fstype == "cgroup2":
                    mounts.setdefault("", fields[4])
    except (OSError, ValueError, IndexError) as error:
        return f"cannot read this process's cgroups: {error}"
    if "memory" in mounts and "memory" in own:  # v1 (also on hybrid hosts: v1 has the memory controller)
        parents: dict[str, str] = {
            c: os.path.join(mounts[c], own[c].lstrip("/")) for c in ("memory", "pids") if c in mounts and c in own
        }
        if not os.access(parents["memory"], os.W_OK):
            return f"the memory cgroup {parents['memory']} is not writable (run as root)"
        return "v1", parents
    if "" in mounts and "" in own:
        parent = os.path.join(mounts[""], own[""].lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.controllers")) as f:
                available = f.read().split()
        except OSError as error:
            return f"cgroup v2 at {parent} is unreadable: {error}"
        if "memory" not in available:
            return f"cgroup v2 at {parent} has no memory controller delegated to it"
        try:  # children get the controllers only if the parent enables them for its subtree
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in ("memory", "pids") if c in available))
        except OSError as error:
            return (
                f"cannot enable the memory controller below {parent} ({error.strerror}); a v2 cgroup with "
                "processes of its own cannot delegate it: run pi-env in a cgroup of its own (systemd-run --scope "
                "-p Delegate=yes, or a container with a private cgroup namespace)"
            )
        return "v2", {"memory": parent, "pids": parent}
    return "no memory cgroup controller is mounted (neither v1 nor v2)"


class SandboxCgroup:
    """One sandbox's cgroup(s). `join_command` puts the process running it in them, so that
    everything it starts is counted (its children inherit the cgroup)."""

    def __init__(self, name: str, memory_bytes: int, max_processes: int | None):
        found = _cgroup_parents()
        assert not isinstance(found, str), "callers check host_totals() first: it says why there is no cgroup"
        version, parents = found
        self.dirs: list[str] = []
        try:
            for controller, parent in sorted(set(parents.items()), key=lambda kv: kv[0] != "memory"):
                path = os.path.join(parent, CGROUP_PREFIX + name)
                if path in self.dirs:
                    continue
                os.mkdir(path)
                self.dirs.append(path)
                if controller == "memory" or version == "v2":
                    self._write_memory(path, version, memory_bytes)
                if max_processes is not None and (controller == "pids" or version == "v2"):
                    _write(path, "pids.max", str(max_processes), optional=True)
        except BaseException:
            self.remove()
            raise

    @staticmethod
    def _write_memory(path: str, version: str, memory_bytes: int) -> None:
        if version == "v1":
            _write(path, "memory.limit_in_bytes", str(memory_bytes))
            # memory+swap: no escape into swap (only where swap accounting exists)
            _write(path, "memory.memsw.limit_in_bytes", str(memory_bytes), optional=True)
        else:
            _write(path, "memory.max", str(memory_bytes))
            _write(path, "memory.swap.max", "0", optional=True)

    def join_command(self) -> list[str]:
        """A command prefix that enters the cgroups, then execs the rest (run as root, before
        dropping to the sandbox uid: moving a process needs write access to cgroup.procs)."""
        script = "".join(f"echo $$ > {path}/cgroup.procs && " for path in self.dirs) + 'exec "$@"'
        return ["/bin/sh", "-c", script, "sh"]

    def memory_failures(self) -> int:
        """How often the memory total was hit (v1 failcnt; v2 the oom events)."""
        if not self.dirs:
            return 0
        memory = self.dirs[0]
        for name, key in (("memory.failcnt", None), ("memory.events", "max")):
            try:
                with open(os.path.join(memory, name)) as f:
                    text = f.read()
            except OSError:
                continue
            if key is None:
                return int(text.strip() or 0)
            return next((int(line.split()[1]) for line in text.splitlines() if line.startswith(key + " ")), 0)
        return 0

    def remove(self) -> None:
        """Delete the cgroups (call after every process in them is dead)."""
        for path in reversed(self.dirs):
            deadline = time.monotonic() + _RMDIR_WAIT_S
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("could not remove cgroup %s: %s", path, error)
                        break
                    time.sleep(0.01)
        self.dirs = []


def sandbox_cgroup(name: str, limits) -> SandboxCgroup | None:
    """The cgroup of a new sandbox with `limits` (SandboxLimits), or None when it asks for no
    memory total or the host cannot give one (host_totals() has warned)."""
    if limits.max_total_memory_bytes is None or not host_totals().memory:
        return None
    # pids counts threads too (node alone runs about a dozen): RLIMIT_NPROC bounds processes.
    return SandboxCgroup(name, limits.max_total_memory_bytes, 4 * limits.max_processes)


def _write(directory: str, name: str, value: str, *, optional: bool = False) -> None:
    try:
        with open(os.path.join(directory, name), "w") as f:
            f.write(value)
    except FileNotFoundError:
        if not optional:
            raise


def sweep_stale_cgroups(names: set[str]) -> None:
    """Remove the sandbox cgroups named `CGROUP_PREFIX + name` (dead owners' sandboxes)."""
    parents = _cgroup_parents()
    if isinstance(parents, str):
        return
    for parent in set(parents[1].values()):
        for name in names:
            path = os.path.join(parent, CGROUP_PREFIX + name)
            try:
                os.rmdir(path)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# A size-capped home


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


# Inodes of a capped home: one per 32 KiB of its size (10 GiB: 327,680), never fewer than
# 16,384. Each costs host memory that the size does not count (an uncapped tmpfs let an agent
# make millions of empty files: ~2.5 GB of host memory).
BYTES_PER_INODE, MIN_INODES = 32 << 10, 16384


def home_inodes(size_bytes: int) -> int:
    return max(MIN_INODES, size_bytes // BYTES_PER_INODE)


def mount_capped_home(path: str, size_bytes: int, owner: int | None) -> None:
    """Mount a tmpfs of `size_bytes` and home_inodes(size_bytes) inodes at `path` (mode 0700,
    owned by `owner`)."""
    options = f"size={size_bytes},nr_inodes={home_inodes(size_bytes)},mode=0700" + (
        f",uid={owner},gid={owner}" if owner is not None else ""
    )
    if _libc().mount(b"pi-env-home", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mounting a {size_bytes}-byte tmpfs at {path}: {os.strerror(code)}")


def unmount_home(path: str) -> bool:
    """Detach the tmpfs at `path` (its content is freed with it); False if none was mounted."""
    if _libc().umount2(path.encode(), _MNT_DETACH) == 0:
        return True
    code = ctypes.get_errno()
    if code not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point
        log.warning("could not unmount %s: %s", path, os.strerror(code))
    return False


def unmount_all(path: str) -> int:
    """Detach every mount at or below `path`, deepest first, stacked ones included, so the tree
    can be deleted (rmdir of a mount point is EBUSY). Lazy (MNT_DETACH): a process still inside
    does not stop it. Returns how many were detached."""
    detached = 0
    for _ in range(64):  # each pass detaches the top of every stack; a bound against a mount storm
        points = mount_points_under(path)
        if not points:
            break
        progress = False
        for point in sorted(points, key=lambda p: p.count("/"), reverse=True):
            if unmount_home(point):
                detached += 1
                progress = True
        if not progress:
            break
    return detached


def mount_points_under(path: str) -> list[str]:
    """This mount namespace's mount points at or below `path` (one entry per stacked mount)."""
    path = os.path.realpath(path)
    found = []
    try:
        with open("/proc/self/mountinfo") as mountinfo:
            for line in mountinfo:
                # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
                point = _unescape_mount_field(line.split(" ", 5)[4])
                if point == path or point.startswith(path.rstrip("/") + "/"):
                    found.append(point)
    except OSError:
        return []
    return found


def _unescape_mount_field(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


@functools.cache
def _can_mount_tmpfs() -> str | None:
    """None if this process can mount a tmpfs, else why not."""
    if os.geteuid() != 0:
        return "not root: the sandbox home cannot be a size-capped tmpfs"
    import tempfile

    probe = tempfile.mkdtemp(prefix="pi-env-mount-probe-")
    try:
        mount_capped_home(probe, 1 << 20, None)
        unmount_home(probe)
        return None
    except OSError as error:
        return f"cannot mount a tmpfs ({error.strerror or error})"
    finally:
        os.rmdir(probe)


@functools.cache
def host_totals() -> HostTotals:
    """What every sandbox of this process gets (computed once)."""
    why_not = []
    parents = _cgroup_parents()
    memory = None
    if isinstance(parents, str):
        why_not.append(parents)
    else:
        memory = f"cgroup {parents[0]}"
    disk_problem = _can_mount_tmpfs()
    if disk_problem:
        why_not.append(disk_problem)
    totals = HostTotals(memory=memory, disk=None if disk_problem else "tmpfs", why_not=tuple(why_not))
    if why_not:
        log.warning("pi-env sandboxes on this host: %s", totals.describe())
    return totals
