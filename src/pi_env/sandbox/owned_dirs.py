"""Host dirs and their owners' locks: a sandbox's `<root>/sb-<id>/` (and the gateway's dirs)
made, discarded, and swept once their owner died.

A dir `<root>/<prefix><random>/` belongs to the process that holds the flock of its lock file
`<dir>.lock`: the lock is taken before the dir exists and held until the dir is deleted, so a
dir whose lock is free belongs to a process that died without closing it (SIGKILL, OOM, power
loss), and the next backend on that root deletes it (sweep_stale_host_dirs; podman.py reads the
lock files too, to find the containers of dead owners). make_host_dir lays out a sandbox's dir:
home/ (the sandbox's /root, a size-capped tmpfs where the host allows it) and home/workdir/.
The root itself must be a real dir of ours (private_dir): the default one (default_root) sits
in a world-writable /tmp.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable

from pi_env.sandbox.base import SandboxError
from pi_env.sandbox.nofollow_files import delete_tree
from pi_env.sandbox.totals import host_totals, mount_capped_home, sweep_stale_cgroups, unmount_all

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"  # <root>/sb-<id>.lock: flocked while <root>/sb-<id>/ has a living owner
STALE_LOCK_AGE_S = 60.0  # a younger free lock may be one being created right now
UNLOCKED_DIR_AGE_S = 86400.0  # a sandbox dir without a lock file (older pi-env) is dead after this


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
