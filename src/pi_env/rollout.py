"""The rollout lifecycle, the only room that composes the others:

stage files -> setup (first failure aborts) -> agent -> kill what it left running ->
the world back as setup left it, but the agent's output -> clear logs/verifier ->
stage verify_files -> run every verify command -> reward -> collect.

`PiSession` composes; others decide. It gathers what the sandbox and the gateway saw and asks
`pi_env.judge` (`judge_agent`: scored or unscored, `score_reward`: the reward); verify's world is
`pi_env.verify.world.VerifyWorld`'s; a multi-step Harbor task's later steps are
`pi_env.steps.StepRunner`'s; what the session asks of the gateway and the sandbox is worked out
by `pi_env.specs`; interception_gate's trainer API is `pi_env.gate_api.GateAPI`. What the
factory's sessions share is `pi_env.factory_state`'s; setup's commands `pi_env.task_setup`'s,
Pi's files and start `pi_env.agent.pi`'s; the phases' timing and events `pi_env.phases`'; the
gateway's records as turns `pi_env.turns`'; every read of what the agent wrote `pi_env.read_budget`'s.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .agent.base import AgentRun, Installed
from .agent.runtime import RuntimeInstallError
from .config import BlackBox, PiConfig
from .endpoints import Endpoint
from .factory_state import FactoryState
from .gate_api import GateAPI
from .harbor.facts import is_harbor
from .harbor.rules import environment_record, unsupported_reasons
from .judge import AgentEnd, LastCall, judge_agent, score_reward, tail
from .oracle import release_oracle
from .phases import PhaseClock
from .proxy.conversation import gateway_conversation
from .proxy.gateway import GatewaySession, get_gateway
from .read_budget import ReadBudget
from .results import CommandResult, ErrorKind, RolloutEvent, RolloutResult, RolloutTurn
from .sandbox import Sandbox, SandboxBackend, SandboxError, SandboxProcess, SandboxSpec
from .sandbox.base import EnvironmentBuildError, EnvironmentUnsupported, Network
from .specs import forced_sampling, load_token_in, open_gateway_session, sandbox_spec, session_endpoint
from .steps import StepOutcome, StepRunner
from .task import PiTask
from .task_setup import capped, run_command, run_setup
from .training import TrainingTrace, build_training_trace
from .turns import proxy_trace, rollout_turn, turn_log
from .verify import SETUP_PATHS, RewardReading, read_reward, stage
from .verify.room import Entered, RoomError, enter, leave, restage_task_files, room_for
from .verify.room import run as run_in_room
from .verify.workdir import WorkdirEntry, WorkdirLimits, restore_workdir
from .verify.world import VerifyWorld

LOG_TAIL_CHARS = 8000
T = TypeVar("T")


class PiSessionFactory(FactoryState):
    """Makes `PiSession`s for one config and sandbox backend. The Pi runtime is installed on
    first use (once per machine) and shared by every session; what the sessions share (the
    config, the backend, the runtime, the policy version) is `pi_env.factory_state.FactoryState`'s."""

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
            session._start(background)
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
        the verifier's files staged, the reward). A multi-step task cannot be (ValueError)."""
        from .harbor import later_steps

        task = PiTask.coerce(task)
        if later_steps(task):
            raise ValueError(f"task {task.task_id!r} has later steps: a kept work dir is the first step's only")
        with PiSession(self, task, on_event=on_event, replay=workdir) as session:
            session._start()
            return session.wait_for_completion()


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
        self.factory = factory
        self._replay = replay  # PiSessionFactory.reverify: a kept work dir in place of an agent
        self.config = factory.config
        self.task = task
        self.seed = seed
        self.episode_id = episode_id or uuid.uuid4().hex
        self.sandbox: Sandbox | None = None
        self.endpoint: Endpoint | None = None
        self.gateway_session: GatewaySession | None = None
        self._agent: SandboxProcess | None = None
        self._agent_deadline = 0.0
        self._result = RolloutResult(task_id=task.task_id, mode=self.config.mode.name)
        self._clock = PhaseClock(self._result.timings, on_event)  # phases timed, events reported (pi_env.phases)
        self._finisher: threading.Thread | None = None
        self._finished = threading.Event()
        self._finish_error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._reads = ReadBudget(self.config.limits.max_read_bytes)  # of what the agent wrote (pi_env.read_budget)
        self._spec: SandboxSpec | None = None
        self._world: VerifyWorld | None = None  # verify's world (pi_env.verify.world), once the spec is known
        self._steps = StepRunner(self, task)  # a multi-step Harbor task's later steps (pi_env.steps)
        self._launch_pending: Callable[[], None] | None = None  # create(background=True)'s launch
        self._launched = threading.Event()  # the agent started, or the rollout failed before it

    # -- lifecycle -------------------------------------------------------------------------
    # A rollout's phases, in order. create() runs them up to agent_start; wait_for_completion()
    # the rest, on a thread of its own (_finish); close() ends the rollout whenever it is called.
    # A phase that fails ends the rollout unscored (`_fail`: error_kind) and skips the others.
    #   endpoint        _resolve_endpoint   the catalog's endpoint, the oracle, or the trainer
    #   runtime         factory.runtime     Pi, installed once per machine
    #   gateway         _open_gateway       the session Pi's calls go through (its own token)
    #   sandbox_create  _create_sandbox     a fresh sandbox with the task's files
    #   setup           _run_setup          setup commands in order; the first failure aborts
    #   agent_start     _start_agent        Pi's settings and prompt, Pi started
    #   agent           _judge              wait, kill leftovers, judge Pi's outcome (pi_env.judge)
    #   verify          _verify, _score     setup's world (pi_env.verify.world), verify_files, verify
    #                                       commands, the reward (pi_env.judge); a multi-step Harbor
    #                                       task's later steps (pi_env.steps)
    #   collect         _collect            turns, the training view, the work dir's files
    def _start(self, background: bool = False) -> None:
        if self._replay is not None:  # reverify: no endpoint, no gateway, no agent
            self._launch(None)
            return
        self._resolve_endpoint()
        mode = self.config.mode
        token_in = (
            load_token_in(self.config, _made(self.endpoint, "endpoint"))
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
        try:
            with self._clock.phase("runtime"):
                runtime = self.factory.runtime
            agent = self.factory.agent
            self._result.agent, self._result.agent_version = agent.name, runtime.version
            if agent.name == "pi":
                self._result.pi_version = runtime.version
            if self._replay is None:
                self._open_gateway(token_in)
            self._check_open()
            with self._clock.phase("sandbox_create"):
                self._create_sandbox(runtime)
            with self._clock.phase("setup"):
                if not self._run_setup(self.task):
                    return
                if why := _made(self._world, "verify world").keep_setup(_made(self.sandbox, "sandbox"), self.task):
                    self._fail("setup_failed", why)
                    return
            with self._clock.phase("agent_start"):
                self._check_open()
                if self._replay is None:
                    self._start_agent(runtime, self.task)
                else:
                    restore_workdir(_made(self.sandbox, "sandbox"), self._replay)
        except EnvironmentUnsupported as error:
            self._fail("environment_unsupported", str(error))
        except EnvironmentBuildError as error:
            self._fail("environment_build_failed", str(error))
        except (SandboxError, RuntimeInstallError, OSError) as error:
            self._fail("infra", f"{type(error).__name__}: {error}")
        finally:
            self._launched.set()

    def _resolve_endpoint(self) -> None:
        config, result = self.config, self._result
        self.endpoint = session_endpoint(config, self.task, self.factory.agent.submit_command)
        result.endpoint, result.model, result.synthetic = (
            self.endpoint.name,
            self.endpoint.model,
            self.endpoint.synthetic,
        )
        if config.mode.captures:  # black_box relays the agent's sampling as sent: nothing is forced
            result.sampling = forced_sampling(config)

    def _open_gateway(self, token_in) -> None:
        result = self._result
        self.gateway_session = open_gateway_session(
            self.config,
            _made(self.endpoint, "endpoint"),
            result,
            task_id=self.task.task_id,
            episode_id=self.episode_id,
            token_in=token_in,
            policy=self.factory.policy,
        )
        result.trace_path = self.gateway_session.trace_path
        result.session_id = self.gateway_session.id
        if token_in is not None:
            result.proxy_log_tail += f"\ntoken-in: renderer {token_in.resolved} over tokenizer {token_in.tokenizer}"
        if self._clock.on_event is not None:
            self.gateway_session.on_record = lambda record: self._clock.emit("turn", turn=rollout_turn(record))

    def _create_sandbox(self, runtime: Installed) -> None:
        config = self.config
        self._spec = sandbox_spec(
            config, self.task, self.factory.backend.name, self.factory.agent, runtime, get_gateway().socket_path
        )
        self._world = VerifyWorld(
            self.factory.backend,
            self._spec,
            caller_env=config.sandbox.extra_env,
            extra_setup=bool(config.sandbox.extra_setup_shell),
            note=self._note,
        )
        self.sandbox = self.factory.backend.create(self._spec)
        self._result.sandbox_id = self.sandbox.id
        self._check_open()
        self._result.environment = environment_record(self.task, self.sandbox)
        for path, text in self.task.files.items():
            self.sandbox.write_file(path, text)

    def _run_setup(self, task: PiTask) -> bool:
        """The setup commands in order (pi_env.task_setup); False (the rollout failed) at the first that fails."""
        sandbox, results = _made(self.sandbox, "sandbox"), self._result.setup_results
        if failed := run_setup(sandbox, self.config, task, results, check_open=self._check_open):
            self._fail("setup_failed", failed)
        return failed is None

    def _setup_again(self, task: PiTask, sandbox: Sandbox) -> CommandResult | None:
        """Setup in a fresh verify sandbox (VerifyWorld.build): the command that failed, or None.
        The first run's results are the rollout's: these are not kept."""
        results: list[CommandResult] = []
        return results[-1] if run_setup(sandbox, self.config, task, results, check_open=self._check_open) else None

    def _start_agent(self, runtime: Installed, task: PiTask) -> None:
        """The agent on `task`'s instruction (the task's, or a later step's: pi_env.steps)."""
        sandbox, agent = _made(self.sandbox, "sandbox"), self.factory.agent
        run = AgentRun(
            self.config,
            _made(self.endpoint, "endpoint"),
            _made(self.gateway_session, "gateway session").token,
            task.instruction,
        )
        agent.prepare(sandbox, runtime, run)
        self._agent_deadline = time.monotonic() + self._agent_limit(task)
        self._agent = agent.start(sandbox, runtime, run)

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
        return self._result

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
        so that any wait can be bounded."""
        try:
            if self._launch_pending is not None:
                self._launch_pending()
            if (self._agent is not None or self._replay is not None) and self._result.error_kind is None:
                try:
                    self._finish_agent()
                except (SandboxError, OSError) as error:  # the sandbox failed, not the agent
                    self._fail("infra", f"{type(error).__name__}: {error}")
            self._collect()
            self._result.make_valid_utf8()
            self._result.wall_s = self._clock.elapsed()
            self._clock.emit("done", reward=self._result.reward, error_kind=self._result.error_kind)
        except BaseException as error:  # noqa: BLE001 - handed to every caller of wait_for_completion
            self._finish_error = error
        finally:
            self._finished.set()

    def _finish_agent(self) -> None:
        """The first (or only) step's agent judged and verified; a multi-step task's later steps
        (pi_env.steps) and the rollout's score inside verify's phase, as always."""
        if self._replay is None:
            if not self._judge(self.task):
                return
            if self.config.result.keep_workdir:
                self._keep_workdir()
        with self._clock.phase("verify"):
            first = self._verify(self.task, 0)
            if first is None:
                return
            self._steps.run(first)
            self._score()

    def _keep_workdir(self) -> None:
        """PiConfig.result.keep_workdir: the work dir as verify is about to see it (pi_env.verify.workdir)."""
        config, result = self.config, self._result
        if self._steps.more_after(0):
            result.workdir_not_kept = "a multi-step task: reverify scores single-step tasks only"
            return
        limits = WorkdirLimits(config.result.keep_workdir_max_files, config.result.keep_workdir_max_bytes)
        with self._clock.phase("keep_workdir"):
            result.workdir_archive, result.workdir_not_kept = self._reads.keep_workdir(
                _made(self.sandbox, "sandbox"), limits
            )

    def _play_step(self, step: PiTask, index: int) -> StepOutcome | None:
        """A later step's agent (running) judged and verified (pi_env.steps): None when the
        rollout failed on it, unscored."""
        if not self._judge(step):
            return None
        with self._clock.phase("verify"):
            return self._verify(step, index)

    def _judge(self, task: PiTask) -> bool:
        """Wait for the agent, kill what it left running, rebuild the conversation from the
        gateway's records and judge the outcome (pi_env.judge). False: the rollout failed, unscored."""
        result = self._result
        with self._clock.phase("agent"):
            outcome = _made(self._agent, "agent").wait(max(0.0, self._agent_deadline - time.monotonic()))
        _made(self.sandbox, "sandbox").kill_all()  # nothing the agent started survives into verification
        result.agent_exit_code = outcome.exit_code
        result.agent_log_tail = tail(outcome.stderr + outcome.stdout, LOG_TAIL_CHARS)
        gateway = _made(self.gateway_session, "gateway session")
        gateway.wait_idle()  # a turn is recorded just after the agent has its answer
        # The record is what the gateway saw; the agent's own transcript is the agent's to rewrite.
        result.agent_transcript = self._reads.transcript(self.factory.agent, _made(self.sandbox, "sandbox"))
        if self.factory.agent.name == "pi":
            result.pi_session_messages = result.agent_transcript
        calls = [record for record in gateway.turns if self._extra_call(record) is None]
        conversation = gateway_conversation(calls)
        result.messages, result.tools = conversation.messages, conversation.tools
        result.rewritten_turns, result.stop_reason = conversation.rewritten_turns, conversation.stop_reason
        last = calls[-1] if calls else None
        gate_stop = gateway.stopped()  # interception_gate: the trainer never answered
        verdict = judge_agent(
            AgentEnd(
                closed=self._closed,
                timed_out=outcome.timed_out,
                exit_code=outcome.exit_code,
                stderr=outcome.stderr,
                answered=bool(conversation.messages),
                last=LastCall.of(last) if last is not None else None,
                gate_stop=gate_stop.reason if gate_stop else None,
                gate_message=gate_stop.message if gate_stop else None,
                budget_exhausted=gateway.budget_exhausted,
                limit_s=self._agent_limit(task),
            )
        )
        if verdict.stop_reason:
            result.stop_reason = verdict.stop_reason
        if verdict.budget_exhausted:
            result.budget_exhausted = verdict.budget_exhausted
        if verdict.truncated:
            result.truncated = True
        if verdict.error_kind is not None:
            self._fail(verdict.error_kind, verdict.error or verdict.error_kind)
        return verdict.scored

    def _verify(self, task: PiTask, index: int) -> StepOutcome | None:
        """Step `index` of `task` (0: the task itself) verified in a world the agent did not
        shape, on its work as data (pi_env.verify.room), and its reward; None when that world
        could not be made for reasons not the agent's (the rollout failed)."""
        result, world = self._result, _made(self._world, "verify world")
        try:
            sandbox, home_aside = world.build(
                _made(self.sandbox, "sandbox"),
                task,
                more_steps=self._steps.more_after(index),
                setup_again=lambda fresh: self._setup_again(task, fresh),
            )
            if sandbox is not self.sandbox:
                self.sandbox, old = sandbox, self.sandbox
                old.close()
            room = room_for(sandbox, task, SETUP_PATHS)
        except (SandboxError, OSError) as error:
            self._fail("infra", f"could not give verify a clean world: {type(error).__name__}: {error}")
            return None
        refused, entered = None, Entered()
        limit = capped(task.timeouts.verify_s, self.config.limits.verify_timeout_s)
        network: Network = "full" if task.verify_network else "none"
        for position, command in enumerate(task.verify):
            try:
                if position == 0:
                    entered = enter(sandbox, task, room)
                    restage_task_files(sandbox, task)
                    stage(sandbox, task, entered)
                    outcome = self._run(command, limit, network, env=world.env_for(task))
                else:  # nothing an earlier command's agent code left runs on, or shapes this one's room
                    sandbox.kill_all()
                    outcome = run_in_room(
                        sandbox, task, room, entered, command, timeout_s=limit, network=network, env=world.env_for(task)
                    )
            except OSError as error:
                if isinstance(error, RoomError) and error.moved:
                    entered = Entered(error.moved)
                if position == 0 and not (isinstance(error, RoomError) and error.agents):
                    self._fail("infra", f"could not give verify a clean room: {type(error).__name__}: {error}")
                    leave(sandbox, task, entered)
                    return None
                refused = f"reward 0.0: verify's room could not be made before command {position + 1} ({error})"
                break
            result.verify_results.append(outcome)
        sandbox.kill_all()
        result.verify_notes += entered.notes
        if refused is not None:  # within the agent's reach (its files, its disk, its code's leftovers)
            result.verify_notes.append(refused)
            reading = RewardReading(0.0, valid=False)
        else:
            reading = read_reward(sandbox, task, result.verify_results[-1] if result.verify_results else None)
        result.verify_notes += reading.notes
        score = score_reward(reading.reward, result.verify_results)
        if score.error_kind is not None:
            self._fail(score.error_kind, score.error or score.error_kind)
        else:
            result.reward, result.reward_source = score.reward, score.source
        leave(sandbox, task, entered)
        self._reads.artifacts(self.task, self.sandbox, result, step=index)
        return StepOutcome(result.reward, reading.valid, home_aside)

    def _score(self) -> None:
        """After every step: the task's artifacts, and no score for an environment not honoured."""
        result = self._result
        self._reads.artifacts(self.task, self.sandbox, result)
        if why := unsupported_reasons(self.task, self.factory.backend.name) if is_harbor(self.task) else []:
            # Run anyway (--include-unsupported), but an environment not honoured scores nothing.
            self._fail("environment_unsupported", "the environment was not honoured: " + "; ".join(why))

    def _collect(self) -> None:
        result, config = self._result, self.config
        if self.gateway_session is not None:
            result.proxy_turns = self.fetch_proxy_trace()
            extra = {record.turn: why for record in self.gateway_session.turns if (why := self._extra_call(record))}
            for turn in result.proxy_turns:
                turn.extra_call = extra.get(turn.turn)
            result.replicas = self.gateway_session.replica_health()
            result.proxy_log_tail = turn_log(result.proxy_log_tail, result.proxy_turns)
            if config.mode.captures:
                result.training = build_training_trace(result.proxy_turns)
        if self.sandbox is not None and config.result.max_files:
            try:
                with self._clock.phase("collect"):
                    result.files = self._reads.files(
                        self.sandbox, config.result.max_files, config.result.max_file_bytes
                    )
            except (SandboxError, OSError) as error:
                result.agent_log_tail += f"\n[pi-env] could not collect files: {error}"

    def fetch_proxy_trace(self) -> list[RolloutTurn]:
        """Every model call so far, with the engine's ids and logprobs in transparent_proxy."""
        return proxy_trace(self.gateway_session)

    def _extra_call(self, record) -> str | None:
        """Why the agent's call `record` is not part of the task's conversation (the agent says:
        OpenCode's title call), or None."""
        capture = record.capture
        request = capture.request if capture is not None and isinstance(capture.request, dict) else None
        return self.factory.agent.extra_call(request) if request is not None else None

    def fetch_training_trace(self) -> TrainingTrace:
        """The token-level training view of the calls so far (see pi_env.training)."""
        return build_training_trace(self.fetch_proxy_trace())

    def _check_open(self) -> None:
        """close() from another thread during setup: stop here (and delete a sandbox that
        close() could not see yet, being created)."""
        if self._closed:
            if self.sandbox is not None:
                self.sandbox.close()
            self._end_gateway_session()
            raise SandboxError("the session was closed during setup")

    def close(self) -> None:
        """Kill everything, delete the sandbox, end the gateway session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._agent is not None:
            self._agent.kill()
        if self.sandbox is not None:
            self.sandbox.close()
        self._end_gateway_session()
        if self.endpoint is not None and self.endpoint.synthetic:
            release_oracle(self.endpoint)
        self._steps.release()

    def _end_gateway_session(self) -> None:
        """Revoke the session's token; without a trace_dir its trace was scratch: delete it.
        Idempotent (close() and a setup that close() interrupted may both call it)."""
        if self.gateway_session is not None:
            get_gateway().close_session(self.gateway_session)
            mode = self.config.mode
            kept = not isinstance(mode, BlackBox) and mode.trace_dir is not None
            if not kept and self.gateway_session.trace_path:
                Path(self.gateway_session.trace_path).unlink(missing_ok=True)
                self._result.trace_path = None

    def __enter__(self) -> PiSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------
    def _run(self, command: str, timeout_s: float, network, *, env: dict[str, str] | None = None) -> CommandResult:
        return run_command(_made(self.sandbox, "sandbox"), command, timeout_s, network, env=env)

    def _agent_limit(self, task: PiTask) -> float:
        return capped(task.timeouts.agent_s, self.config.limits.agent_timeout_s)

    def _note(self, text: str) -> None:
        """pi-env's own word on the rollout, after the agent's log."""
        self._result.agent_log_tail += f"\n[pi-env] {text}"

    def _fail(self, kind: ErrorKind, message: str) -> None:
        self._result.reward = None
        self._result.reward_source = None
        self._result.error_kind = kind
        self._result.error = message


def _made(value: T | None, what: str) -> T:
    """`value`, which an earlier phase made: reaching here without it is a bug in the phase order."""
    if value is None:
        raise RuntimeError(f"PiSession: the {what} is used before the phase that makes it")
    return value


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
    """The result of a rollout (or a re-verification) that raised, for `pi-env run`, collect and
    reverify alike: `infra` for the sandbox, the Pi runtime or the OS (retried), else `internal`,
    a bug of ours (not retried, never mixed with infrastructure, its traceback kept). Call it
    while handling `error`."""
    if isinstance(error, (SandboxError, RuntimeInstallError, OSError)):
        return RolloutResult(task_id=task_id, error_kind="infra", error=f"{type(error).__name__}: {error}")
    return RolloutResult(
        task_id=task_id,
        error_kind="internal",
        error=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}",
    )
