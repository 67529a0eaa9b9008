"""`reverify`: score a collected dataset's rollouts again, on their kept work dirs, without
running any agent (NeMo Gym's `reverify`): for a verifier fixed after the data was collected.

Each record of `DATASET` (results.jsonl and discarded.jsonl) whose work dir was kept
(`pi-env collect --keep-workdir`: workdirs.py) is verified again by `PiSessionFactory.reverify`
with its task from `tasks`, matched by task id: a fresh sandbox, the task's files and setup, the
kept work dir written in through the sandbox API (pi_env.verify.workdir: read in memory, refused
when unsafe), then verify exactly as after an agent (verify's clean world, the verifier's files
put back over the agent's, the same hooks).

One line per record goes to a new file beside the dataset (`reverify-<UTC time>.jsonl`, or the
name given; results.jsonl is never touched): id, task id, old reward, new reward, changed, and
when there is no new reward (never 0) the error kind: a `RolloutResult` kind (`infra` after
the retries, `setup_failed`, ...) or one of `REVERIFY_ERROR_KINDS`. Written like the store (one
O_APPEND write + fsync per line, a torn last line cut off on open, one writer: flock), so a
killed run resumes: ids already in the file are skipped. The summary (counts: same, changed,
unscored by kind; tasks missing) is returned, and written to `<name>.summary.json`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import FLAT_KEYS, PiConfig
from ..results import INFRA_ERROR_KINDS, RolloutResult, unscored_result
from ..task import PiTask
from .runner import METADATA, CollectError, _read_json, _write_json
from .store import DISCARDED, RESULTS, read_records
from .workdirs import workdir_file

# Why a record has no new reward beyond a rollout's own error kinds.
REVERIFY_ERROR_KINDS = {
    "task_missing": "its task id is not in the new task set",
    "workdir_not_kept": "its work dir was not kept (collected without --keep-workdir, over a cap, or unscored)",
    "workdir_missing": "its kept work dir file is gone",
    "workdir_mismatch": "its kept work dir file is not the one its record names (size or sha256)",
    "workdir_unsafe": "its kept work dir is not a plain tree within the limits (pi_env.verify.workdir)",
    "multi_step_unsupported": "its task has later steps: only the first step's work dir is kept",
}
OUTPUT_TAIL_CHARS = 2000
REWARD_TOLERANCE = 1e-9


@dataclass
class ReverifySummary:
    """What `reverify()` did, over its whole output file (a resumed run's earlier lines included)."""

    out: Path
    summary_path: Path
    records: int = 0  # in the dataset
    already_done: int = 0  # in the output file when the run started (resume)
    ran: int = 0  # re-verified by this run
    same: int = 0  # new reward == old reward
    changed: int = 0  # a new reward that differs (or where the old one was unscored)
    unscored: int = 0  # no new reward (never 0): see unscored_kinds
    unscored_kinds: dict[str, int] = field(default_factory=dict)
    missing_tasks: list[str] = field(default_factory=list)  # the dataset's task ids not in the new task set
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["out"], data["summary_path"] = str(self.out), str(self.summary_path)
        return data


def reverify(
    dataset: str | Path,
    tasks: Iterable[PiTask | dict | str] | str | Path,
    out: str | Path | None = None,
    config: PiConfig | None = None,
    *,
    concurrency: int = 2,
    retries: int = 2,
    sandbox_backend=None,
    progress: Callable[[dict, int, int], None] | None = None,
) -> ReverifySummary:
    """Verify again every rollout of `dataset` whose work dir was kept, with the task of its
    task id from `tasks`; lines go to `out` (default `DATASET/reverify-<UTC time>.jsonl`; a bare
    name is put in DATASET), resumed when it exists. `config`: the dataset's own (its
    metadata.json: backend, limits, timeouts, extra setup and env) unless given. Infrastructure
    failures are retried `retries` times, then left unscored (`infra`). `progress(line, done,
    total)` is called after each line. Raises CollectError for bad input."""
    from ..rollout import PiSessionFactory
    from ..task import load_tasks

    started = time.monotonic()
    dataset = Path(dataset)
    if not (dataset / RESULTS).exists() and not (dataset / DISCARDED).exists():
        raise CollectError(f"{dataset}: no {RESULTS}: not a pi-env collect dataset")
    if concurrency < 1 or retries < 0:
        raise CollectError("concurrency must be >= 1, retries >= 0")
    by_id = _tasks_by_id(load_tasks(tasks) if isinstance(tasks, (str, Path)) else [PiTask.coerce(t) for t in tasks])
    config = config or dataset_config(dataset)
    config = config.model_copy(
        update={"result": config.result.model_copy(update={"keep_workdir": False, "max_files": 0})}
    )
    path = output_path(dataset, out)
    records = list(read_records(dataset, kept_only=False))
    summary = ReverifySummary(out=path, summary_path=path.with_name(path.stem + ".summary.json"), records=len(records))
    with _Output(path) as output:
        summary.already_done = sum(1 for record in records if record["id"] in output.done)
        pending = [record for record in records if record["id"] not in output.done]
        factory = PiSessionFactory(config, sandbox_backend)
        done = summary.already_done
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="pi-env-reverify") as pool:
            waiting: set[Future] = set()
            queue = list(reversed(pending))
            try:
                while queue or waiting:
                    while queue and len(waiting) < concurrency:
                        record = queue.pop()
                        waiting.add(
                            pool.submit(_one, factory, dataset, record, by_id.get(record.get("task_id")), retries)
                        )
                    finished, waiting = wait(waiting, return_when=FIRST_COMPLETED)
                    for future in finished:
                        line = future.result()
                        output.append(line)
                        summary.ran += 1
                        done += 1
                        if progress is not None:
                            progress(line, done, len(records))
            except BaseException:
                for future in waiting:
                    future.cancel()
                raise
        lines = output.lines()
    known = {record["id"] for record in records}
    _count(summary, [line for line in lines if line["id"] in known])
    summary.missing_tasks = sorted({r["task_id"] for r in records if r.get("task_id") not in by_id})
    summary.elapsed_s = round(time.monotonic() - started, 3)
    _write_json(summary.summary_path, summary.as_dict())
    return summary


def dataset_config(dataset: Path) -> PiConfig:
    """The config a dataset was collected with (metadata.json, without secrets), for what verify
    depends on: the backend, limits, timeouts, extra setup and environment."""
    stored = (_read_json(dataset / METADATA) or {}).get("config") or {}
    # In sections, or flat (a dataset collected before them: loaded with a DeprecationWarning).
    known = {*PiConfig.model_fields, *FLAT_KEYS, "proxy_max_tokens_cap"}
    data = {name: value for name, value in stored.items() if name in known and name != "api_key"}
    if isinstance(data.get("endpoint"), dict):
        data["endpoint"] = {name: value for name, value in data["endpoint"].items() if name != "api_key"}
    try:
        return PiConfig.model_validate(data)
    except ValueError as error:
        raise CollectError(f"{dataset / METADATA}: its config cannot be used ({error}); pass one") from None


def output_path(dataset: Path, out: str | Path | None) -> Path:
    """Where the lines go: beside the dataset, never one of its own files."""
    if out is None:
        return dataset / f"reverify-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.jsonl"
    path = Path(out)
    if path.parent == Path("."):  # a bare name: beside the dataset's results
        path = dataset / path
    if path.suffix != ".jsonl":
        raise CollectError(f"--out {out}: give a .jsonl file name (for example reverify-fixed.jsonl)")
    if path.resolve().parent == dataset.resolve() and path.name in (RESULTS, DISCARDED):
        raise CollectError(f"--out {out}: that is the dataset's own {path.name}; reverify never overwrites it")
    return path


def _tasks_by_id(tasks: list[PiTask]) -> dict[str, PiTask]:
    by_id: dict[str, PiTask] = {}
    for task in tasks:
        if task.task_id in by_id:
            raise CollectError(f"task id {task.task_id!r} is twice in the new task set: which one verifies?")
        by_id[task.task_id] = task
    return by_id


def _one(factory, dataset: Path, record: dict, task: PiTask | None, retries: int) -> dict[str, Any]:
    """One record re-verified: its output line."""
    from ..harbor import later_steps
    from ..verify.workdir import UnsafeArchive, WorkdirLimits, read_archive

    started = time.monotonic()
    line: dict[str, Any] = {
        "id": record["id"],
        "task_id": record.get("task_id"),
        "old_reward": record.get("reward"),
        "new_reward": None,
        "changed": None,
        "error_kind": None,
        "error": None,
        "reward_source": None,
        "verify": [],
        "verify_notes": [],
    }

    def unscored(kind: str, why: str) -> dict[str, Any]:
        line["error_kind"], line["error"] = kind, why
        line["wall_s"] = round(time.monotonic() - started, 4)
        return line

    kept = record.get("workdir") if isinstance(record.get("workdir"), dict) else None
    if task is None:
        return unscored("task_missing", f"task {record.get('task_id')!r} is not in the new task set")
    if kept is None or not kept.get("kept"):
        why = (kept or {}).get("reason") or "the dataset was collected without --keep-workdir"
        return unscored("workdir_not_kept", str(why))
    if later_steps(task):
        return unscored("multi_step_unsupported", REVERIFY_ERROR_KINDS["multi_step_unsupported"])
    config = factory.config
    limits = WorkdirLimits(config.result.keep_workdir_max_files, config.result.keep_workdir_max_bytes)
    path = dataset / workdir_file(record["id"])  # from the id, never from the record's text
    try:
        size = path.stat().st_size
        if size != kept.get("bytes"):
            return unscored("workdir_mismatch", f"{path.name}: {size} bytes, its record says {kept.get('bytes')}")
        data = path.read_bytes()
    except FileNotFoundError:
        return unscored("workdir_missing", f"{path} is gone")
    if hashlib.sha256(data).hexdigest() != kept.get("sha256"):
        return unscored("workdir_mismatch", f"{path.name}: its sha256 is not the one its record names")
    try:
        entries = read_archive(data, limits)
    except UnsafeArchive as error:
        return unscored("workdir_unsafe", str(error))
    result = _verify(factory, task, entries)
    for _ in range(retries):
        if result.error_kind not in INFRA_ERROR_KINDS:
            break
        result = _verify(factory, task, entries)
    line["new_reward"], line["reward_source"] = result.reward, result.reward_source
    line["error_kind"], line["error"] = result.error_kind, result.error
    line["verify"] = [
        {
            "cmd": r.cmd[:500],
            "exit_code": r.exit_code,
            "timed_out": r.timed_out,
            "output_tail": (r.stdout + r.stderr)[-OUTPUT_TAIL_CHARS:],
        }
        for r in result.verify_results
    ]
    line["verify_notes"] = result.verify_notes
    line["changed"] = _changed(line["old_reward"], result.reward)
    line["wall_s"] = round(time.monotonic() - started, 4)
    return line


def _verify(factory, task: PiTask, entries) -> RolloutResult:
    try:
        return factory.reverify(task, entries)
    except Exception as error:  # noqa: BLE001 - never a score: see pi_env.errors.unscored
        return unscored_result(task.task_id, error)


def _changed(old: float | None, new: float | None) -> bool | None:
    if new is None:
        return None
    return old is None or abs(new - old) > REWARD_TOLERANCE


def _count(summary: ReverifySummary, lines: list[dict]) -> None:
    kinds = Counter(line.get("error_kind") or "?" for line in lines if line.get("new_reward") is None)
    summary.unscored = sum(kinds.values())
    summary.unscored_kinds = dict(sorted(kinds.items()))
    summary.changed = sum(1 for line in lines if line.get("changed") is True)
    summary.same = sum(1 for line in lines if line.get("changed") is False)


class _Output:
    """The output file: append-only lines (one write + fsync each), a torn tail cut on open,
    the ids already there, one writer (flock)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise CollectError(f"{path}: another reverify is writing it; wait for it or give another --out") from None
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a write cut by a crash
            os.ftruncate(self.fd, end)
            os.fsync(self.fd)
        self._lines: list[dict] = []
        for number, raw in enumerate(data[:end].splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                line = None
            if not isinstance(line, dict) or not isinstance(line.get("id"), str) or "new_reward" not in line:
                os.close(self.fd)
                raise CollectError(f"{path}:{number}: not a reverify line; give another --out")
            self._lines.append(line)
        self.done = {line["id"] for line in self._lines}

    def append(self, line: dict) -> None:
        data = (json.dumps(line, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8", "replace")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        os.fsync(self.fd)
        self._lines.append(line)
        self.done.add(line["id"])

    def lines(self) -> list[dict]:
        return list(self._lines)

    def __enter__(self) -> _Output:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
