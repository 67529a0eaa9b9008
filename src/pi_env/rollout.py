"""The rollout lifecycle, the only room that composes the others:

stage files -> setup (first failure aborts) -> agent -> kill what it left running ->
the world back as setup left it, but the agent's output -> clear logs/verifier ->
stage verify_files -> run every verify command -> reward -> collect.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from .agent.pi import (
    AGENT_DIR,
    FORWARDER_PATH,
    HERMETIC_SETTINGS,
    PROMPT_PATH,
    SESSION_DIR,
    models_json,
    parse_session,
    pi_command,
    pi_env,
)
from .agent.runtime import SANDBOX_RUNTIME_DIR, PiRuntime, RuntimeInstallError, ensure_runtime
from .config import Mode, PiConfig
from .endpoints import OPEN_SERVER_COMPAT, ORACLE, Endpoint, resolve_endpoint, supports_return_token_ids
from .harbor import (
    collect_artifacts,
    combine_step_rewards,
    environment_spec,
    harbor_environment_record,
    is_harbor,
    later_steps,
    step_gate,
    step_own,
    unsupported_reasons,
)
from .oracle import oracle_endpoint, release_oracle
from .proxy.conversation import gateway_conversation
from .proxy.gateway import GatewaySession, TurnRecord, Upstream, get_gateway
from .proxy.policy import SessionLimits
from .proxy.rewrite import CaptureOptions
from .results import CommandResult, ErrorKind, RolloutEvent, RolloutResult, RolloutTurn
from .sandbox import (
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    SandboxProcess,
    SandboxSpec,
    get_backend,
)
from .sandbox.base import EnvironmentBuildError, EnvironmentUnsupported, ExportsTrees, RestoresHome
from .task import PiTask
from .training import TrainingTrace, build_training_trace
from .verify import (
    RESERVE_DIR,
    VERIFY_ENV,
    put_back,
    read_reward,
    record_setup,
    reserve,
    set_aside,
    stage,
    startup_mount,
    verify_env,
)

if TYPE_CHECKING:
    from .proxy.gate import GateCompletion, GateRequest

LOG_TAIL_CHARS = 8000
# Answers that say the endpoint (or pi-env's config of it) is at fault, not the agent's request.
ENDPOINT_FAULT_STATUSES = frozenset({401, 403, 404, 408, 429})
# Verify's world (PiSession._verify_world): the agent's output is the work dir and these home
# dirs (Harbor's /logs/agent, where Pi's session is too); the rest of the home is setup's.
AGENT_OUTPUT_DIRS = ("logs/agent",)
log = logging.getLogger(__name__)


class PiSessionFactory:
    """Makes `PiSession`s for one config and sandbox backend. The Pi runtime is installed on
    first use (once per machine) and shared by every session."""

    def __init__(
        self,
        config: PiConfig | None = None,
        sandbox_backend: str | SandboxBackend | None = None,
        mode: Mode | None = None,
        *,
        sampling: Mapping[str, float | int] | None = None,
    ):
        config = config or PiConfig()
        if mode is not None:
            config = config.model_copy(update={"mode": mode})
        if sampling:
            config = _with_forced_sampling(config, sampling, explicit_mode=mode is not None)
        self.config = config
        backend = sandbox_backend or config.sandbox_backend
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self._runtime: PiRuntime | None = None
        self._runtime_lock = threading.Lock()

    @property
    def runtime(self) -> PiRuntime:
        with self._runtime_lock:
            if self._runtime is None:
                self._runtime = ensure_runtime(
                    self.config.pi_package,
                    self.config.pi_version,
                    self.config.node_version,
                    self.config.runtime_cache_dir,
                )
            return self._runtime

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
        `proxy_sampling["seed"]`). `pi_env.harness` chooses a task by it.

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


class PiSession:
    """One rollout in flight: made by `PiSessionFactory.create`, already running its agent.
    `wait_for_completion()` verifies and scores it; `close()` (or the `with` block) kills every
    process and deletes the sandbox. In interception_gate mode `next_request()`/`deliver()` hand
    each model call to the trainer."""

    def __init__(
        self,
        factory: PiSessionFactory,
        task: PiTask,
        seed: int | None = None,
        episode_id: str | None = None,
        on_event: Callable[[RolloutEvent], None] | None = None,
    ):
        self.factory = factory
        self.config = factory.config
        self.task = task
        self.seed = seed
        self.episode_id = episode_id or uuid.uuid4().hex
        self.sandbox: Sandbox | None = None
        self.endpoint: Endpoint | None = None
        self.gateway_session: GatewaySession | None = None
        self._agent: SandboxProcess | None = None
        self._agent_deadline = 0.0
        self._started = time.monotonic()
        self._result = RolloutResult(task_id=task.task_id, mode=self.config.mode)
        self._finisher: threading.Thread | None = None
        self._finished = threading.Event()
        self._finish_error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._on_event = on_event
        self._read_left = self.config.max_read_bytes  # of what the agent wrote, per rollout
        self._in_later_step = False  # a later step of a multi-step Harbor task is running
        self._step_index = 0  # which step of a multi-step Harbor task is running (0: the first, or the only)
        self._step_endpoints: list[Endpoint] = []  # oracle scripts of later steps, released on close
        self._spec: SandboxSpec | None = None
        self._verify_env: dict[str, str] = dict(VERIFY_ENV)
        self._step_verified = True  # the last verify had a valid reward file, or none was needed
        self._agent_home_aside = False  # a later step's agent gets its home back (_verify_world)
        self._later_steps_left = 0
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
    #   agent           _finish_agent       wait, kill leftovers, judge Pi's outcome
    #   verify          _verify, _score     setup's world (_verify_world), verify_files, verify commands,
    #                                       the reward
    #   collect         _collect            turns, the training view, the work dir's files
    def _start(self, background: bool = False) -> None:
        self._resolve_endpoint()
        token_in = self._token_in() if self.config.proxy_token_in else None  # bad input: raises here
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
            with self._phase("runtime"):
                runtime = self.factory.runtime
            self._result.pi_version = runtime.pi_version
            self._open_gateway(token_in)
            self._check_open()
            with self._phase("sandbox_create"):
                self._create_sandbox(runtime)
            with self._phase("setup"):
                if not self._run_setup():
                    return
                self._keep_setup_world()
            with self._phase("agent_start"):
                self._check_open()
                self._start_agent(runtime)
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
        if config.mode == "interception_gate":  # the trainer is the model: no upstream at all
            self.endpoint = Endpoint(
                name="interception_gate",
                base_url="http://interception-gate.invalid/v1",
                model=config.model or "trainer",
                compat=OPEN_SERVER_COMPAT,
                return_token_ids=False,
            )
        else:
            self.endpoint = oracle_endpoint(self.task) if config.endpoint == ORACLE else resolve_endpoint(config)
        result.endpoint, result.model, result.synthetic = (
            self.endpoint.name,
            self.endpoint.model,
            self.endpoint.synthetic,
        )
        if config.mode != "black_box":  # black_box relays the agent's sampling as sent: nothing is forced
            result.sampling = dict(config.proxy_sampling)

    def _open_gateway(self, token_in) -> None:
        config, result = self.config, self._result
        self.gateway_session = get_gateway().open_session(
            Upstream(
                self.endpoint.base_url,
                self.endpoint.api_key,
                self.endpoint.model,
                connect_timeout_s=config.upstream_connect_timeout_s,
                read_timeout_s=config.upstream_read_timeout_s,
            ),
            mode=config.mode,
            max_turns=config.max_turns,
            max_total_tokens=config.max_total_tokens,
            max_tokens_cap=config.max_tokens,
            capture=self._capture_options(),
            trace_path=self._trace_path(),
            token_in=token_in,
            allow_fields=config.gateway_allow_fields,
            limits=SessionLimits(
                max_request_bytes=config.gateway_max_request_bytes,
                max_concurrent_calls=config.gateway_max_concurrent_calls,
            ),
        )
        result.trace_path = self.gateway_session.trace_path
        if token_in is not None:
            result.proxy_log_tail += f"\ntoken-in: renderer {token_in.resolved} over tokenizer {token_in.tokenizer}"
        if self._on_event is not None:
            self.gateway_session.on_record = lambda record: self._emit("turn", turn=_rollout_turn(record))
        if config.mode == "interception_gate":
            self.gateway_session.strategy.timeout_s = config.gate_timeout_s

    def _create_sandbox(self, runtime: PiRuntime) -> None:
        self._spec = self._sandbox_spec(runtime, get_gateway().socket_path)
        self.sandbox = self.factory.backend.create(self._spec)
        self._result.sandbox_id = self.sandbox.id
        self._check_open()
        self._result.environment = harbor_environment_record(self.task, self.sandbox)
        for path, text in self.task.files.items():
            self.sandbox.write_file(path, text)

    def _run_setup(self, sandbox: Sandbox | None = None) -> bool:
        """The setup commands in order; False (the rollout failed) at the first that fails."""
        config, task = self.config, self.task
        for command in [*config.extra_setup_shell, *task.setup]:
            self._check_open()
            outcome = self._run(
                command,
                task.timeouts.setup_s or config.setup_timeout_s,
                "full" if task.setup_network else "none",
                sandbox=sandbox,
            )
            self._result.setup_results.append(outcome)
            if not outcome.passed:
                self._check_open()  # close() killed it: not the task's failure
                why = "timed out" if outcome.timed_out else f"exited {outcome.exit_code}"
                self._fail(
                    "setup_failed", f"setup command {command!r} {why}: {_tail(outcome.stderr or outcome.stdout, 500)}"
                )
                return False
        return True

    def _capture_options(self) -> CaptureOptions:
        config, endpoint, result = self.config, self.endpoint, self._result
        if config.mode != "transparent_proxy":  # only it rewrites requests: nothing to decide, no probe
            return_token_ids = False
        else:
            if config.proxy_return_token_ids is None:
                return_token_ids, why = supports_return_token_ids(endpoint)
            else:
                return_token_ids, why = config.proxy_return_token_ids, "PiConfig.proxy_return_token_ids"
            result.return_token_ids, result.return_token_ids_reason = return_token_ids, why
            result.proxy_log_tail = f"return_token_ids={return_token_ids} ({why})"
        disable_thinking = (
            endpoint.disable_thinking if config.proxy_disable_thinking is None else config.proxy_disable_thinking
        )
        top_logprobs = min(config.proxy_top_logprobs, endpoint.max_top_logprobs)
        return CaptureOptions(
            logprobs=config.proxy_logprobs,
            top_logprobs=top_logprobs,
            return_token_ids=return_token_ids,
            max_tokens_cap=config.proxy_max_tokens_cap,
            disable_thinking=disable_thinking,
            model=endpoint.model,
            sampling=dict(config.proxy_sampling),
        )

    def _token_in(self):
        """The session's renderer, and in transparent_proxy a checked token-in endpoint; raises
        TokenInUnavailable (a ValueError) naming what is missing."""
        from .proxy.token_in import check_endpoint_sync, load_renderer

        config, endpoint = self.config, self.endpoint
        spec = load_renderer(config.proxy_renderer, config.proxy_tokenizer or endpoint.model)
        if config.mode == "transparent_proxy":
            check_endpoint_sync(
                Upstream(
                    endpoint.base_url,
                    endpoint.api_key,
                    endpoint.model,
                    connect_timeout_s=config.upstream_connect_timeout_s,
                    read_timeout_s=config.upstream_read_timeout_s,
                ),
                spec,
            )
        return spec

    def _trace_path(self) -> str | None:
        if self.config.mode == "black_box":
            return None
        # Retention: a trace_dir is kept on purpose (collect puts it in its dataset); without one
        # the trace is scratch in a private dir and deleted by close().
        directory = Path(self.config.trace_dir) if self.config.trace_dir else private_scratch_dir("pi-env-traces")
        safe_id, safe_episode = (
            re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] for name in (self.task.task_id, self.episode_id)
        )
        return str(directory / f"{safe_id}-{safe_episode}-{uuid.uuid4().hex[:8]}.jsonl")

    def _sandbox_spec(self, runtime: PiRuntime, gateway_socket: str) -> SandboxSpec:
        config = self.config
        forwarder = resources.files("pi_env.proxy").joinpath("forward.mjs")
        return SandboxSpec(
            ro_mounts={SANDBOX_RUNTIME_DIR: runtime.root, FORWARDER_PATH: str(forwarder), **startup_mount()},
            gateway_socket=gateway_socket,
            limits=SandboxLimits(
                max_processes=config.max_processes,
                max_file_bytes=config.max_file_bytes,
                max_memory_bytes=config.max_memory_bytes,
                max_total_memory_bytes=_mb(self.task.limits.memory_mb) or config.max_total_memory_bytes,
                max_disk_bytes=_mb(self.task.limits.storage_mb) or config.max_disk_bytes,
            ),
            env=dict(config.extra_env),
            # Old Pi has no -na: hide the task's .pi/ so it cannot change Pi's settings.
            agent_masked_paths=(RESERVE_DIR,) if runtime.supports("-na") else (RESERVE_DIR, f"{SANDBOX_WORKDIR}/.pi"),
            archive_dir=runtime.archive_dir,
            environment=environment_spec(self.task, self.factory.backend.name),
            # Harbor's setup and verifier expect root of a container; the agent never gets it.
            container_root=is_harbor(self.task),
        )

    def _start_agent(self, runtime: PiRuntime) -> None:
        sandbox, endpoint = self.sandbox, self.endpoint
        sandbox.write_file(
            f"{AGENT_DIR}/models.json", json.dumps(models_json(self.config, endpoint, self.gateway_session.token))
        )
        sandbox.write_file(f"{AGENT_DIR}/settings.json", json.dumps(HERMETIC_SETTINGS))
        sandbox.write_file(PROMPT_PATH, self.task.instruction)
        self._agent_deadline = time.monotonic() + (self.task.timeouts.agent_s or self.config.agent_timeout_s)
        self._agent = sandbox.start(
            pi_command(runtime, self.config, endpoint),
            cwd=SANDBOX_WORKDIR,
            env=pi_env(runtime),
            network="gateway",
            stdin_path=PROMPT_PATH,
        )

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
            if self._agent is not None and self._result.error_kind is None:
                try:
                    self._finish_agent()
                except (SandboxError, OSError) as error:  # the sandbox failed, not the agent
                    self._fail("infra", f"{type(error).__name__}: {error}")
            self._collect()
            self._result.make_valid_utf8()
            self._result.wall_s = round(time.monotonic() - self._started, 4)
            self._emit("done", reward=self._result.reward, error_kind=self._result.error_kind)
        except BaseException as error:  # noqa: BLE001 - handed to every caller of wait_for_completion
            self._finish_error = error
        finally:
            self._finished.set()

    def _finish_agent(self) -> None:
        result = self._result
        with self._phase("agent"):
            outcome = self._agent.wait(max(0.0, self._agent_deadline - time.monotonic()))
        self.sandbox.kill_all()  # nothing the agent started survives into verification
        result.agent_exit_code = outcome.exit_code
        result.agent_log_tail = _tail(outcome.stderr + outcome.stdout, LOG_TAIL_CHARS)
        gateway = self.gateway_session
        gateway.wait_idle()  # a turn is recorded just after Pi has its answer
        # The record is what the gateway saw; Pi's session file is the agent's to rewrite.
        result.pi_session_messages = parse_session(self._session_text()).messages
        conversation = gateway_conversation(gateway.turns)
        result.messages, result.tools = conversation.messages, conversation.tools
        result.rewritten_turns, result.stop_reason = conversation.rewritten_turns, conversation.stop_reason
        last = gateway.turns[-1] if gateway.turns else None
        if self._closed:  # close() from another thread killed the agent: not the agent's failure
            return self._fail("infra", "the session was closed while the agent ran")
        if outcome.timed_out:
            result.stop_reason = "timeout"
            # Unscored only when the endpoint had not begun its answer to a streamed call (Pi's
            # way): a slow non-streamed call is the agent's choice, which it cannot make a dodge.
            if not conversation.messages or (
                last is not None and last.client_disconnected and last.ttfb_s is None and last.streamed is not False
            ):
                return self._fail(
                    "agent_timeout",
                    f"the agent's {self._agent_limit():g} s limit passed while the model "
                    "endpoint had not begun its answer (or before Pi called it)",
                )
            # Otherwise the agent spent its own time (a hung tool, a killed or stopped Pi, its own
            # non-streamed call): scored.
        elif getattr(gateway.strategy, "stop_reason", None):  # interception_gate: the trainer never answered
            result.stop_reason = gateway.strategy.stop_reason
            return self._fail("gate_timeout", gateway.strategy.stop_message)
        elif gateway.budget_exhausted:
            # A budget, not a failure: the gateway ended the turn cleanly, and what the agent
            # did is scored.
            result.stop_reason, result.budget_exhausted = "budget", gateway.budget_exhausted
        elif last is not None and (last.upstream_error or (last.upstream_status or 0) >= 400):
            status = last.upstream_status
            if status is None or status >= 500 or status in ENDPOINT_FAULT_STATUSES:
                return self._fail(
                    "endpoint_error",
                    f"model endpoint failed ({status or 'unreachable'}): {_tail(last.upstream_error or '', 500)}",
                )
            if not conversation.messages:  # refused before the agent ever had a turn: the harness's request
                return self._fail(
                    "agent_error",
                    f"the model endpoint refused the first call ({status}): {_tail(last.upstream_error or '', 500)}",
                )
        elif last is None:  # Pi never called the model: it could not start
            message = _tail(outcome.stderr, 500) or f"Pi exited {outcome.exit_code} without calling the model"
            return self._fail("agent_error", message)
        # Whatever else ended the agent (Pi stopped, crashed or was killed, its session file
        # mangled) is the agent's outcome, and verified like any other.
        self._verify()

    def _keep_setup_world(self) -> None:
        """Remember the world setup left, for verify (_verify_world, pi_env.verify): which of the
        verifier's files setup made, the home but the work dir where the sandbox can put it back
        in place, which hooks setup itself made."""
        sandbox = self.sandbox
        setup_env = record_setup(sandbox, self.task, setup_ran=self._setup_ran(), env=self._spec.env)
        if isinstance(sandbox, RestoresHome):
            sandbox.checkpoint_home()
            self._reserve()
        self._verify_env = verify_env(sandbox, self.task, setup_env, self.config.extra_env)

    def _setup_ran(self) -> bool:
        """Did anything but pi-env make the work dir (setup commands, a built environment)?"""
        return bool(self.task.setup or self.config.extra_setup_shell or self._spec.environment)

    def _reserve(self) -> None:
        """Room for verify's own files in a capped home, out of the agent's reach (pi_env.verify)."""
        if not isinstance(self.sandbox, RestoresHome):
            return  # verify gets a fresh sandbox
        try:
            reserve(self.sandbox, self.task, self._spec.limits.max_disk_bytes)
        except OSError as error:  # a later step's agent filled its home already: verify goes without
            self._result.agent_log_tail += f"\n[pi-env] no room kept for verify ({error.strerror or error})"

    def _verify_world(self) -> Sandbox:
        """The sandbox verify runs in: one the agent did not shape. Everything outside the work
        dir (and AGENT_OUTPUT_DIRS) goes back to what setup left: in place where commands can
        write only the home (local, podman, unsafe-local: /tmp is per command there, or the
        sandbox's own TMPDIR), or else (remote services, where the agent was root of the whole
        machine) a fresh sandbox gets the task's files, setup again, and the agent's work dir."""
        sandbox = self.sandbox
        if isinstance(sandbox, RestoresHome):
            # A later step's agent continues in its own home: keep it aside meanwhile.
            self._agent_home_aside = (
                bool(later_steps(self.task)) if not self._in_later_step else self._later_steps_left > 0
            )
            # The reserve stays through the restore (which may not fit if the agent filled its
            # home), then makes room for verify's own files.
            reserved = RESERVE_DIR.removeprefix(f"{SANDBOX_HOME}/")
            for problem in sandbox.restore_home((*AGENT_OUTPUT_DIRS, reserved), set_aside=self._agent_home_aside):
                self._result.agent_log_tail += f"\n[pi-env] {problem}"
            sandbox.remove(RESERVE_DIR)
            return sandbox
        if not isinstance(sandbox, ExportsTrees):
            raise SandboxError(
                f"the {self.factory.backend.name!r} backend can neither restore its home "
                "(restore_home) nor hand a work dir to a fresh sandbox (export_tree/import_tree): "
                "verify would run in the world the agent shaped"
            )
        trees = {
            path: sandbox.export_tree(path)
            for path in (SANDBOX_WORKDIR, *(f"{SANDBOX_HOME}/{name}" for name in AGENT_OUTPUT_DIRS))
        }
        fresh = self.factory.backend.create(self._spec)
        try:
            for path, text in self.task.files.items():
                fresh.write_file(path, text)
            first_run = len(self._result.setup_results)
            try:
                failed = None if self._run_setup(fresh) else self._result.setup_results[-1]
            finally:
                del self._result.setup_results[first_run:]  # the first run's results are the rollout's
            if failed:
                raise SandboxError(
                    f"setup command {failed.cmd!r} passed before the agent but failed in the "
                    f"fresh verify sandbox: {_tail(failed.stderr or failed.stdout, 300)}"
                )
            record_setup(fresh, self.task, setup_ran=self._setup_ran(), env=self._spec.env)
            for path, data in trees.items():
                fresh.import_tree(path, data)
        except BaseException:
            fresh.close()
            raise
        self.sandbox = fresh
        sandbox.close()
        return fresh

    def _verify(self) -> None:
        task, result = self.task, self._result
        with self._phase("verify"):
            try:
                sandbox = self._verify_world()
                moved, notes = set_aside(sandbox, task)
                result.verify_notes += notes
            except (SandboxError, OSError) as error:
                return self._fail("infra", f"could not give verify a clean world: {type(error).__name__}: {error}")
            for command in task.verify:
                stage(sandbox, task)  # afresh for each: agent code an earlier command ran may have changed them
                result.verify_results.append(
                    self._run(
                        command,
                        task.timeouts.verify_s or self.config.verify_timeout_s,
                        "full" if task.verify_network else "none",
                        env=self._verify_env,
                    )
                )
            sandbox.kill_all()
            self._score_reward()
            put_back(sandbox, task, moved)
            self._score()

    def _score(self) -> None:
        self._read_left -= collect_artifacts(
            self.task, self.sandbox, self._result, step=self._step_index, max_total_bytes=self._read_left
        )
        if self._in_later_step:
            return  # _run_later_steps combines the steps' rewards
        if later := later_steps(self.task):
            self._run_later_steps(later)
        result = self._result
        self._read_left -= collect_artifacts(self.task, self.sandbox, result, max_total_bytes=self._read_left)
        if why := unsupported_reasons(self.task, self.factory.backend.name) if is_harbor(self.task) else []:
            # Run anyway (--include-unsupported), but an environment not honoured scores nothing.
            self._fail("environment_unsupported", "the environment was not honoured: " + "; ".join(why))

    def _run_later_steps(self, later: list[PiTask]) -> None:
        """A multi-step Harbor task: after the first step was verified, each later step's agent
        (a new Pi run on its instruction, same sandbox) and verifier; one reward by the task's
        strategy. A step below its min_reward, or whose verifier left no valid reward (a 0.0),
        ends the run; a step whose agent fails leaves the rollout unscored with that error."""
        first, result = self.task, self._result
        if result.error_kind is not None:
            return
        rewards = [result.reward]
        result.step_rewards = [result.reward]
        try:
            self._in_later_step = True
            for index, step in enumerate(later):
                if not self._step_verified:
                    break  # the previous step has no verifier result: Harbor ends the run there
                if why := step_gate(first, index, rewards[-1]):
                    result.agent_log_tail += f"\n[pi-env] {why}"
                    break
                self.task, self._later_steps_left, self._step_index = step, len(later) - index - 1, index + 1
                self._next_step_endpoint(step)
                if self._agent_home_aside:  # the agent continues in its home, not in verify's world
                    self.sandbox.put_back_agent_home()
                self.sandbox.remove(f"{SANDBOX_HOME}/tests")  # the previous step's verifier
                if not self._prepare_step(step_own(first, index + 1)):
                    break
                self._reserve()
                self._start_agent(self.factory.runtime)
                self._finish_agent()
                if result.error_kind is not None:
                    return  # the agent or the sandbox failed: unscored, with that error
                rewards.append(result.reward)
                result.step_rewards.append(result.reward)
        finally:
            self.task, self._in_later_step, self._step_index = first, False, 0
        combined = combine_step_rewards(first, rewards)
        if combined is None:
            return self._fail("internal", "no step of the multi-step task has a reward")
        result.reward, result.reward_source, result.error_kind, result.error = combined, "reward_file", None, None

    def _prepare_step(self, own: dict) -> bool:
        """What Harbor does before a later step's agent: the step's workdir/ files into the work
        dir, then its setup.sh and healthcheck. One failing ends the run there, as in Harbor:
        the reward is combined over the steps that ran (False)."""
        for path, text in own["files"].items():
            self.sandbox.write_file(path, text)
        for command in own["setup"]:
            self._check_open()
            outcome = self._run(
                command,
                self.task.timeouts.setup_s or self.config.setup_timeout_s,
                "full" if self.task.setup_network else "none",
            )
            self._result.setup_results.append(outcome)
            if not outcome.passed:
                self._check_open()  # close() killed it: not the task's failure
                why = "timed out" if outcome.timed_out else f"exited {outcome.exit_code}"
                self._result.agent_log_tail += (
                    f"\n[pi-env] step {own['name']!r}: setup command {command!r} {why}: "
                    f"{_tail(outcome.stderr or outcome.stdout, 300)}; later steps skipped"
                )
                return False
        return True

    def _next_step_endpoint(self, step: PiTask) -> None:
        """The oracle replays each step's own solution: a new script, and the session's upstream
        key switched to it (Pi keeps its gateway token)."""
        if not (self.endpoint and self.endpoint.synthetic and self.config.endpoint == ORACLE):
            return
        endpoint = oracle_endpoint(step)
        self._step_endpoints.append(endpoint)
        self.gateway_session.upstream = dataclasses.replace(self.gateway_session.upstream, api_key=endpoint.api_key)

    def _score_reward(self) -> None:
        """The reward: the reward file where the task uses one (pi_env.verify.read_reward), else
        the verify commands' pass rate."""
        result = self._result
        reading = read_reward(self.sandbox, self.task)
        result.verify_notes += reading.notes
        self._step_verified = reading.valid
        if reading.reward is not None:
            result.reward, result.reward_source = reading.reward, "reward_file"
        elif result.verify_results:
            passed = sum(1 for r in result.verify_results if r.passed)
            result.reward, result.reward_source = passed / len(result.verify_results), "pass_rate"
        else:
            self._fail("no_verify", "the task has no verify commands and no reward file")

    def _collect(self) -> None:
        result, config = self._result, self.config
        if self.gateway_session is not None:
            result.proxy_turns = self.fetch_proxy_trace()
            result.proxy_log_tail = "\n".join(
                [result.proxy_log_tail]
                + [
                    f"turn {t.turn}: status {t.upstream_status} in {t.latency_s or 0:.3f} s"
                    + (f" error {t.upstream_error[:200]}" if t.upstream_error else "")
                    for t in result.proxy_turns
                ]
            ).strip()
            if config.mode in ("transparent_proxy", "interception_gate"):
                result.training = build_training_trace(result.proxy_turns)
        if self.sandbox is not None and config.result_max_files:
            try:
                with self._phase("collect"):
                    snapshot = self._read_tree(SANDBOX_WORKDIR, config.result_max_files, config.result_max_file_bytes)
                result.files = {path: _as_text(data) for path, data in snapshot.items()}
            except (SandboxError, OSError) as error:
                result.agent_log_tail += f"\n[pi-env] could not collect files: {error}"

    def fetch_proxy_trace(self) -> list[RolloutTurn]:
        """Every model call so far, with the engine's ids and logprobs in transparent_proxy."""
        if self.gateway_session is None:
            return []
        self.gateway_session.wait_idle()
        return [_rollout_turn(record) for record in list(self.gateway_session.turns)]

    def fetch_training_trace(self) -> TrainingTrace:
        """The token-level training view of the calls so far (see pi_env.training)."""
        return build_training_trace(self.fetch_proxy_trace())

    # -- interception_gate: the trainer generates ---------------------------------------------
    def next_request(self, timeout_s: float | None = None) -> GateRequest | None:
        """The agent's next model call, held until `deliver()`. None once the agent has exited
        (or its time is up, or the session is closed): then call wait_for_completion().
        TimeoutError when `timeout_s` passes first with the agent still working."""
        gate, wait = self._gate_wait(timeout_s)
        if gate is None:
            return None
        try:
            return gate.next_request(wait, alive=self._agent_alive)
        except TimeoutError:
            if timeout_s is not None and timeout_s <= wait:
                raise
            return None  # the agent's own time is up: wait_for_completion() kills it and says so

    async def anext_request(self, timeout_s: float | None = None) -> GateRequest | None:
        """`next_request` for async code (any event loop)."""
        gate, wait = self._gate_wait(timeout_s)
        if gate is None:
            return None
        try:
            return await gate.anext_request(wait, alive=self._agent_alive)
        except TimeoutError:
            if timeout_s is not None and timeout_s <= wait:
                raise
            return None

    def deliver(self, request: GateRequest | str, completion: GateCompletion | dict | str) -> None:
        """Answer a held call with the trainer's completion (see pi_env.proxy.gate). Raises
        RequestNotPending or CompletionInvalid; returns at once."""
        self._gate().deliver(request, completion)

    async def adeliver(self, request: GateRequest | str, completion: GateCompletion | dict | str) -> None:
        self.deliver(request, completion)

    def _gate(self):
        if self.config.mode != "interception_gate":
            raise RuntimeError(f"next_request/deliver need mode='interception_gate', not {self.config.mode!r}")
        if self.gateway_session is None:
            raise RuntimeError("the session failed before its gateway session opened: there is nothing to answer")
        return self.gateway_session.strategy

    def _gate_wait(self, timeout_s: float | None):
        """The gate (None: no agent ever ran) and how long to wait: never past the agent's deadline."""
        if self.config.mode != "interception_gate":
            self._gate()  # raises: not a gate session
        if self.gateway_session is None or self._agent is None:
            return None, 0.0
        left = max(0.0, self._agent_deadline - time.monotonic())
        return self.gateway_session.strategy, left if timeout_s is None else min(timeout_s, left)

    def _agent_alive(self) -> bool:
        return self._agent is not None and self._agent.poll() is None

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
        for endpoint in self._step_endpoints:
            release_oracle(endpoint)

    def _end_gateway_session(self) -> None:
        """Revoke the session's token; without a trace_dir its trace was scratch: delete it.
        Idempotent (close() and a setup that close() interrupted may both call it)."""
        if self.gateway_session is not None:
            get_gateway().close_session(self.gateway_session)
            if self.config.trace_dir is None and self.gateway_session.trace_path:
                Path(self.gateway_session.trace_path).unlink(missing_ok=True)
                self._result.trace_path = None

    def __enter__(self) -> PiSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------
    def _run(
        self,
        command: str,
        timeout_s: float,
        network,
        *,
        env: dict[str, str] | None = None,
        sandbox: Sandbox | None = None,
    ) -> CommandResult:
        outcome = (sandbox or self.sandbox).exec(command, timeout_s=timeout_s, network=network, env=env)
        return CommandResult(
            cmd=command,
            exit_code=outcome.exit_code,
            stdout=outcome.stdout,
            stderr=outcome.stderr,
            duration_s=round(outcome.duration_s, 4),
            timed_out=outcome.timed_out,
        )

    def _read_tree(self, path: str, max_files: int, max_file_bytes: int) -> dict[str, bytes]:
        """Files the agent may have written, within what is left of the rollout's read budget."""
        files = self.sandbox.snapshot(
            path,
            max_files=max_files,
            max_file_bytes=min(max_file_bytes, self._read_left),
            max_total_bytes=self._read_left,
        )
        self._read_left -= sum(len(data) for data in files.values())
        return files

    def _session_text(self) -> str:
        try:
            files = self._read_tree(SESSION_DIR, 4, 256 << 20)
        except (SandboxError, OSError):
            return ""
        return "\n".join(data.decode("utf-8", "replace") for _, data in sorted(files.items()) if _.endswith(".jsonl"))

    def _agent_limit(self) -> float:
        return self.task.timeouts.agent_s or self.config.agent_timeout_s

    def _fail(self, kind: ErrorKind, message: str) -> None:
        self._result.reward = None
        self._result.reward_source = None
        self._result.error_kind = kind
        self._result.error = message

    def _phase(self, name: str):
        return _Phase(self, name)

    def _emit(self, kind: str, **fields) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(RolloutEvent(kind=kind, elapsed_s=round(time.monotonic() - self._started, 4), **fields))
        except Exception:
            log.exception("on_event listener failed on %s", kind)


class _Phase:
    """Times a phase into `result.timings` and reports its start and end."""

    def __init__(self, session: PiSession, name: str):
        self.session, self.name = session, name

    def __enter__(self):
        self.start = time.monotonic()
        self.session._emit("phase_start", phase=self.name)

    def __exit__(self, *exc):
        timings = self.session._result.timings
        timings[self.name] = round(timings.get(self.name, 0.0) + time.monotonic() - self.start, 4)
        self.session._emit("phase_end", phase=self.name)


def _rollout_turn(record: TurnRecord) -> RolloutTurn:
    turn = RolloutTurn(
        turn=record.turn,
        latency_s=record.latency_s,
        ttfb_s=record.ttfb_s,
        timestamp=record.started_at,
        upstream_status=record.upstream_status,
        upstream_error=record.upstream_error,
    )
    capture = record.capture
    if capture is not None:
        first = capture.choices[0] if capture.choices else None
        turn.finish_reason = capture.finish_reason
        turn.completion_tokens = capture.completion_tokens
        turn.prompt_token_ids = capture.prompt_token_ids
        turn.completion_token_ids = capture.completion_token_ids
        turn.per_token_logps = capture.per_token_logps
        turn.top_logprobs = first.decoded_top_logprobs() if first else []
        turn.token_ids_source = capture.token_ids_source
        turn.token_ids_missing_reason = capture.token_ids_missing_reason
        turn.capture_fallback = capture.fallback
        turn.capture_worker_error = capture.worker_error
        turn.message = first.message() if first else None
        turn.token_in = capture.token_in
    return turn


def _with_forced_sampling(config: PiConfig, sampling: Mapping[str, float | int], *, explicit_mode: bool) -> PiConfig:
    """`sampling=` (what a trainer passes, e.g. openenv's `training_sampling(...)`) over
    `proxy_sampling`: forced on every model call. black_box relays the agent's sampling as sent
    and so cannot force it: a mode nobody chose becomes transparent_proxy, a chosen black_box is refused."""
    mode = config.mode
    if mode == "black_box":
        if explicit_mode or "mode" in config.model_fields_set:
            raise ValueError(
                "sampling= is forced on model calls by the gateway in transparent_proxy; black_box "
                "relays the agent's sampling as sent: use mode='transparent_proxy'"
            )
        mode = "transparent_proxy"
    config = config.model_copy()
    config.mode = mode  # validate_assignment: checked like any PiConfig field
    config.proxy_sampling = {**config.proxy_sampling, **dict(sampling)}
    return config


def _mb(megabytes: int | None) -> int | None:
    return megabytes << 20 if megabytes else None


def _tail(text: str, limit: int) -> str:
    return text[-limit:] if len(text) > limit else text


def _as_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return f"<binary file, {len(data)} bytes>"


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


def private_scratch_dir(name: str) -> Path:
    """`$TMPDIR/<name>-<uid>`, 0700 and ours (another user could have made it first in a shared /tmp)."""
    directory = Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{directory} is not a directory of this user; remove it or set trace_dir")
    if info.st_mode & 0o077:
        directory.chmod(0o700)
    return directory
