"""The rules that decide a rollout's outcome, as pure functions (no sandbox, no gateway, no Pi):

- `judge_agent(AgentEnd) -> Verdict`: what ended the agent, judged from what the sandbox and
  the gateway saw (never from Pi's own files): an unscored error (its `ErrorKind` and message)
  or the agent's own outcome, which is verified and scored. Unscored are only: a session closed
  under the agent (`infra`), a trainer that never answered (`gate_timeout`), a failing endpoint
  (`endpoint_error`), a Pi that never got a first answer (`agent_error`), and a time limit that
  passed before Pi called the model at all (`agent_timeout`, below).
- `score_reward(reward_file, verify_results) -> Score`: the reward file's value where the task
  uses one (read by `pi_env.verify.read_reward`), else the verify commands' pass rate, else
  `no_verify`.

A zero stays a zero, by ownership: an agent whose time runs out is scored on what it left
(`stop_reason="timeout"`, `truncated`), whatever it was doing when it was stopped: a hung
tool, a stopped Pi, a call of its own in flight, streamed or not, begun or not. It chooses when
and how it calls, so a call it starts (or a stall) just before its time is up must not turn its
0 into an unscored result that trainers drop. A budget is scored too (the gateway ended the
turn cleanly), also `truncated`. The one time-out left unscored is one the agent provably had
no part in: Pi never called the model in the whole rollout (no call the gateway recorded, any
step's), so no answer of the model's ever existed and nothing in the sandbox is its doing; Pi
that cannot get going is pi-env's (like `agent_error`). An endpoint that never began answering
a call is not that proof: once a call is made, the gateway cannot always tell a hung endpoint
from the model's own long answer (an unstreamed answer's first byte is its last), so a
time-out with a call in flight, the first one included, is scored.

`PiSession` (pi_env.rollout) gathers the facts, asks these, and applies the answer to its result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .results import CommandResult, ErrorKind

# Answers that say the endpoint (or pi-env's config of it) is at fault, not the agent's request.
ENDPOINT_FAULT_STATUSES = frozenset({401, 403, 404, 408, 429})


@dataclass(frozen=True)
class LastCall:
    """The gateway's record of the agent's last model call (the fields of `TurnRecord` the
    judge reads)."""

    upstream_status: int | None = None  # None: no answer from upstream at all
    upstream_error: str | None = None
    upstream_broke: bool = False  # the endpoint's answer broke after its first byte

    @classmethod
    def of(cls, record) -> LastCall:
        """From a `pi_env.proxy.gateway.TurnRecord` (or anything with its fields)."""
        return cls(
            upstream_status=record.upstream_status,
            upstream_error=record.upstream_error,
            upstream_broke=record.upstream_broke,
        )


@dataclass(frozen=True)
class AgentEnd:
    """What is known once the agent's process is over (or killed at its time limit)."""

    closed: bool = False  # close() from another thread killed the agent
    timed_out: bool = False  # the agent's time limit passed
    exit_code: int | None = None
    stderr: str = ""
    answered: bool = False  # the conversation rebuilt from the gateway's records has messages
    last: LastCall | None = None  # None: Pi never called the model (in the rollout: every step's calls)
    gate_stop: str | None = None  # interception_gate's stop reason (a held call expired)
    gate_message: str | None = None
    budget_exhausted: str | None = None  # "max_turns" / "max_total_tokens": the gateway ended the turn
    limit_s: float = 0.0  # the agent's time limit, for the message


@dataclass(frozen=True)
class Verdict:
    """The judge's answer. `error_kind` None: the agent's outcome, verified and scored."""

    error_kind: ErrorKind | None = None
    error: str | None = None
    stop_reason: str | None = None  # replaces the conversation's stop reason when set
    budget_exhausted: str | None = None  # set on the result when a budget ended the agent
    truncated: bool = False  # its time limit or a budget stopped the agent, not its own end

    @property
    def scored(self) -> bool:
        return self.error_kind is None


def judge_agent(end: AgentEnd) -> Verdict:
    """What ended the agent: an unscored error, or its own outcome (scored). The first rule that
    applies decides, in this order."""
    last = end.last
    if end.closed:  # close() from another thread killed the agent: not the agent's failure
        return Verdict("infra", "the session was closed while the agent ran")
    if end.timed_out:
        if last is None:
            # Pi never called the model in the rollout: no answer of the model's ever existed,
            # so nothing in the sandbox is the agent's doing (a Pi that could not get going).
            return Verdict(
                "agent_timeout",
                f"the agent's {end.limit_s:g} s limit passed before Pi called the model",
                stop_reason="timeout",
                truncated=True,
            )
        # The agent's time, whatever it was doing: a hung tool, a killed or stopped Pi, a call
        # in flight (its own or Pi's, streamed or not, begun or not: it chooses when and how it
        # calls). Scored on what it left.
        return Verdict(stop_reason="timeout", truncated=True)
    if end.gate_stop:  # interception_gate: the trainer never answered
        return Verdict("gate_timeout", end.gate_message, stop_reason=end.gate_stop)
    if end.budget_exhausted:
        # A budget, not a failure: the gateway ended the turn cleanly, and what the agent did
        # is scored.
        return Verdict(stop_reason="budget", budget_exhausted=end.budget_exhausted, truncated=True)
    if last is not None and (last.upstream_error or (last.upstream_status or 0) >= 400):
        status = last.upstream_status
        if last.upstream_broke:  # a 200 whose stream the endpoint cut (a replica died): Pi got half an answer
            return Verdict(
                "endpoint_error", f"model endpoint broke its answer mid-stream: {tail(last.upstream_error or '', 500)}"
            )
        if status is None or status >= 500 or status in ENDPOINT_FAULT_STATUSES:
            return Verdict(
                "endpoint_error",
                f"model endpoint failed ({status or 'unreachable'}): {tail(last.upstream_error or '', 500)}",
            )
        if not end.answered:  # refused before the agent ever had a turn: the harness's request
            return Verdict(
                "agent_error",
                f"the model endpoint refused the first call ({status}): {tail(last.upstream_error or '', 500)}",
            )
        return Verdict()  # the agent's own bad request, after its first turn: scored
    if last is None:  # Pi never called the model: it could not start
        return Verdict("agent_error", tail(end.stderr, 500) or f"Pi exited {end.exit_code} without calling the model")
    # Whatever else ended the agent (Pi stopped, crashed or was killed, its session file
    # mangled) is the agent's outcome, and verified like any other.
    return Verdict()


@dataclass(frozen=True)
class Score:
    """A verified step's reward, or why it has none (`error_kind`: unscored)."""

    reward: float | None = None
    source: Literal["reward_file", "pass_rate"] | None = None
    error_kind: ErrorKind | None = None
    error: str | None = None


def score_reward(reward_file: float | None, verify_results: Sequence[CommandResult]) -> Score:
    """The reward file's value (`reward_file`: what `pi_env.verify.read_reward` read; None where
    the task uses none) wins; else the share of verify commands that passed; else unscored."""
    if reward_file is not None:
        return Score(reward_file, "reward_file")
    if verify_results:
        passed = sum(1 for r in verify_results if r.passed)
        return Score(passed / len(verify_results), "pass_rate")
    return Score(error_kind="no_verify", error="the task has no verify commands and no reward file")


def tail(text: str, limit: int) -> str:
    return text[-limit:] if len(text) > limit else text
