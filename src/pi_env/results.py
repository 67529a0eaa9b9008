"""What a rollout returns. Field names follow the reference Pi environment (task_id, sandbox_id,
reward, agent_exit_code, wall_s, mode, setup_results, verify_results, proxy_turns, files,
agent_log_tail, proxy_log_tail, error) plus what a trainer or evaluator also needs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

# Why a rollout has no reward. Every kind means "do not train on this as a score".
ErrorKind = Literal[
    "setup_failed",  # a setup command failed: the task or its environment is broken
    "agent_error",  # Pi never got going: it could not start, or its first call was refused
    "agent_timeout",  # the agent's limit passed before Pi called the model (a later time-out is scored)
    "endpoint_error",  # the model endpoint was unreachable, answered 5xx or broke an answer mid-stream
    "gate_timeout",  # interception_gate: the trainer did not deliver a held call within gate_timeout_s
    "invalid_reward",  # results of older pi-env only: a bad reward file is now a 0.0 (see verify_notes)
    "no_verify",  # nothing to score: no verify commands and no reward file
    "environment_unsupported",  # the backend cannot honour the task's environment (Harbor): never a score
    "environment_build_failed",  # building the task's environment (Dockerfile) failed
    "infra",  # the sandbox, runtime or harness failed
    "internal",  # a bug in pi-env (an unexpected exception; the error holds its traceback): please report it
]
# The kinds where the infrastructure failed, not the agent: worth retrying. `pi-env run` /
# `collect` exit with EXIT_INFRA when a rollout ends with one of EXIT_INFRA_ERROR_KINDS.
INFRA_ERROR_KINDS: frozenset[str] = frozenset({"infra", "endpoint_error"})
# With a bug of ours (`internal`: never retried), the kinds that are not the agent's doing.
EXIT_INFRA_ERROR_KINDS: frozenset[str] = INFRA_ERROR_KINDS | {"internal"}


class CommandResult(BaseModel):
    """One setup or verify command as it ran: exit code (None when killed or timed out), output, time."""

    cmd: str
    exit_code: int | None  # None: killed or timed out (never read as success)
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    timed_out: bool = False

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


class RolloutTurn(BaseModel):
    """One model call as the gateway saw it. Token fields are filled in transparent_proxy mode,
    straight from the engine: ids and logprobs aligned 1:1 (a missing logprob is a null in
    place); when the engine gave no ids, `token_ids_missing_reason` says why."""

    turn: int
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_token_ids: list[int] = Field(default_factory=list)
    completion_token_ids: list[int] = Field(default_factory=list)
    per_token_logps: list[float | None] = Field(default_factory=list)
    top_logprobs: list[list[dict[str, Any]]] = Field(default_factory=list)
    token_ids_source: str | None = None
    token_ids_missing_reason: str | None = None
    capture_fallback: str | None = None
    capture_worker_error: str | None = None  # why this answer was parsed on the gateway's event loop
    message: dict[str, Any] | None = None  # the assistant message as assembled from the stream
    # Token-in (docs/token-in.md): the renderer, how the prompt was made ("first", "bridged", or
    # "full_render" with its `reason`), the `sequence` index, whether the engine echoed the ids sent.
    token_in: dict[str, Any] | None = None
    # The policy version that produced this call's answer (docs/async-rl.md): the one in force when
    # it was sent upstream (set_policy_version), unless the engine or the trainer reported its own;
    # `policy_version_source` says which ("gateway", "engine", "trainer"). None: never set, or never sent.
    policy_version: int | float | str | bool | None = None
    policy_version_source: str | None = None
    # Which replica answered (host:port, never credentials); `failed_over`: not the one the
    # rollout was on before this call (it failed, or was in back-off), docs/async-rl.md.
    replica: str | None = None
    failed_over: bool = False
    latency_s: float | None = None
    ttfb_s: float | None = None
    timestamp: float | None = None
    upstream_status: int | None = None
    upstream_error: str | None = None
    # Why this call is not part of the task's conversation (an agent's own extra call, e.g.
    # OpenCode's "title" call without tools): left out of `messages` and of the training view, so
    # a trainer can leave it out of the loss. None: the conversation's own.
    extra_call: str | None = None


EventKind = Literal["phase_start", "phase_end", "turn", "done"]


class RolloutEvent(BaseModel):
    """What a running rollout reports as it goes (`PiSessionFactory.create(..., on_event=)`):
    a phase starting or ending (runtime, sandbox_create, setup, agent_start, agent, verify,
    collect), each model call once the gateway has recorded it, and the end with the reward."""

    kind: EventKind
    elapsed_s: float  # since the rollout started
    phase: str | None = None
    turn: RolloutTurn | None = None
    reward: float | None = None  # "done" only
    error_kind: ErrorKind | None = None  # "done" only


class RolloutResult(BaseModel):
    """What one rollout produced. `reward` is None (with `error_kind` and `error`) when the rollout
    could not be scored: infrastructure failure is never a reward of 0. `messages` is Pi's
    conversation, `proxy_turns` every model call as the gateway saw it, `training` the
    token-level view (transparent_proxy, interception_gate), `files` the work dir after the
    agent, `timings` seconds per phase."""

    task_id: str
    sandbox_id: str = ""
    # The id the gateway sent upstream in PiConfig.gateway_session_header on every call of this
    # rollout (random, never its gateway token): what a router kept the rollout on a replica by.
    session_id: str | None = None
    # An endpoint of several replicas (docs/async-rl.md): each replica's health as the rollout
    # ended (replica host:port, healthy, sessions, in_flight, calls, failures, last_error,
    # unhealthy_until), shared by the process's rollouts on it. None: one base URL.
    replicas: list[dict[str, Any]] | None = None
    reward: float | None = None
    reward_source: Literal["reward_file", "pass_rate"] | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    agent_exit_code: int | None = None
    stop_reason: str | None = None  # the last answer's (stop, toolUse, length), or error / budget / timeout
    budget_exhausted: str | None = None  # "max_turns" / "max_total_tokens" when a budget ended it
    # The agent was stopped, by its time limit (stop_reason "timeout") or a budget ("budget"),
    # rather than ending on its own (a multi-step task: any step's). Scored on what it left, but
    # for agent_timeout (Pi never called the model): pi_env.judge, docs/isolation.md.
    truncated: bool = False
    wall_s: float = 0.0
    timings: dict[str, float] = Field(default_factory=dict)  # per phase, seconds
    mode: str = "black_box"
    endpoint: str = ""
    model: str = ""
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
    setup_results: list[CommandResult] = Field(default_factory=list)
    verify_results: list[CommandResult] = Field(default_factory=list)
    proxy_turns: list[RolloutTurn] = Field(default_factory=list)
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
    agent_log_tail: str = ""
    proxy_log_tail: str = ""

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


from .training import TrainingTrace  # noqa: E402 - after RolloutResult's own names

RolloutResult.model_rebuild()
