"""`PiSession`: one rollout in flight, running its phases in order on its own threads.

create() (pi_env.rollout.factory) runs the phases up to the agent's start; wait_for_completion()
the rest, on a thread of its own (`_finish`), so any wait can be bounded; close() ends the
rollout whenever it is called. What each phase does is pi_env.rollout.phases'; the state they
share is the session's `ctx` (pi_env.rollout.context); a multi-step Harbor task's later steps are
pi_env.rollout.steps'; interception_gate's trainer API is `GateAPI`'s (pi_env.rollout.gate_api).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from ..agent.runtime import RuntimeInstallError
from ..config import BlackBox
from ..errors import unscored
from ..oracle import release_oracle
from ..results import RolloutEvent, RolloutResult, RolloutTurn
from ..sandbox import SandboxError
from ..specs import load_token_in
from ..task import PiTask
from ..training import TrainingTrace, build_training_trace
from ..verify.workdir import WorkdirEntry, restore_workdir
from . import phases
from .clock import PhaseClock
from .context import RolloutContext, made
from .gate_api import GateAPI
from .shared import FactoryState
from .steps import StepRunner


class PiSession(GateAPI):
    """One rollout in flight: made by `PiSessionFactory.create`, already running its agent.
    `wait_for_completion()` verifies and scores it; `close()` (or the `with` block) kills every
    process and deletes the sandbox. In interception_gate mode `next_request()`/`deliver()` hand
    each model call to the trainer."""

    def __init__(
        self,
        factory: FactoryState,
        task: PiTask,
        seed: int | None = None,
        episode_id: str | None = None,
        on_event: Callable[[RolloutEvent], None] | None = None,
        replay: list[WorkdirEntry] | None = None,
    ):
        result = RolloutResult(task_id=task.task_id, mode=factory.config.mode.name)
        self.ctx = RolloutContext(
            factory=factory,
            task=task,
            clock=PhaseClock(result.timings, on_event),  # phases timed, events reported
            result=result,
            episode_id=episode_id or uuid.uuid4().hex,
            replay=replay,  # PiSessionFactory.reverify: a kept work dir in place of an agent
        )
        self.factory, self.task, self.seed = factory, task, seed
        self._steps = StepRunner(self.ctx)  # a multi-step Harbor task's later steps
        self._finisher: threading.Thread | None = None
        self._finished = threading.Event()
        self._finish_error: BaseException | None = None
        self._lock = threading.Lock()
        self._launch_pending: Callable[[], None] | None = None  # create(background=True)'s launch
        self._launched = threading.Event()  # the agent started, or the rollout failed before it

    # What callers read of the rollout in flight: the context's.
    @property
    def config(self):
        return self.ctx.config

    @property
    def episode_id(self) -> str:
        return self.ctx.episode_id

    @property
    def sandbox(self):
        return self.ctx.sandbox

    @property
    def endpoint(self):
        return self.ctx.endpoint

    @property
    def gateway_session(self):
        return self.ctx.gateway_session

    @property
    def result(self) -> RolloutResult | None:
        """The result once the rollout is over (`finished`), else None: wait_for_completion()
        waits for it."""
        return self.ctx.result if self._finished.is_set() else None

    # -- the phases, in order (pi_env.rollout.phases) ----------------------------------------
    def start(self, background: bool = False) -> None:
        """Resolve the endpoint (bad input raises here), then launch: the phases up to the
        agent's start, now or (`background`) on the finishing thread. `PiSessionFactory` calls it."""
        ctx = self.ctx
        if ctx.replay is not None:  # reverify: no endpoint, no gateway, no agent
            self._launch(None)
            return
        phases.resolve_endpoint(ctx)
        mode = ctx.config.mode
        token_in = (
            load_token_in(ctx.config, made(ctx.endpoint, "endpoint"))
            if not isinstance(mode, BlackBox) and mode.token_in
            else None
        )  # bad input
        if background:
            self._launch_pending = lambda: self._launch(token_in)
            self._begin_finishing()
        else:
            self._launch(token_in)

    def wait_for_start(self, timeout_s: float | None = None) -> bool:
        """Wait until the agent has started (or the rollout failed before it); False if
        `timeout_s` passed first. Only a `create(background=True)` session can be starting."""
        return self._launched.wait(timeout_s)

    def _launch(self, token_in) -> None:
        """The phases from the runtime to the agent's start."""
        ctx = self.ctx
        try:
            with ctx.clock.phase("runtime"):
                runtime = ctx.factory.runtime
            agent = ctx.factory.agent
            ctx.result.agent, ctx.result.agent_version = agent.name, runtime.version
            if agent.name == "pi":
                ctx.result.pi_version = runtime.version
            if ctx.replay is None:
                phases.open_gateway(ctx, token_in)
            ctx.check_open()
            with ctx.clock.phase("sandbox_create"):
                phases.create_sandbox(ctx, runtime)
            with ctx.clock.phase("setup"):
                if not phases.run_setup(ctx, ctx.task):
                    return
            with ctx.clock.phase("agent_start"):
                ctx.check_open()
                if ctx.replay is None:
                    phases.start_agent(ctx, runtime, ctx.task)
                else:
                    restore_workdir(made(ctx.sandbox, "sandbox"), ctx.replay)
        except (SandboxError, RuntimeInstallError, OSError) as error:  # the environment's kinds too (pi_env.errors)
            ctx.fail(*unscored(error))
        finally:
            self._launched.set()

    def wait_for_completion(self, timeout_s: float | None = None) -> RolloutResult:
        """Wait for the agent, then verify and collect. Raises TimeoutError if `timeout_s` passes
        first, in whichever phase (the rollout keeps going: call again, from any thread, or
        close()). The agent's own time limit is enforced regardless. Every caller gets the same
        result (or the same exception, should finishing fail)."""
        self._begin_finishing()
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"rollout {self.task.task_id!r} still running after {timeout_s} s")
        if self._finish_error is not None:
            raise self._finish_error
        return self.ctx.result

    @property
    def finished(self) -> bool:
        """True once the rollout is over (verified and collected, or failed): then
        wait_for_completion() returns at once."""
        return self._finished.is_set()

    def _begin_finishing(self) -> None:
        with self._lock:  # held only to start the finishing work, once
            if self._finisher is None:
                self._finisher = threading.Thread(
                    target=self._finish, name=f"pi-env-finish-{self.episode_id[:8]}", daemon=True
                )
                self._finisher.start()

    def _finish(self) -> None:
        """(A background start's launch ->) agent -> verify -> collect, on a thread of its own
        so that any wait can be bounded. The result is completed here, in one place."""
        ctx = self.ctx
        try:
            if self._launch_pending is not None:
                self._launch_pending()
            if (ctx.agent is not None or ctx.replay is not None) and ctx.result.error_kind is None:
                try:
                    self._finish_agent()
                except (SandboxError, OSError) as error:  # the sandbox failed, not the agent
                    ctx.fail(*unscored(error))
            phases.collect(ctx)
            ctx.result.make_valid_utf8()
            ctx.result.wall_s = ctx.clock.elapsed()
            ctx.clock.emit("done", reward=ctx.result.reward, error_kind=ctx.result.error_kind)
        except BaseException as error:  # noqa: BLE001 - handed to every caller of wait_for_completion
            self._finish_error = error
        finally:
            self._finished.set()

    def _finish_agent(self) -> None:
        """The first (or only) step's agent judged and verified; a multi-step task's later steps
        (pi_env.rollout.steps) and the rollout's score inside verify's phase, as always."""
        ctx = self.ctx
        if ctx.replay is None:
            if not phases.judge(ctx, ctx.task):
                return
            if ctx.config.result.keep_workdir:
                phases.keep_workdir(ctx)
        with ctx.clock.phase("verify"):
            first = phases.verify(ctx, ctx.task, 0)
            if first is None:
                return
            self._steps.run(first)
            phases.score(ctx)

    # -- while it runs ------------------------------------------------------------------------
    def fetch_proxy_trace(self) -> list[RolloutTurn]:
        """Every model call so far, with the engine's ids and logprobs in transparent_proxy."""
        return phases.proxy_turns(self.ctx)

    def fetch_training_trace(self) -> TrainingTrace:
        """The token-level training view of the calls so far (see pi_env.training)."""
        return build_training_trace(self.fetch_proxy_trace())

    def extra_call(self, record) -> str | None:
        """Why the agent's call `record` (a gateway record) is not part of the task's
        conversation (OpenCode's title call), or None."""
        return phases.extra_call(self.ctx, record)

    def close(self) -> None:
        """Kill everything, delete the sandbox, end the gateway session. Idempotent."""
        ctx = self.ctx
        if ctx.closed:
            return
        ctx.closed = True
        if ctx.agent is not None:
            ctx.agent.kill()
        if ctx.sandbox is not None:
            ctx.sandbox.close()
        ctx.end_gateway_session()
        if ctx.endpoint is not None and ctx.endpoint.synthetic:
            release_oracle(ctx.endpoint)
        self._steps.release()

    def __enter__(self) -> PiSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
