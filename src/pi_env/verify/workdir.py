"""The agent's final work dir kept for `pi-env reverify`, and put back into a fresh sandbox.

`capture_workdir` (after the agent, before verify: the tree verify is about to see) reads the
work dir the way the result's files are read (`Sandbox.snapshot`: host-side, no symlink
followed, bounded), plus a listing made in the sandbox of what a snapshot cannot hold (symlinks
with their targets, empty dirs, which files are executable) and of how much there is. The tree
is kept only when it is whole within `WorkdirLimits`: every regular file read, no special file;
otherwise `KeptWorkdir.reason` says why it was not kept (reverify then leaves that rollout
unscored with the reason, never 0).

`read_archive` is the other side: the archive is the agent's content, so it is read in memory
(never extracted on the host) and refused (`UnsafeArchive`) unless every member is a relative,
normalised path with no `..`, not below a symlink or a file of the archive, a regular file, dir
or symlink (no hard link, device or fifo), within the file count and byte limits (decompressed
bytes counted as they are read, so a compression bomb stops at the limit). `restore_workdir`
writes the entries into a sandbox through the sandbox API (`write_file`, which never follows
what is in the way) and makes dirs and symlinks with one command inside the sandbox, symlinks
last: a symlink's target, wherever it points, is only ever followed by sandboxed commands, as
it was when the agent made it.
"""

from __future__ import annotations

import gzip
import io
import posixpath
import tarfile
from dataclasses import dataclass
from typing import Literal

from ..errors import BadInputError
from ..sandbox import SANDBOX_HOME, SANDBOX_WORKDIR, Sandbox
from ..sandbox.base import HostPaths

OWN_ENV = {"PATH": "/usr/bin:/bin", "BASH_ENV": "", "ENV": "", "LC_ALL": "C"}
LISTING_MAX_BYTES = 256 << 10  # symlinks, empty dirs and executables, NUL-separated (hex doubles it)
HEADER_ALLOWANCE = 4 << 10  # decompressed archive bytes allowed per entry beyond its data (headers)


@dataclass(frozen=True)
class WorkdirLimits:
    """How much of a work dir is kept: entries (files, dirs, symlinks) and regular files' bytes."""

    max_files: int = 20_000
    max_bytes: int = 64 << 20


@dataclass(frozen=True)
class WorkdirEntry:
    path: str  # relative to the work dir, normalised
    kind: Literal["file", "dir", "symlink"]
    data: bytes = b""
    mode: int = 0o644
    target: str = ""  # symlinks


@dataclass(frozen=True)
class KeptWorkdir:
    """A captured work dir: the archive (tar.gz), or None and why it was not kept."""

    archive: bytes | None
    files: int = 0
    bytes: int = 0
    reason: str | None = None


class UnsafeArchive(BadInputError, ValueError):
    """A kept work dir that is not a plain tree within the limits (the message says what)."""


# -- capture --------------------------------------------------------------------------------

# COUNTS <files> <dirs> <symlinks> <other> <file bytes>, then the listing as hex of
# NUL-separated fields: L path target | D path (empty dir) | X path (executable file).
_CENSUS = r"""set -u
w=$1 limit=$2
PATH=/usr/bin:/bin
[ -d "$w" ] && [ ! -L "$w" ] || { echo MISSING; exit 0; }
find "$w" -mindepth 1 -printf '%y %s\n' | awk '{n[$1]++; if ($1 == "f") b += $2}
    END {printf "COUNTS %d %d %d %d %.0f\n", n["f"], n["d"], n["l"], NR - n["f"] - n["d"] - n["l"], b}'
printf 'LIST '
find "$w" -mindepth 1 \( -type l -printf 'L\0%P\0%l\0' \) -o \( -type d -empty -printf 'D\0%P\0' \) \
    -o \( -type f -perm /111 -printf 'X\0%P\0' \) | head -c "$limit" | od -An -v -tx1 | tr -d ' \n'
printf '\nEND\n'
"""


def capture_workdir(sandbox: Sandbox, limits: WorkdirLimits, *, read_left: int) -> KeptWorkdir:
    """The work dir as verify is about to see it, archived; or why it is not kept. The host reads
    at most `read_left` bytes (what is left of the rollout's PiConfig.limits.max_read_bytes)."""
    workdir = _in_sandbox(sandbox, SANDBOX_WORKDIR)
    outcome = sandbox.exec(
        ["/bin/bash", "-c", _CENSUS, "pi-env", workdir, str(LISTING_MAX_BYTES + 1)],
        cwd=SANDBOX_HOME,
        env=OWN_ENV,
        timeout_s=120,
        network="none",
    )
    lines = outcome.stdout.splitlines()
    if outcome.exit_code != 0 or not lines or lines[-1] != "END":
        return KeptWorkdir(None, reason=f"could not list the work dir: {(outcome.stderr or outcome.stdout)[-300:]}")
    if lines[0] == "MISSING":
        return KeptWorkdir(None, reason="the work dir is missing (or a symlink)")
    counts = lines[0].split()
    files, dirs, links, other, size = (int(value) for value in counts[1:6])
    if other:
        return KeptWorkdir(None, reason=f"the work dir holds {other} special files (fifos, sockets, devices)")
    if files + dirs + links > limits.max_files:
        return KeptWorkdir(None, reason=f"{files + dirs + links} entries, over the cap of {limits.max_files}")
    if size > limits.max_bytes:
        return KeptWorkdir(None, reason=f"{size} bytes of files, over the cap of {limits.max_bytes}")
    if size > read_left:
        return KeptWorkdir(None, reason=f"{size} bytes of files, over what is left of max_read_bytes ({read_left})")
    listing = bytes.fromhex(lines[1].removeprefix("LIST "))
    if len(listing) > LISTING_MAX_BYTES:
        return KeptWorkdir(None, reason="too many symlinks, empty dirs and executables to list")
    snapshot = sandbox.snapshot(
        SANDBOX_WORKDIR, max_files=files + 1, max_file_bytes=limits.max_bytes, max_total_bytes=size
    )
    if len(snapshot) != files:
        return KeptWorkdir(None, reason=f"{len(snapshot)} of its {files} files could be read (too deep, or changed)")
    fields = listing.split(b"\0")[:-1]
    symlinks: dict[str, str] = {}
    empty_dirs: list[str] = []
    executable: set[str] = set()
    at = 0
    while at < len(fields):
        kind, path = fields[at], _name(fields[at + 1])
        if kind == b"L":
            symlinks[path] = _name(fields[at + 2])
            at += 3
        else:
            (empty_dirs.append(path) if kind == b"D" else executable.add(path))
            at += 2
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as compressed:
        with tarfile.open(fileobj=compressed, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(empty_dirs):
                tar.addfile(_info(path, tarfile.DIRTYPE, 0o755))
            for path, data in sorted(snapshot.items()):
                info = _info(path, tarfile.REGTYPE, 0o755 if path in executable else 0o644)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            for path, target in sorted(symlinks.items()):
                info = _info(path, tarfile.SYMTYPE, 0o777)
                info.linkname = target
                tar.addfile(info)
    return KeptWorkdir(buffer.getvalue(), files=files, bytes=size)


def _info(path: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    info.type, info.mode, info.mtime = kind, mode, 0
    return info


def _name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")  # as os.listdir names them (the snapshot's keys)


# -- restore --------------------------------------------------------------------------------


class _Bounded(io.RawIOBase):
    """A read-only stream that refuses to hand out more than `limit` bytes (a compression bomb)."""

    def __init__(self, stream, limit: int):
        self.stream, self.left = stream, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(min(len(buffer), self.left + 1))
        if len(data) > self.left:
            raise UnsafeArchive("the archive decompresses past its limit")
        self.left -= len(data)
        buffer[: len(data)] = data
        return len(data)


def read_archive(data: bytes, limits: WorkdirLimits) -> list[WorkdirEntry]:
    """A kept work dir's entries, read in memory, or UnsafeArchive saying what is wrong with it."""
    limit = limits.max_bytes + HEADER_ALLOWANCE * (limits.max_files + 2)
    entries: dict[str, WorkdirEntry] = {}
    total = 0
    try:
        stream = _Bounded(gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb"), limit)
        with tarfile.open(fileobj=io.BufferedReader(stream), mode="r|") as tar:
            for member in tar:
                if len(entries) >= limits.max_files:
                    raise UnsafeArchive(f"more than {limits.max_files} entries")
                path = _check_path(member.name)
                if path in entries:
                    raise UnsafeArchive(f"{path!r} is in the archive twice")
                if member.isreg():
                    total += member.size
                    if total > limits.max_bytes:
                        raise UnsafeArchive(f"more than {limits.max_bytes} bytes of files")
                    handle = tar.extractfile(member)
                    content = handle.read(member.size + 1) if handle is not None else b""
                    if len(content) != member.size:
                        raise UnsafeArchive(f"{path!r} is cut short")
                    entries[path] = WorkdirEntry(path, "file", content, 0o755 if member.mode & 0o111 else 0o644)
                elif member.isdir():
                    entries[path] = WorkdirEntry(path, "dir", mode=0o755)
                elif member.issym():
                    if not member.linkname or "\0" in member.linkname:
                        raise UnsafeArchive(f"symlink {path!r} has no target")
                    entries[path] = WorkdirEntry(path, "symlink", target=member.linkname)
                else:
                    raise UnsafeArchive(f"{path!r} is not a file, dir or symlink (a hard link, device or fifo)")
    except (tarfile.TarError, OSError, EOFError, UnicodeError) as error:
        raise UnsafeArchive(f"not a readable tar.gz: {type(error).__name__}: {error}") from None
    leaves = {path for path, entry in entries.items() if entry.kind != "dir"}
    for path in entries:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in leaves:
                raise UnsafeArchive(f"{path!r} is below a file or symlink of the archive")
    return list(entries.values())


def _check_path(name: str) -> str:
    if not name or "\0" in name or name.startswith("/"):
        raise UnsafeArchive(f"{name!r}: not a relative path")
    path = name.removeprefix("./").rstrip("/")
    parts = path.split("/")
    if not path or any(part in ("", ".", "..") for part in parts) or posixpath.normpath(path) != path:
        raise UnsafeArchive(f"{name!r}: not a plain relative path (absolute, empty, '.' or '..')")
    return path


_RESTORE = r"""set -u
w=$1
PATH=/usr/bin:/bin
mkdir -p -- "$w" && cd -- "$w" || exit 1
while IFS= read -r -d '' kind && IFS= read -r -d '' path; do
    if [ "$kind" = L ]; then
        IFS= read -r -d '' target || exit 1
        mkdir -p -- "$(dirname -- "$path")" && ln -s -- "$target" "$path" || exit 1
    else
        mkdir -p -- "$path" || exit 1
    fi
done
"""


def restore_workdir(sandbox: Sandbox, entries: list[WorkdirEntry]) -> None:
    """Replace the sandbox's work dir with `entries` (from read_archive): files through the
    sandbox API, then dirs and symlinks by one command in the sandbox. OSError when it fails."""
    sandbox.remove(SANDBOX_WORKDIR)
    for entry in entries:
        if entry.kind == "file":
            sandbox.write_file(f"{SANDBOX_WORKDIR}/{entry.path}", entry.data, mode=entry.mode)
    fields: list[str] = []
    for entry in sorted(entries, key=lambda e: e.kind != "dir"):  # dirs first, symlinks last
        if entry.kind == "dir":
            fields += ["D", entry.path]
        elif entry.kind == "symlink":
            fields += ["L", entry.path, entry.target]
    stdin = b"".join(field.encode("utf-8", "surrogateescape") + b"\0" for field in fields)
    outcome = sandbox.exec(
        ["/bin/bash", "-c", _RESTORE, "pi-env", _in_sandbox(sandbox, SANDBOX_WORKDIR)],
        cwd=SANDBOX_HOME,
        env=OWN_ENV,
        timeout_s=120,
        network="none",
        stdin=stdin,
    )
    if outcome.exit_code != 0:
        raise OSError(f"could not restore the kept work dir's dirs and symlinks: {outcome.stderr[-300:]}")


def _in_sandbox(sandbox: Sandbox, path: str) -> str:
    """A sandbox path as the sandbox's commands see it (unsafe-local runs on host paths)."""
    return sandbox.host_path(path) if isinstance(sandbox, HostPaths) else path
