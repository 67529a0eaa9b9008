"""`CollectRunner`: a task set in, a dataset directory out.

Every task is run `group_size` times (group index 0..G-1: a GRPO group). A rollout that failed
for infrastructure reasons (`infra`, `endpoint_error`) is retried up to `retries` times; a low
reward never is. The last attempt's record is stored whatever it is, with the failed attempts
listed in it; an unscored record has `reward=None` and its `error_kind`, so trainers mask it.
Resuming skips every (task, group index) already stored, so a killed run ends, once resumed,
with exactly one record per (task, group index).
"""

from __future__ import annotations

import asyncio
import heapq
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import TRANSPARENT_PROXY, InterceptionGate, PiConfig
from ..errors import BadInputError
from ..results import INFRA_ERROR_KINDS
from ..task import PiTask
from .executors import EndpointUnusable, Job, make_executor
from .records import record_id, to_record
from .store import DISCARDED, RESULTS, ResultStore, StoreError, read_records
from .workdirs import store_workdir

METADATA = "metadata.json"
RETRY_KINDS = INFRA_ERROR_KINDS  # the infrastructure failed, not the agent: retried, never scored
RETRY_BACKOFF_S = (1.0, 4.0, 15.0)


class CollectError(BadInputError, ValueError):
    """Bad input to a collect run (a filter, a store from another config); the message says what to fix."""


@dataclass(frozen=True)
class KeepFilter:
    """Which records a dataset keeps: `all`, `scored` (reward is not None) or `reward>=X`."""

    spec: str = "all"

    @classmethod
    def parse(cls, spec: str) -> KeepFilter:
        spec = spec.strip().replace(" ", "")
        if spec in ("all", "scored") or re.fullmatch(r"reward>=-?\d+(\.\d+)?", spec):
            return cls(spec)
        raise CollectError(f"--keep {spec!r}: give all, scored, or reward>=X (for example reward>=1)")

    def __call__(self, record: dict) -> bool:
        if self.spec == "all":
            return True
        reward = record.get("reward")
        if reward is None:
            return False
        return self.spec == "scored" or reward >= float(self.spec.split(">=")[1])


@dataclass
class CollectSummary:
    """What a `CollectRunner.run()` did: planned, resumed, ran, retried and skipped rollouts."""

    out_dir: Path
    planned: int = 0  # (task, group index) pairs in this run's plan
    already_stored: int = 0  # found in the store when the run started (resume)
    ran: int = 0  # stored by this run
    retried: int = 0  # extra attempts after infra failures
    skipped_tasks: dict[str, list[str]] = field(default_factory=dict)  # task id -> why it was not run
    repaired: dict[str, int] = field(default_factory=dict)  # store file -> bytes of a torn last line cut off
    elapsed_s: float = 0.0
    counts: dict[str, Any] = field(default_factory=dict)  # over the whole store

    @property
    def complete(self) -> bool:
        return self.already_stored + self.ran == self.planned


class CollectRunner:
    """Python API behind `pi-env collect`. `run()` blocks (threads or Ray do the work; no event
    loop is used, so it may be called from inside one); `await arun()` runs it off the loop."""

    def __init__(
        self,
        tasks: Iterable[PiTask | dict | str] | str | Path,
        out_dir: str | Path,
        config: PiConfig | None = None,
        *,
        group_size: int = 1,
        concurrency: int = 4,
        limit: int | None = None,
        retries: int = 2,
        keep: str | KeepFilter = "all",
        executor: str = "local",
        ray_address: str | None = None,
        ray_num_cpus: float = 1.0,
        resume: bool = True,
        include_unsupported: bool = False,
        sandbox_backend=None,
        progress: bool | Callable[[dict, CollectSummary], None] = False,
        retry_backoff_s: Iterable[float] = RETRY_BACKOFF_S,
    ):
        from ..task import load_tasks

        if group_size < 1 or concurrency < 1 or retries < 0 or (limit is not None and limit < 1):
            raise CollectError("group_size, concurrency and limit must be >= 1, retries >= 0")
        tasks = load_tasks(tasks) if isinstance(tasks, (str, Path)) else [PiTask.coerce(t) for t in tasks]
        self.tasks = tasks[:limit] if limit else tasks
        self.out_dir = Path(out_dir)
        self.config = config or PiConfig(mode=TRANSPARENT_PROXY)
        self.group_size, self.concurrency, self.retries = group_size, concurrency, retries
        self.keep = keep if isinstance(keep, KeepFilter) else KeepFilter.parse(keep)
        self.executor_name, self.ray_address, self.ray_num_cpus = executor, ray_address, ray_num_cpus
        self.resume, self.include_unsupported = resume, include_unsupported
        self.sandbox_backend = sandbox_backend
        self.progress = progress
        self.retry_backoff_s = tuple(retry_backoff_s) or (0.0,)

    # -- planning ------------------------------------------------------------------------------
    def _runnable(self, summary: CollectSummary) -> list[PiTask]:
        from ..endpoints import ORACLE
        from ..harbor import unsupported_reasons

        runnable = []
        for task in self.tasks:
            backend = (
                self.sandbox_backend
                if isinstance(self.sandbox_backend, str)
                else getattr(self.sandbox_backend, "name", None) or self.config.sandbox.backend
            )
            why = [] if self.include_unsupported else unsupported_reasons(task, backend)
            if self.config.endpoint.name == ORACLE and not task.solution:
                why.append("no solution: the oracle endpoint replays a task's solution")
            if why:
                summary.skipped_tasks[task.task_id] = why
            else:
                runnable.append(task)
        return runnable

    def _check_store(self, store: ResultStore) -> None:
        metadata = _read_json(self.out_dir / METADATA)
        if store.ids and not self.resume:
            raise CollectError(
                f"{self.out_dir} already holds {len(store.ids)} records; resume (the default) "
                "or collect into a new --out"
            )
        before = (metadata or {}).get("run", {})
        now = self._run_identity()
        changed = {k: (before.get(k), v) for k, v in now.items() if k in before and before[k] != v}
        if store.ids and changed:
            raise CollectError(
                f"{self.out_dir} was collected with other settings {changed} (before, now); "
                "resume with the same settings or collect into a new --out"
            )

    def _run_identity(self) -> dict[str, Any]:
        config = self.config
        return {
            "endpoint": config.redacted()["endpoint"]["name"],  # a URL's user:password masked
            "model": config.endpoint.model,
            "mode": config.mode.name,
            "group_size": self.group_size,
            "keep": self.keep.spec,
        }

    # -- running -------------------------------------------------------------------------------
    def run(self) -> CollectSummary:
        started = time.monotonic()
        self._started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        summary = CollectSummary(out_dir=self.out_dir)
        try:
            store = ResultStore(self.out_dir)
        except StoreError as error:
            raise CollectError(str(error)) from None
        summary.repaired = dict(store.repaired)
        try:
            self._check_store(store)
            tasks = self._runnable(summary)
            plan = [Job(task, g) for task in tasks for g in range(self.group_size)]
            summary.planned = len(plan)
            pending = [job for job in plan if record_id(job.task.task_id, job.group_index) not in store]
            summary.already_stored = summary.planned - len(pending)
            self._write_metadata(summary, status="running", started=started)
            if pending:
                self._execute(store, pending, summary)
            summary.elapsed_s = time.monotonic() - started
            self._finish(summary, started)
        finally:
            store.close()
        return summary

    async def arun(self) -> CollectSummary:
        return await asyncio.to_thread(self.run)

    def _execute(self, store: ResultStore, pending: list[Job], summary: CollectSummary) -> None:
        from .report import progress_view

        config = _resolved(self.config)
        options = {"address": self.ray_address, "num_cpus": self.ray_num_cpus} if self.executor_name == "ray" else {}
        executor = make_executor(self.executor_name, config, self.concurrency, self.sandbox_backend, **options)
        view = progress_view(self.progress, total=summary.planned, done=summary.already_stored)
        queue = list(reversed(pending))  # pop() takes them in plan order
        delayed: list[tuple[float, int, Job]] = []  # retries waiting out their backoff
        inflight = 0
        clean = False
        try:
            while queue or delayed or inflight:
                now = time.monotonic()
                while inflight < self.concurrency and (queue or (delayed and delayed[0][0] <= now)):
                    job = heapq.heappop(delayed)[2] if delayed and delayed[0][0] <= now else queue.pop()
                    executor.submit(job)
                    inflight += 1
                finished = executor.next_done(0.2 if delayed else 1.0)
                if finished is None:
                    continue
                inflight -= 1
                job, outcome, worker = finished
                if isinstance(outcome, EndpointUnusable):
                    raise CollectError(f"task {job.task.task_id!r}: {outcome}")
                if isinstance(outcome, BaseException):
                    raise outcome
                if outcome.error_kind in RETRY_KINDS and job.attempt <= self.retries:
                    summary.retried += 1
                    wait = self.retry_backoff_s[min(job.attempt - 1, len(self.retry_backoff_s) - 1)]
                    failed = [
                        *job.failed_attempts,
                        {
                            "attempt": job.attempt,
                            "error_kind": outcome.error_kind,
                            "error": (outcome.error or "")[:1000],
                            "worker": worker,
                        },
                    ]
                    retry = Job(job.task, job.group_index, job.attempt + 1, failed)
                    heapq.heappush(delayed, (time.monotonic() + wait, id(retry), retry))
                    continue
                record = to_record(
                    outcome,
                    task=job.task,
                    group_index=job.group_index,
                    attempt=job.attempt,
                    failed_attempts=job.failed_attempts,
                    worker=worker,
                )
                if self.config.result.keep_workdir:  # the archive on disk before its record (workdirs.py)
                    record["workdir"] = store_workdir(self.out_dir, record["id"], outcome)
                store.append(record, kept=self.keep(record))
                summary.ran += 1
                view.update(record)
            clean = True
        finally:
            view.close()
            executor.close(wait=clean)

    # -- the directory around the store --------------------------------------------------------
    def _finish(self, summary: CollectSummary, started: float) -> None:
        from .card import write_card
        from .report import write_report

        records = list(read_records(self.out_dir, kept_only=False))
        summary.counts = count_records(records, kept_ids={r["id"] for r in read_records(self.out_dir)})
        self._write_metadata(summary, status="complete" if summary.complete else "incomplete", started=started)
        try:
            write_report(records, self.out_dir / "report.png")
        except ImportError as error:  # a trainer's venv without the collect extra still gets its data
            print(f"pi-env collect: no report.png ({error}; install pi-env[collect])", file=sys.stderr)
        write_card(self.out_dir)

    def _write_metadata(self, summary: CollectSummary, *, status: str, started: float) -> None:
        previous = _read_json(self.out_dir / METADATA) or {}
        runs = previous.get("runs", [])
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        this_run: dict[str, Any] = {
            "started_at": self._started_at,
            "status": status,
            "executor": self.executor_name,
            "concurrency": self.concurrency,
            "planned": summary.planned,
            "already_stored": summary.already_stored,
            "ran": summary.ran,
            "retried": summary.retried,
            "elapsed_s": round(time.monotonic() - started, 3),
        }
        if status != "running":
            this_run["finished_at"] = now
            minutes = this_run["elapsed_s"] / 60
            this_run["rollouts_per_min"] = round(summary.ran / minutes, 3) if minutes > 0 else None
            runs = [*runs, this_run]
        metadata = {
            "status": status,
            "run": self._run_identity(),
            "config": public_config(self.config),
            "versions": versions(),
            "files": {"results": RESULTS, "discarded": DISCARDED},
            "tasks": len(self.tasks),
            "skipped_tasks": summary.skipped_tasks,
            "repaired_on_open": summary.repaired,
            "counts": summary.counts or previous.get("counts", {}),
            "runs": runs,
        }
        _write_json(self.out_dir / METADATA, metadata)


def count_records(records: list[dict], kept_ids: set[str] | None = None) -> dict[str, Any]:
    scored = [r["reward"] for r in records if r.get("reward") is not None]
    errors = Counter(r["error_kind"] for r in records if r.get("error_kind"))
    walls = sorted(r.get("wall_s") or 0.0 for r in records)
    return {
        "records": len(records),
        "kept": len(kept_ids) if kept_ids is not None else len(records),
        "scored": len(scored),
        "mean_reward": round(sum(scored) / len(scored), 6) if scored else None,
        "solved": sum(1 for r in scored if r >= 1.0),
        "errors": dict(sorted(errors.items())),
        "tasks": len({r["task_id"] for r in records}),
        "synthetic": sum(1 for r in records if r.get("synthetic")),
        "wall_s_median": walls[len(walls) // 2] if walls else None,
        "retried_attempts": sum(len(r.get("failed_attempts") or []) for r in records),
        "models": sorted({r["model"] for r in records if r.get("model")}),
        "pi_versions": sorted({r["pi_version"] for r in records if r.get("pi_version")}),
    }


def public_config(config: PiConfig) -> dict[str, Any]:
    """The config without secrets: no API key, no credentials inside the base URL."""
    data = config.redacted()
    endpoint = data["endpoint"]
    endpoint.pop("api_key", None)
    if endpoint.get("base_url"):
        urls = endpoint["base_url"]
        stripped = [re.sub(r"//[^/@]*@", "//", url) for url in ([urls] if isinstance(urls, str) else urls)]
        endpoint["base_url"] = stripped[0] if isinstance(urls, str) else stripped
    return data


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "platform": sys.platform}
    for package in ("pi-env", "pydantic", "ray", "datasets"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def _resolved(config: PiConfig) -> PiConfig:
    """Resolve the endpoint where the run starts, so that workers on other machines call the
    same URL with the same key and model whatever their own environment says."""
    from ..endpoints import ORACLE, resolve_endpoint

    if config.endpoint.name == ORACLE or isinstance(config.mode, InterceptionGate):
        return config
    endpoint = resolve_endpoint(config)
    resolved = config.endpoint.model_copy(
        update={
            "base_url": list(endpoint.base_urls) or endpoint.base_url,  # every replica's
            "api_key": endpoint.api_key,
            "model": endpoint.model,
        }
    )
    return config.model_copy(update={"endpoint": resolved})


def _read_json(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict) -> None:
    import json
    import os

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str, allow_nan=False) + "\n")
    os.replace(tmp, path)
