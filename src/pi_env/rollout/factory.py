"""`PiSessionFactory`: makes the sessions of one config and sandbox backend (`create`,
`reverify`), over what they share (`FactoryState`, pi_env.rollout.shared); `run_rollout`, one
rollout start to finish; `unscored_by`, the result of a rollout that raised."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config import PiConfig
from ..results import RolloutEvent, RolloutResult, unscored_result
from ..sandbox import SandboxBackend
from ..task import PiTask, TaskError
from ..verify.workdir import WorkdirEntry
from .session import PiSession
from .shared import FactoryState


class PiSessionFactory(FactoryState):
    """Makes `PiSession`s for one config and sandbox backend. The Pi runtime is installed on
    first use (once per machine) and shared by every session; what the sessions share (the
    config, the backend, the runtime, the policy version) are its `FactoryState` (pi_env.rollout.shared)."""

    def create(
        self,
        task: str | dict | PiTask,
        seed: int | None = None,
        episode_id: str | None = None,
        *,
        on_event: Callable[[RolloutEvent], None] | None = None,
        on_session: Callable[[PiSession], None] | None = None,
        background: bool = False,
    ) -> PiSession:
        """Create the sandbox, stage files, run setup and start the agent. Bad input (a
        malformed task, an unknown endpoint) raises; infrastructure failures are reported by
        `wait_for_completion()` as a result with reward None and an error kind.

        `seed` and `episode_id` follow openenv's `ResourceSessionFactory.create`: `episode_id`
        names the rollout (`session.episode_id`, and its trace file); `seed` is kept as
        `session.seed` and changes nothing in the rollout (Pi has no seed; a sampling seed is
        `mode.sampling["seed"]`). `pi_env.harness` chooses a task by it.

        `on_event` is told of each phase, each model call and the end (`RolloutEvent`), on
        whichever thread reached it (the caller's, the session's finishing thread, or the
        gateway's for a model call): keep it quick. An exception it raises is logged, never fails the rollout.

        `on_session` gets the session before its sandbox exists, so another thread may close()
        it during setup (a server whose client went away).

        `background=True` returns as soon as the task and the endpoint are checked (bad input
        still raises here); the sandbox, setup and the agent's start follow on the session's own
        thread, so a caller that stops (a trainer shutting down) can close() it at once instead
        of waiting for a setup to end. Their failures are the result's, as always."""
        session = PiSession(self, PiTask.coerce(task), seed=seed, episode_id=episode_id, on_event=on_event)
        try:
            if on_session is not None:
                on_session(session)
            session.start(background)
        except BaseException:
            session.close()
            raise
        return session

    def reverify(
        self,
        task: str | dict | PiTask,
        workdir: list[WorkdirEntry],
        *,
        on_event: Callable[[RolloutEvent], None] | None = None,
    ) -> RolloutResult:
        """Verify `task` again on a kept work dir (`pi-env reverify`; the entries from
        `pi_env.verify.workdir.read_archive`), with no agent, gateway or model: a fresh sandbox
        with the task's files and setup as for a rollout, the work dir replaced by `workdir`
        where the agent would have run, then verify exactly as after an agent (verify's world,
        the verifier's files staged, the reward). A multi-step task cannot be (TaskError, a ValueError)."""
        from ..harbor import later_steps

        task = PiTask.coerce(task)
        if later_steps(task):
            raise TaskError(f"task {task.task_id!r} has later steps: a kept work dir is the first step's only")
        with PiSession(self, task, on_event=on_event, replay=workdir) as session:
            session.start()
            return session.wait_for_completion()


def run_rollout(
    task: str | dict | PiTask | Path,
    config: PiConfig | None = None,
    sandbox_backend: str | SandboxBackend | None = None,
    *,
    on_event: Callable[[RolloutEvent], None] | None = None,
) -> RolloutResult:
    """One scored rollout, start to finish. A Path loads a task JSON file."""
    if isinstance(task, Path):
        task = PiTask.from_file(task)
    factory = PiSessionFactory(config, sandbox_backend)
    with factory.create(task, on_event=on_event) as session:
        return session.wait_for_completion()


def unscored_by(task_id: str, error: Exception) -> RolloutResult:
    """The result of a rollout that raised: pi_env.results.unscored_result (kept by this name)."""
    return unscored_result(task_id, error)
