"""The value types a user or trainer sees, in one home: a rollout's result (`RolloutResult`,
`CommandResult`), its events (`RolloutEvent`), its model calls (`RolloutTurn`), the training view
(`TrainingTrace`, `TrainingSegment`, `TurnAlignment`), why it has no reward (`ErrorKind`, defined
with the exception tree in pi_env.errors and re-exported here) and a policy version's value
(`PolicyVersionValue`, the JSON scalar a trainer stamps on its weights). Each has one shape,
every field says what it holds. Field names follow the reference Pi environment (task_id,
sandbox_id, reward, agent_exit_code, wall_s, mode, setup_results, verify_results, proxy_turns,
files, agent_log_tail, proxy_log_tail, error) plus what a trainer or evaluator also needs.

Why here: the result is what every product of pi-env hands out (`run_rollout`, collect's records,
the server's answers, the harness), and it holds all the others, so one module (layer 2, on
pydantic only) lets a reader see the whole shape at once; pi_env.training keeps only the builder.

The conversions between these and the other forms of a turn or a result, one place each:
- gateway `TurnRecord` (pi_env.proxy.records, with its `TurnCapture`) -> `RolloutTurn`:
  `pi_env.turns.rollout_turn` (and `proxy_trace` for a whole session);
- `RolloutTurn`s -> `TrainingTrace`: `pi_env.training.build_training_trace`;
- an exception -> an unscored result (`reward=None`, `error_kind`, `error`):
  `pi_env.errors.unscored`, here as `unscored_result`;
- `RolloutResult` -> a dataset record (results.jsonl) and its turns: `pi_env.collect.records.to_record`;
- `RolloutResult` -> the server's JSON answer (keys scrubbed): `pi_env.server.rollouts.scrub_result`;
- gateway `TurnRecord` -> OpenEnv's `TrainingTurn` (the harness): `pi_env.harness`.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

from pydantic import BaseModel, Field

from .errors import EXIT_INFRA_ERROR_KINDS, INFRA_ERROR_KINDS, ErrorKind, unscored

__all__ = [
    "EXIT_INFRA_ERROR_KINDS",
    "INFRA_ERROR_KINDS",
    "CommandResult",
    "ErrorKind",
    "EventKind",
    "PolicyVersionValue",
    "RolloutEvent",
    "RolloutResult",
    "RolloutTurn",
    "TrainingSegment",
    "TrainingTrace",
    "TurnAlignment",
    "unscored_result",
    "valid_utf8",
]

# A policy version: a JSON scalar the trainer chooses (a training step, a checkpoint name), or
# None when unknown. PiConfig.policy_version, each turn's, each segment's. The version in force
# (shared, settable while sessions run) is held by pi_env.proxy.records.PolicyVersion, which
# checks each value (check_policy_version) before the gateway stamps it on a call.
PolicyVersionValue: TypeAlias = int | float | str | bool | None


class CommandResult(BaseModel):
    """One setup or verify command as it ran: exit code (None when killed or timed out), output, time."""

    cmd: str  # the shell command, as the task gave it
    exit_code: int | None  # None: killed or timed out (never read as success)
    stdout: str = ""  # its output (the sandbox keeps the last 4 MiB)
    stderr: str = ""  # its error output, bounded the same way
    duration_s: float = 0.0  # wall time in the sandbox
    timed_out: bool = False  # killed at its time limit

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


class RolloutTurn(BaseModel):
    """One model call as the gateway saw it. Token fields are filled in transparent_proxy mode,
    straight from the engine: ids and logprobs aligned 1:1 (a missing logprob is a null in
    place); when the engine gave no ids, `token_ids_missing_reason` says why."""

    turn: int  # the call's index in its gateway session, from 0, in the order the agent made them
    finish_reason: str | None = None  # the answer's (stop, tool_calls, length); None: not captured
    completion_tokens: int | None = None  # the answer's usage.completion_tokens
    prompt_token_ids: list[int] = Field(default_factory=list)  # the engine's ids of the prompt it ran
    completion_token_ids: list[int] = Field(default_factory=list)  # the engine's ids of the answer
    per_token_logps: list[float | None] = Field(default_factory=list)  # one per completion id
    top_logprobs: list[list[dict[str, Any]]] = Field(default_factory=list)  # per completion token: the alternatives
    token_ids_source: str | None = None  # "token_ids" (the engine's) or "logprob_tokens" (read from logprobs)
    token_ids_missing_reason: str | None = None  # why there are no ids (None: there are, or not asked)
    capture_fallback: str | None = None  # how a capture parameter the engine refused was worked around
    capture_worker_error: str | None = None  # why this answer was parsed on the gateway's event loop
    message: dict[str, Any] | None = None  # the assistant message as assembled from the stream
    # Token-in (docs/token-in.md): the renderer, how the prompt was made ("first", "bridged", or
    # "full_render" with its `reason`), the `sequence` index, whether the engine echoed the ids sent.
    token_in: dict[str, Any] | None = None
    # The policy version that produced this call's answer (docs/async-rl.md): the one in force when
    # it was sent upstream (set_policy_version), unless the engine or the trainer reported its own;
    # `policy_version_source` says which ("gateway", "engine", "trainer"). None: never set, or never sent.
    policy_version: PolicyVersionValue = None
    policy_version_source: str | None = None
    # Which replica answered (host:port, never credentials); `failed_over`: not the one the
    # rollout was on before this call (it failed, or was in back-off), docs/async-rl.md.
    replica: str | None = None
    failed_over: bool = False
    latency_s: float | None = None  # until the answer's last byte was relayed (or the call failed)
    ttfb_s: float | None = None  # until the endpoint's first body byte
    timestamp: float | None = None  # when the call reached the gateway (unix time)
    upstream_status: int | None = None  # the endpoint's HTTP status; None: no answer (unreachable, hung)
    upstream_error: str | None = None  # what went wrong upstream, short (no body a key could be in)
    # Why this call is not part of the task's conversation (an agent's own extra call, e.g.
    # OpenCode's "title" call without tools): left out of `messages` and of the training view, so
    # a trainer can leave it out of the loss. None: the conversation's own.
    extra_call: str | None = None


EventKind = Literal["phase_start", "phase_end", "turn", "done"]  # RolloutEvent.kind


class RolloutEvent(BaseModel):
    """What a running rollout reports as it goes (`PiSessionFactory.create(..., on_event=)`):
    a phase starting or ending (runtime, sandbox_create, setup, agent_start, agent, verify,
    collect), each model call once the gateway has recorded it, and the end with the reward."""

    kind: EventKind
    elapsed_s: float  # since the rollout started
    phase: str | None = None  # "phase_start" / "phase_end": which phase
    turn: RolloutTurn | None = None  # "turn": the model call just recorded
    reward: float | None = None  # "done" only
    error_kind: ErrorKind | None = None  # "done" only


class RolloutResult(BaseModel):
    """What one rollout produced. `reward` is None (with `error_kind` and `error`) when the rollout
    could not be scored: infrastructure failure is never a reward of 0. `messages` is Pi's
    conversation, `proxy_turns` every model call as the gateway saw it, `training` the
    token-level view (transparent_proxy, interception_gate), `files` the work dir after the
    agent, `timings` seconds per phase."""

    task_id: str  # the task's (PiTask.task_id)
    sandbox_id: str = ""  # the sandbox the rollout ran in ("": it never got one)
    # The id the gateway sent upstream in PiConfig.gateway_session_header on every call of this
    # rollout (random, never its gateway token): what a router kept the rollout on a replica by.
    session_id: str | None = None
    # An endpoint of several replicas (docs/async-rl.md): each replica's health as the rollout
    # ended (replica host:port, healthy, sessions, in_flight, calls, failures, last_error,
    # unhealthy_until), shared by the process's rollouts on it. None: one base URL.
    replicas: list[dict[str, Any]] | None = None
    reward: float | None = None  # in [0, 1]; None: unscored (see error_kind), never "0 by default"
    # "reward_file": the verifier wrote it; "pass_rate": the share of verify commands that passed
    reward_source: Literal["reward_file", "pass_rate"] | None = None
    error: str | None = None  # why unscored, in words (an internal error's holds its traceback)
    error_kind: ErrorKind | None = None  # why unscored (pi_env.errors); None: scored
    agent_exit_code: int | None = None  # the agent's process's; None: killed, or it never ran
    stop_reason: str | None = None  # the last answer's (stop, toolUse, length), or error / budget / timeout
    budget_exhausted: str | None = None  # "max_turns" / "max_total_tokens" when a budget ended it
    # The agent was stopped, by its time limit (stop_reason "timeout") or a budget ("budget"),
    # rather than ending on its own (a multi-step task: any step's). Scored on what it left, but
    # for agent_timeout (Pi never called the model): pi_env.judge, docs/isolation.md.
    truncated: bool = False
    wall_s: float = 0.0  # the whole rollout, seconds
    timings: dict[str, float] = Field(default_factory=dict)  # per phase, seconds
    mode: str = "black_box"  # PiConfig.mode: black_box, transparent_proxy, interception_gate
    endpoint: str = ""  # the endpoint's name: a catalog entry (vllm, openai, ...), "oracle", or "url" for a URL
    model: str = ""  # the model the calls asked for
    agent: str = "pi"  # the coding agent that ran (PiConfig.agent.name)
    agent_version: str = ""
    pi_version: str = ""  # when the agent is Pi
    synthetic: bool = False  # produced by the oracle / scripted test double, not a model
    # Sampling forced on every model call at the gateway (proxy_sampling). Empty: none was;
    # Pi sends no temperature or top_p, so the engine's defaults applied (vLLM: temperature 1.0).
    sampling: dict[str, float | int] = Field(default_factory=dict)
    # transparent_proxy: was the engine asked for its token ids, and why (catalog, probe, config)
    return_token_ids: bool | None = None
    return_token_ids_reason: str | None = None
    setup_results: list[CommandResult] = Field(default_factory=list)  # in order, up to the first that failed
    verify_results: list[CommandResult] = Field(default_factory=list)  # every step's, in order
    proxy_turns: list[RolloutTurn] = Field(default_factory=list)  # every model call, as the gateway saw it
    training: TrainingTrace | None = None  # transparent_proxy: the token-level training view
    trace_path: str | None = None  # the gateway's per-turn trace file (transparent_proxy)
    # The conversation as the gateway saw it (OpenAI chat messages; every assistant message is an
    # answer the gateway relayed), in every mode: see pi_env.proxy.conversation.
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)  # the tool schemas the model was offered
    rewritten_turns: list[int] = Field(default_factory=list)  # calls whose history the agent's client rewrote
    # UNTRUSTED: Pi's own session file as the agent left it (the agent can rewrite it). For
    # debugging only; never the record, never training data.
    pi_session_messages: list[dict[str, Any]] = Field(default_factory=list)
    # UNTRUSTED too: the agent's own transcript (any agent's; Pi's is the same as above).
    agent_transcript: list[dict[str, Any]] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)  # the work dir after the agent (bounded)
    # PiConfig.keep_workdir: the work dir as verify first saw it, whole (pi_env.verify.workdir),
    # a base64 tar.gz, or why it was not kept. `pi-env collect` stores it beside the dataset.
    workdir_archive: str | None = Field(None, repr=False)
    workdir_not_kept: str | None = None
    # What pi-env did so that verify stayed the verifier's: the agent's files set aside, a reward
    # file ignored (a pass-rate task) or rejected (missing, not a number, out of range: a 0.0).
    verify_notes: list[str] = Field(default_factory=list)
    step_rewards: list[float | None] | None = None  # multi-step Harbor tasks: each step run, in order
    artifacts: dict[str, str] = Field(default_factory=dict)  # Harbor artifacts (sandbox path -> text), after verify
    environment: dict[str, Any] | None = None  # the task's built environment: layer/image, approximations
    agent_log_tail: str = ""  # the agent's output's end, then pi-env's own notes ("[pi-env] ...")
    proxy_log_tail: str = ""  # the gateway session's notes and a line per model call

    @property
    def scored(self) -> bool:
        return self.reward is not None

    def make_valid_utf8(self) -> None:
        """Replace lone surrogates (an agent can write `\\ud800` into any JSON it controls,
        and json.loads turns it into one) in every string of the result, in place: they are
        not UTF-8, so they would fail every later write of the record."""
        for name in type(self).model_fields:
            if name != "training":  # token ids and the harness's own notes only
                setattr(self, name, valid_utf8(getattr(self, name)))


_NUMERIC_TURN_FIELDS = frozenset({"prompt_token_ids", "completion_token_ids", "per_token_logps"})


def valid_utf8(value: Any) -> Any:
    """`value` with every string made valid UTF-8 (lone surrogates become U+FFFD), rebuilding
    only what changes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            # through UTF-16: a lone surrogate becomes U+FFFD, a split pair is joined again
            return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [valid_utf8(item) for item in value]
    if isinstance(value, tuple):
        return tuple(valid_utf8(item) for item in value)
    if isinstance(value, dict):
        return {valid_utf8(key): valid_utf8(item) for key, item in value.items()}
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            if name not in _NUMERIC_TURN_FIELDS:
                setattr(value, name, valid_utf8(getattr(value, name)))
    return value


class TrainingSegment(BaseModel):
    """One token sequence a trainer can score: turns whose prompts each extend the previous
    prompt + completion, merged (pi_env.training)."""

    turns: list[int] = Field(default_factory=list)  # the turns (RolloutTurn.turn) merged here, in order
    token_ids: list[int] = Field(default_factory=list)  # the whole sequence, prompt and completions
    loss_mask: list[int] = Field(default_factory=list)  # 1: generated by the model (train on it)
    logprobs: list[float | None] = Field(default_factory=list)  # sampled logprob where mask is 1
    prompt_length: int = 0  # tokens before the first generated one
    # The policy version of each turn in `turns` (the weights that generated its completion).
    policy_versions: list[PolicyVersionValue] = Field(default_factory=list)

    def _extend(self, ids: list[int], *, generated: bool, logprobs: list[float | None] | None = None) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if generated else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [None] * len(ids))


class TurnAlignment(BaseModel):
    """Where one turn went in the training view."""

    turn: int  # RolloutTurn.turn
    segment: int | None  # its index in TrainingTrace.segments; None: the turn had no ids and is in no segment
    extends_previous: bool  # its prompt starts with the previous turn's prompt + completion
    note: str | None = None  # why it starts a new segment or is in none
    extra_call: str | None = None  # an agent's call outside the task's conversation: in no segment


class TrainingTrace(BaseModel):
    """The training view of a rollout: turns whose prompt ids extend the previous prompt +
    completion ids are merged into one sequence (`segments`, with a loss mask of 1 on generated
    tokens and aligned logprobs); a turn that does not extend starts a new segment."""

    segments: list[TrainingSegment] = Field(default_factory=list)  # the sequences, in the order begun
    turns: list[TurnAlignment] = Field(default_factory=list)  # every turn, in order: where it went
    # The policy versions the generated tokens came from (every turn in a segment): each distinct
    # one in the order first used, and the oldest and newest when every one of them is a number
    # (a training step): None when any is unknown (None) or not a number, so staleness is never
    # computed from part of the tokens.
    policy_versions: list[PolicyVersionValue] = Field(default_factory=list)
    policy_version_min: int | float | None = None
    policy_version_max: int | float | None = None

    @property
    def append_only(self) -> bool:
        """One sequence holds every turn of the task's conversation (an agent's extra calls, such
        as OpenCode's title, are in none): the cheapest and most faithful case for training."""
        return len(self.segments) == 1 and all(t.segment == 0 for t in self.turns if t.extra_call is None)


RolloutResult.model_rebuild()


def unscored_result(task_id: str, error: BaseException, doing: str | None = None) -> RolloutResult:
    """The result of a rollout (or a re-verification) that raised `error`, for `pi-env run`,
    collect and reverify alike: reward None, with the kind and message of pi_env.errors.unscored
    (`infra` for the sandbox, the runtime or the OS: retried; `internal`, a bug of ours, with its
    traceback: never retried). Call it while handling `error`."""
    kind, message = unscored(error, doing)
    return RolloutResult(task_id=task_id, error_kind=kind, error=message)
