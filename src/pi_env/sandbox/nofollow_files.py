"""Host-side file access to a sandbox's home that never follows a symlink.

Whatever runs in a host-dir sandbox can change its home under the host's feet: plant a symlink
to the host's /etc, a FIFO, a hard link, a tree deeper than the stack. What lives here reaches
the home one path component at a time with O_NOFOLLOW, so a symlink a command planted is never
followed on the host; writes go to a new file renamed over the target, so an existing symlink,
FIFO or hard link is replaced rather than written through; reads open with O_NONBLOCK, so a FIFO
cannot hang the host; walks and deletions are iterative with at most WALK_MAX_DEPTH directories
open. HomeFiles is HostDirSandbox's file methods (hostdir.py); delete_tree deletes a whole host
dir (owned_dirs.py), relative_to_home maps sandbox paths for the remote backends too.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import secrets
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from pi_env.sandbox.base import SANDBOX_HOME, SANDBOX_WORKDIR
from pi_env.sandbox.totals import unmount_all

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO the sandbox planted must not hang the host.
_FILE_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Host-side walks of a sandbox tree hold at most this many directories open: snapshot() does
# not look deeper; deletion moves deeper subtrees up first.
WALK_MAX_DEPTH = 64


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


class HomeFiles:
    """write_file, read_file, exists, remove and snapshot of a sandbox whose home is the open
    directory `_home_fd` (see the module doc). The sandbox that mixes it in (HostDirSandbox)
    sets `_home_fd` and `_owner` (the uid and gid that must own what the host creates; None:
    ours) and says in _check_open() whether it is still open."""

    _home_fd: int
    _owner: int | None

    def _check_open(self) -> None:
        raise NotImplementedError

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
