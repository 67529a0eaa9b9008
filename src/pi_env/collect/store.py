"""The dataset store: `DIR/results.jsonl` (the kept records) and `DIR/discarded.jsonl` (the
records a `--keep` filter left out, so a resumed run does not redo them).

Append-only, one JSON line per rollout, written with one `write()` on an O_APPEND descriptor
and flushed to the disk before the next rollout is handed out, so a run killed at any moment
(SIGKILL included) loses at most the rollouts in flight. On open, a torn last line (no
newline: the write was cut) is cut off and reported; every complete line must be a record, and
each (task, group index) appears once across both files. One writer at a time: `DIR/.lock`
(flock, released by the kernel when the process dies).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import BadInputError
from ..results import valid_utf8

RESULTS = "results.jsonl"
DISCARDED = "discarded.jsonl"


class StoreError(BadInputError, RuntimeError):
    """The store cannot be used as it is (corrupt line, another writer); the message says what to do."""


class ResultStore:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreError(
                f"{self.directory}: another pi-env collect is writing this store; wait for it or choose another --out"
            ) from None
        self.repaired: dict[str, int] = {}  # file name -> bytes of a torn tail cut off
        self.ids: dict[str, str] = {}  # record id -> file it is in
        for name in (RESULTS, DISCARDED):
            self._load(name)
        self._fds = {
            name: os.open(self.directory / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            for name in (RESULTS, DISCARDED)
        }

    def _load(self, name: str) -> None:
        path = self.directory / name
        if not path.exists():
            return
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # the last write was cut: drop the partial line
            self.repaired[name] = len(data) - end
            with path.open("r+b") as handle:
                handle.truncate(end)
                os.fsync(handle.fileno())
        for number, line in enumerate(data[:end].splitlines(), start=1):
            if line.strip():
                self._remember(parse_record(line, path, number), name, path, number)

    def _remember(self, record: dict, name: str, path: Path, number: int) -> None:
        if record["id"] in self.ids:
            raise StoreError(
                f"{path}:{number}: record {record['id']!r} is already in {self.ids[record['id']]}; "
                "remove one of the two lines"
            )
        self.ids[record["id"]] = name

    def __contains__(self, record_id: str) -> bool:
        return record_id in self.ids

    def append(self, record: dict, *, kept: bool = True) -> None:
        if record["id"] in self.ids:
            raise StoreError(f"record {record['id']!r} is already stored")
        name = RESULTS if kept else DISCARDED
        try:
            text = json.dumps(record, ensure_ascii=False, allow_nan=False)
        except ValueError:  # an engine's -inf logprob: JSON has no such number, a null says "unknown"
            text = json.dumps(_finite(record), ensure_ascii=False, allow_nan=False)
        try:
            data = (text + "\n").encode()
        except UnicodeEncodeError:  # a lone surrogate from the agent: never lose the record for it
            data = (json.dumps(valid_utf8(_finite(record)), ensure_ascii=False, allow_nan=False) + "\n").encode()
        fd = self._fds[name]
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
        self.ids[record["id"]] = name

    def records(self, *, kept_only: bool = True) -> Iterator[dict]:
        yield from read_records(self.directory, kept_only=kept_only)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        os.close(self._lock_fd)

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_records(directory: str | Path, *, kept_only: bool = True) -> Iterator[dict]:
    """Every complete record of a store (a torn last line is skipped, not repaired: readers
    never write). The rules are the writer's: a corrupt line or a record stored twice is a
    StoreError naming the file and line, never skipped or repeated silently."""
    yield from (record for record, _, _ in read_numbered_records(directory, kept_only=kept_only))


def read_numbered_records(directory: str | Path, *, kept_only: bool = True) -> Iterator[tuple[dict, Path, int]]:
    """read_records(), each record with its file and line number (for errors found later)."""
    directory = Path(directory)
    seen: dict[str, str] = {}
    for name in (RESULTS,) if kept_only else (RESULTS, DISCARDED):
        path = directory / name
        if not path.exists():
            continue
        with path.open("rb") as handle:
            for number, line in enumerate(_bounded_lines(handle, path), start=1):
                if not (line.endswith(b"\n") and line.strip()):
                    continue
                record = parse_record(line, path, number)
                if record["id"] in seen:
                    raise StoreError(
                        f"{path}:{number}: record {record['id']!r} is already in {seen[record['id']]}; "
                        "remove one of the two lines"
                    )
                seen[record["id"]] = name
                yield record, path, number


MAX_RECORD_BYTES = 256 << 20
# What every record has, and its JSON type (None allowed where a rollout may lack it).
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "task_id": (str,),
    "group_id": (str,),
    "group_index": (int,),
    "messages": (list,),
    "reward": (int, float, type(None)),
    "synthetic": (bool,),
}


def parse_record(line: bytes, path: Path, number: int) -> dict:
    """One stored line as a record, or a StoreError saying at which file and line and what is wrong."""

    def damaged(why: str) -> StoreError:
        return StoreError(
            f"{path}:{number}: {why}; the store is damaged (fix or remove that line, or collect into a new --out)"
        )

    try:
        record = json.loads(line, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise damaged("not UTF-8") from None
    except RecursionError:
        raise damaged("JSON nested too deeply") from None
    except ValueError as error:
        raise damaged(f"not a JSON record ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        raise damaged(
            "not a pi-env record" + ("" if isinstance(record, dict) else f" (a JSON {type(record).__name__})")
        )
    return record


def check_record_fields(record: dict, path: Path, number: int) -> None:
    """A record a reader uses (an export) has every field of RECORD_FIELDS, of its type."""
    for field, types in RECORD_FIELDS.items():
        value = record.get(field, ...)
        if value is ... or not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            what = "is missing" if value is ... else f"is a {type(value).__name__}"
            raise StoreError(f"{path}:{number}: field {field!r} {what}: not a pi-env record (fix or remove that line)")
    for index, message in enumerate(record["messages"]):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise StoreError(
                f"{path}:{number}: messages[{index}] is not a message (an object with a role): not "
                "a pi-env record (fix or remove that line)"
            )


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _bounded_lines(handle, path: Path) -> Iterator[bytes]:
    while True:
        line = handle.readline(MAX_RECORD_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_RECORD_BYTES:
            raise StoreError(f"{path}: a line longer than {MAX_RECORD_BYTES >> 20} MiB is not a record")
        yield line


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value
