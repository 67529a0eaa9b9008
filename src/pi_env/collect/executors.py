"""Where rollouts run: threads of this process (`local`) or Ray tasks (`ray`), each running a
whole rollout (sandbox, Pi, its own gateway, verify) and handing back a `RolloutResult`. The
driver alone writes the store; an executor only runs jobs and reports them as they finish."""

from __future__ import annotations

import os
import queue
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import PiConfig
from ..errors import BadInputError, InfraError
from ..results import RolloutResult, unscored_result
from ..task import PiTask

if TYPE_CHECKING:
    from ..rollout import PiSessionFactory


@dataclass
class Job:
    task: PiTask
    group_index: int
    attempt: int = 1
    failed_attempts: list[dict] = field(default_factory=list)


class EndpointUnusable(BadInputError):
    """The endpoint turned out unusable mid-run (checked before the run; its environment can
    still change): every other rollout would fail the same way, so the run stops."""


BadInput = EndpointUnusable  # its name before pi_env.errors


class WorkerLost(InfraError):
    """A Ray worker or node died under a rollout (the message holds Ray's error)."""


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class LiveSessions:
    """The sessions running now, so that an aborted run (Ctrl-C, an error) closes them at once
    instead of waiting up to an agent timeout for each."""

    def __init__(self):
        self._sessions: set = set()
        self._lock = threading.Lock()
        self.closed = False

    def add(self, session) -> None:
        with self._lock:
            self._sessions.add(session)
            closed = self.closed
        if closed:
            session.close()

    def discard(self, session) -> None:
        with self._lock:
            self._sessions.discard(session)

    def close_all(self) -> None:
        with self._lock:
            self.closed = True
            sessions = list(self._sessions)
        for session in sessions:
            session.close()  # thread-safe: the rollout ends unscored ("infra")


def run_one(factory, task: PiTask, live: LiveSessions | None = None) -> RolloutResult:
    """One rollout. Input is checked before the run starts (CollectRunner), so what goes wrong
    here is either the infrastructure (`infra`: retried) or a bug of ours (`internal`: not
    retried, never mixed with infrastructure, the traceback kept in the record's error)."""
    from ..endpoints import EndpointError
    from ..proxy.token_in import TokenInUnavailable

    try:
        with factory.create(task) as session:
            if live is None:
                return session.wait_for_completion()
            live.add(session)
            try:
                return session.wait_for_completion()
            finally:
                live.discard(session)
    except (EndpointError, TokenInUnavailable) as error:  # the configuration cannot work: every rollout would fail
        raise EndpointUnusable(str(error)) from None
    except Exception as error:  # noqa: BLE001 - never a score: see pi_env.errors.unscored
        return unscored_result(task.task_id, error)


class LocalExecutor:
    """`concurrency` rollouts at once on threads of this process (one shared gateway)."""

    name = "local"

    def __init__(self, config: PiConfig, concurrency: int, sandbox_backend=None):
        from ..rollout import PiSessionFactory

        self.factory = PiSessionFactory(config, sandbox_backend)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="pi-env-collect")
        self.done: queue.Queue = queue.Queue()
        self.worker = worker_name()
        self.live = LiveSessions()

    def submit(self, job: Job) -> None:
        def work():
            outcome: RolloutResult | BaseException
            try:
                outcome = run_one(self.factory, job.task, self.live)
            except BaseException as error:  # noqa: BLE001 - handed to the driver, which decides
                outcome = error
            self.done.put((job, outcome, self.worker))

        self.pool.submit(work)

    def next_done(self, timeout_s: float) -> tuple[Job, RolloutResult | BaseException, str] | None:
        try:
            return self.done.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self, *, wait: bool = True) -> None:
        if not wait:
            self.live.close_all()
        self.pool.shutdown(wait=wait, cancel_futures=not wait)


def _ray_rollout(task_json: str, config_json: str, backend: str | None) -> dict:
    """Runs in a Ray worker process: its own factory, gateway and (for the oracle) scripted
    server, all process-wide and reused by the next rollout on that worker."""
    global _worker_factory
    from ..rollout import PiSessionFactory

    config = PiConfig.model_validate_json(config_json)
    key = (config_json, backend)
    if _worker_factory is None or _worker_factory[0] != key:
        _worker_factory = (key, PiSessionFactory(config, backend))
    try:
        result = run_one(_worker_factory[1], PiTask.model_validate_json(task_json))
    except EndpointUnusable as error:
        return {"bad_input": str(error), "worker": worker_name()}
    return {"result": result.model_dump(mode="json"), "worker": worker_name()}


_worker_factory: tuple[tuple[str, str | None], PiSessionFactory] | None = None


class RayExecutor:
    """Each rollout is a Ray task (`num_cpus` each, default 1: Pi itself is about a core while
    it works); the driver keeps at most `concurrency` in flight. Every node needs pi-env, Pi's
    runtime cache and bubblewrap, as for local runs. `address`: an existing cluster
    ("auto", "HOST:PORT", "ray://..."); None starts a local one for this run."""

    name = "ray"

    def __init__(
        self,
        config: PiConfig,
        concurrency: int,
        sandbox_backend=None,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
    ):
        if address is None or address.split(":")[0] in ("127.0.0.1", "localhost"):
            # Read when ray is imported: keeps a cluster of this machine on loopback (otherwise
            # Ray binds every interface and turns 127.0.0.1 into the machine's public address).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        self.ray = ray
        self.started_here = not ray.is_initialized()
        if self.started_here:
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                ignore_reinit_error=True,
                configure_logging=False,
            )
        self.remote = ray.remote(num_cpus=num_cpus, max_retries=0)(_ray_rollout)
        # The key must not travel in the task arguments' repr; it does travel to the workers
        # (they call the endpoint), inside the serialised config.
        self.config_json = config.model_dump_json()
        self.backend = sandbox_backend if isinstance(sandbox_backend, str) or sandbox_backend is None else None
        self.inflight: dict = {}

    def submit(self, job: Job) -> None:
        ref = self.remote.remote(job.task.model_dump_json(), self.config_json, self.backend)
        self.inflight[ref] = job

    def next_done(self, timeout_s: float):
        if not self.inflight:
            return None
        ready, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=timeout_s)
        if not ready:
            return None
        ref = ready[0]
        job = self.inflight.pop(ref)
        try:
            payload = self.ray.get(ref)
        except Exception as error:  # noqa: BLE001 - a worker or node died: infrastructure
            lost = WorkerLost(f"{type(error).__name__}: {str(error)[:2000]}")
            return job, unscored_result(job.task.task_id, lost, doing="ray"), "ray"
        if "bad_input" in payload:
            return job, EndpointUnusable(payload["bad_input"]), payload["worker"]
        return job, RolloutResult.model_validate(payload["result"]), payload["worker"]

    def close(self, *, wait: bool = True) -> None:
        for ref in list(self.inflight):
            self.ray.cancel(ref, force=True)
        self.inflight.clear()
        if self.started_here:
            self.ray.shutdown()


def make_executor(name: str, config: PiConfig, concurrency: int, sandbox_backend=None, **options):
    if name == "local":
        return LocalExecutor(config, concurrency, sandbox_backend)
    if name == "ray":
        return RayExecutor(config, concurrency, sandbox_backend, **options)
    raise ValueError(f"executor {name!r}: choose local or ray")
