"""A rollout's phases, each a function over its `RolloutContext` (pi_env.rollout.context).

`PiSession` (pi_env.rollout.session) runs them in this order and times each (`ctx.clock`); a
multi-step Harbor task's later steps (pi_env.rollout.steps) run `start_agent`, `judge` and
`verify` again for each step's task. A phase that fails for reasons not the agent's ends the
rollout unscored (`ctx.fail`: reward None with an error kind) and returns False or None, so the
session skips the phases after it.

  endpoint        resolve_endpoint   the catalog's endpoint, the oracle, or the trainer
  runtime         factory.runtime    the agent, installed once per machine
  gateway         open_gateway       the session the agent's calls go through (its own token)
  sandbox_create  create_sandbox     a fresh sandbox with the task's files
  setup           run_setup          setup commands in order; the first failure aborts
  agent_start     start_agent        the agent's settings and prompt, the agent started
  agent           judge              wait, kill leftovers, judge the agent's outcome (pi_env.judge)
  keep_workdir    keep_workdir       PiConfig.keep_workdir: the work dir as verify will see it
  verify          verify, score      setup's world (pi_env.verify.world), verify_files, verify
                                     commands, the reward (pi_env.judge)
  collect         collect            turns, the training view, the work dir's files
"""

from __future__ import annotations

import time

from ..agent.base import AgentRun, Installed
from ..errors import unscored
from ..harbor.facts import is_harbor
from ..harbor.rules import environment_record, unsupported_reasons
from ..judge import AgentEnd, LastCall, judge_agent, score_reward, tail
from ..proxy.conversation import gateway_conversation
from ..proxy.gateway import get_gateway
from ..results import CommandResult, RolloutTurn
from ..sandbox import Sandbox, SandboxError
from ..sandbox.base import Network
from ..specs import forced_sampling, open_gateway_session, sandbox_spec, session_endpoint
from ..task import PiTask
from ..task_setup import capped
from ..task_setup import run_setup as run_setup_commands
from ..training import build_training_trace
from ..turns import proxy_trace, rollout_turn, turn_log
from ..verify import SETUP_PATHS, RewardReading, read_reward, stage
from ..verify.room import Entered, RoomError, enter, leave, restage_task_files, room_for
from ..verify.room import run as run_in_room
from ..verify.workdir import WorkdirLimits
from ..verify.world import VerifyWorld
from .context import LOG_TAIL_CHARS, RolloutContext, StepOutcome, made


def resolve_endpoint(ctx: RolloutContext) -> None:
    """The endpoint the agent's calls go to (bad input raises), and what the result says of it."""
    config, result = ctx.config, ctx.result
    ctx.endpoint = session_endpoint(config, ctx.task, ctx.factory.agent.submit_command)
    result.endpoint, result.model, result.synthetic = ctx.endpoint.name, ctx.endpoint.model, ctx.endpoint.synthetic
    if config.mode.captures:  # black_box relays the agent's sampling as sent: nothing is forced
        result.sampling = forced_sampling(config)


def open_gateway(ctx: RolloutContext, token_in) -> None:
    """The gateway session the agent's calls go through, with its own token; each recorded call
    is reported to the caller's listener as it lands."""
    result = ctx.result
    ctx.gateway_session = open_gateway_session(
        ctx.config,
        made(ctx.endpoint, "endpoint"),
        result,
        task_id=ctx.task.task_id,
        episode_id=ctx.episode_id,
        token_in=token_in,
        policy=ctx.factory.policy,
    )
    result.trace_path = ctx.gateway_session.trace_path
    result.session_id = ctx.gateway_session.id
    if token_in is not None:
        result.proxy_log_tail += f"\ntoken-in: renderer {token_in.resolved} over tokenizer {token_in.tokenizer}"
    if ctx.clock.on_event is not None:
        ctx.gateway_session.on_record = lambda record: ctx.clock.emit("turn", turn=rollout_turn(record))


def create_sandbox(ctx: RolloutContext, runtime: Installed) -> None:
    """A fresh sandbox for the task (its spec: pi_env.specs), verify's world beside it, the
    task's files written."""
    config, factory = ctx.config, ctx.factory
    ctx.spec = sandbox_spec(config, ctx.task, factory.backend.name, factory.agent, runtime, get_gateway().socket_path)
    ctx.world = VerifyWorld(
        factory.backend,
        ctx.spec,
        caller_env=config.sandbox.extra_env,
        extra_setup=bool(config.sandbox.extra_setup_shell),
        note=ctx.note,
    )
    ctx.sandbox = factory.backend.create(ctx.spec)
    ctx.result.sandbox_id = ctx.sandbox.id
    ctx.check_open()
    ctx.result.environment = environment_record(ctx.task, ctx.sandbox)
    for path, text in ctx.task.files.items():
        ctx.sandbox.write_file(path, text)


def run_setup(ctx: RolloutContext, task: PiTask) -> bool:
    """The setup commands in order (pi_env.task_setup), then verify's world keeps what setup
    made; False (the rollout failed, `setup_failed`) at the first that fails."""
    sandbox = made(ctx.sandbox, "sandbox")
    if failed := run_setup_commands(sandbox, ctx.config, task, ctx.result.setup_results, check_open=ctx.check_open):
        ctx.fail("setup_failed", failed)
        return False
    if why := made(ctx.world, "verify world").keep_setup(sandbox, task):
        ctx.fail("setup_failed", why)
        return False
    return True


def setup_again(ctx: RolloutContext, task: PiTask, sandbox: Sandbox) -> CommandResult | None:
    """Setup in a fresh verify sandbox (VerifyWorld.build): the command that failed, or None.
    The first run's results are the rollout's: these are not kept."""
    results: list[CommandResult] = []
    return results[-1] if run_setup_commands(sandbox, ctx.config, task, results, check_open=ctx.check_open) else None


def start_agent(ctx: RolloutContext, runtime: Installed, task: PiTask) -> None:
    """The agent on `task`'s instruction (the task's, or a later step's), its clock started."""
    sandbox, agent = made(ctx.sandbox, "sandbox"), ctx.factory.agent
    run = AgentRun(
        ctx.config,
        made(ctx.endpoint, "endpoint"),
        made(ctx.gateway_session, "gateway session").token,
        task.instruction,
    )
    agent.prepare(sandbox, runtime, run)
    ctx.agent_deadline = time.monotonic() + ctx.agent_limit(task)
    ctx.agent = agent.start(sandbox, runtime, run)


def judge(ctx: RolloutContext, task: PiTask) -> bool:
    """Wait for the agent, kill what it left running, rebuild the conversation from the
    gateway's records and judge the outcome (pi_env.judge). False: the rollout failed, unscored."""
    result = ctx.result
    with ctx.clock.phase("agent"):
        outcome = made(ctx.agent, "agent").wait(max(0.0, ctx.agent_deadline - time.monotonic()))
    sandbox = made(ctx.sandbox, "sandbox")
    sandbox.kill_all()  # nothing the agent started survives into verification
    result.agent_exit_code = outcome.exit_code
    result.agent_log_tail = tail(outcome.stderr + outcome.stdout, LOG_TAIL_CHARS)
    gateway = made(ctx.gateway_session, "gateway session")
    gateway.wait_idle()  # a turn is recorded just after the agent has its answer
    # The record is what the gateway saw; the agent's own transcript is the agent's to rewrite.
    result.agent_transcript = ctx.reads.transcript(ctx.factory.agent, sandbox)
    if ctx.factory.agent.name == "pi":
        result.pi_session_messages = result.agent_transcript
    calls = [record for record in gateway.turns if extra_call(ctx, record) is None]
    conversation = gateway_conversation(calls)
    result.messages, result.tools = conversation.messages, conversation.tools
    result.rewritten_turns, result.stop_reason = conversation.rewritten_turns, conversation.stop_reason
    last = calls[-1] if calls else None
    gate_stop = gateway.stopped()  # interception_gate: the trainer never answered
    verdict = judge_agent(
        AgentEnd(
            closed=ctx.closed,
            timed_out=outcome.timed_out,
            exit_code=outcome.exit_code,
            stderr=outcome.stderr,
            answered=bool(conversation.messages),
            last=LastCall.of(last) if last is not None else None,
            gate_stop=gate_stop.reason if gate_stop else None,
            gate_message=gate_stop.message if gate_stop else None,
            budget_exhausted=gateway.budget_exhausted,
            limit_s=ctx.agent_limit(task),
        )
    )
    if verdict.stop_reason:
        result.stop_reason = verdict.stop_reason
    if verdict.budget_exhausted:
        result.budget_exhausted = verdict.budget_exhausted
    if verdict.truncated:
        result.truncated = True
    if verdict.error_kind is not None:
        ctx.fail(verdict.error_kind, verdict.error or verdict.error_kind)
    return verdict.scored


def keep_workdir(ctx: RolloutContext) -> None:
    """PiConfig.result.keep_workdir: the work dir as verify is about to see it (pi_env.verify.workdir)."""
    config, result = ctx.config, ctx.result
    if ctx.more_steps_after(0):
        result.workdir_not_kept = "a multi-step task: reverify scores single-step tasks only"
        return
    limits = WorkdirLimits(config.result.keep_workdir_max_files, config.result.keep_workdir_max_bytes)
    with ctx.clock.phase("keep_workdir"):
        result.workdir_archive, result.workdir_not_kept = ctx.reads.keep_workdir(made(ctx.sandbox, "sandbox"), limits)


def verify(ctx: RolloutContext, task: PiTask, index: int) -> StepOutcome | None:
    """Step `index` of the task (0: the task itself, or `task` for a later step) verified in a
    world the agent did not shape, on its work as data (pi_env.verify.room), and its reward; None
    when that world could not be made for reasons not the agent's (the rollout failed)."""
    result, world = ctx.result, made(ctx.world, "verify world")
    try:
        sandbox, home_aside = world.build(
            made(ctx.sandbox, "sandbox"),
            task,
            more_steps=ctx.more_steps_after(index),
            setup_again=lambda fresh: setup_again(ctx, task, fresh),
        )
        if sandbox is not ctx.sandbox:
            ctx.sandbox, old = sandbox, ctx.sandbox
            old.close()
        room = room_for(sandbox, task, SETUP_PATHS)
    except (SandboxError, OSError) as error:
        ctx.fail(*unscored(error, "could not give verify a clean world"))
        return None
    refused, entered = None, Entered()
    limit = capped(task.timeouts.verify_s, ctx.config.limits.verify_timeout_s)
    network: Network = "full" if task.verify_network else "none"
    for position, command in enumerate(task.verify):
        try:
            if position == 0:
                entered = enter(sandbox, task, room)
                restage_task_files(sandbox, task)
                stage(sandbox, task, entered)
                outcome = ctx.run(command, limit, network, env=world.env_for(task))
            else:  # nothing an earlier command's agent code left runs on, or shapes this one's room
                sandbox.kill_all()
                outcome = run_in_room(
                    sandbox, task, room, entered, command, timeout_s=limit, network=network, env=world.env_for(task)
                )
        except OSError as error:
            if isinstance(error, RoomError) and error.moved:
                entered = Entered(error.moved)
            if position == 0 and not (isinstance(error, RoomError) and error.agents):
                ctx.fail(*unscored(error, "could not give verify a clean room"))
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
        ctx.fail(score.error_kind, score.error or score.error_kind)
    else:
        result.reward, result.reward_source = score.reward, score.source
    leave(sandbox, task, entered)
    ctx.reads.artifacts(ctx.task, ctx.sandbox, result, step=index)
    return StepOutcome(result.reward, reading.valid, home_aside)


def score(ctx: RolloutContext) -> None:
    """After every step: the task's artifacts, and no score for an environment not honoured."""
    result = ctx.result
    ctx.reads.artifacts(ctx.task, ctx.sandbox, result)
    if why := unsupported_reasons(ctx.task, ctx.factory.backend.name) if is_harbor(ctx.task) else []:
        # Run anyway (--include-unsupported), but an environment not honoured scores nothing.
        ctx.fail("environment_unsupported", "the environment was not honoured: " + "; ".join(why))


def collect(ctx: RolloutContext) -> None:
    """What the result keeps of the rollout: every model call as a turn (an agent's extra calls
    marked), the replicas' health, the training view (the modes that capture ids) and the work
    dir's files, within the read budget."""
    result, config = ctx.result, ctx.config
    if ctx.gateway_session is not None:
        result.proxy_turns = proxy_turns(ctx)
        extra = {record.turn: why for record in ctx.gateway_session.turns if (why := extra_call(ctx, record))}
        for turn in result.proxy_turns:
            turn.extra_call = extra.get(turn.turn)
        result.replicas = ctx.gateway_session.replica_health()
        result.proxy_log_tail = turn_log(result.proxy_log_tail, result.proxy_turns)
        if config.mode.captures:
            result.training = build_training_trace(result.proxy_turns)
    if ctx.sandbox is not None and config.result.max_files:
        try:
            with ctx.clock.phase("collect"):
                result.files = ctx.reads.files(ctx.sandbox, config.result.max_files, config.result.max_file_bytes)
        except (SandboxError, OSError) as error:
            result.agent_log_tail += f"\n[pi-env] could not collect files: {error}"


def proxy_turns(ctx: RolloutContext) -> list[RolloutTurn]:
    """Every model call so far, with the engine's ids and logprobs in the modes that capture them."""
    return proxy_trace(ctx.gateway_session)


def extra_call(ctx: RolloutContext, record) -> str | None:
    """Why the agent's call `record` is not part of the task's conversation (the agent says:
    OpenCode's title call), or None."""
    capture = record.capture
    request = capture.request if capture is not None and isinstance(capture.request, dict) else None
    return ctx.factory.agent.extra_call(request) if request is not None else None
