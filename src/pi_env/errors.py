"""pi-env's errors: why a rollout has no reward (`ErrorKind`), the exit codes of its commands,
and one exception tree under `PiEnvError`. Every exception pi-env defines is in the tree, and
says what it means to a user by two class attributes: `error_kind`, the result's kind when it
ends a rollout (None: it never does, it refuses input before one starts), and `exit_code`, what
a command exits with because of it.

    PiEnvError                               error_kind                 exit_code
    ├── BadInputError                        None                       EXIT_BAD_INPUT (2)
    │   ├── TaskError (ValueError)            a task or task file          pi_env.task
    │   ├── EndpointError (ValueError)        an endpoint's name/settings  pi_env.endpoints
    │   ├── TokenInUnavailable (ValueError)   token-in's settings          pi_env.proxy.token_in
    │   ├── PolicyError (ValueError)          a body the gateway refuses   pi_env.proxy.policy
    │   ├── DialectError                      a request a dialect refuses  pi_env.proxy.dialects
    │   ├── GateError                         what `deliver` refuses       pi_env.proxy.gate
    │   │   ├── CompletionInvalid (ValueError)
    │   │   └── RequestNotPending (LookupError)
    │   ├── BadArguments (ValueError)         a run_rollout call           pi_env.server.rollouts
    │   ├── CallerError (ValueError)          what a server caller sent    pi_env.server.callers
    │   ├── CollectError (ValueError)         a collect run's input        pi_env.collect.runner
    │   ├── EndpointUnusable                  an endpoint unusable mid-run pi_env.collect.executors
    │   ├── StoreError (RuntimeError)         a dataset dir that cannot be used  pi_env.collect.store
    │   ├── UnsafeArchive (ValueError)        a kept work dir              pi_env.verify.workdir
    │   ├── TemplateLeakError (ValueError)    a task pool                  pi_env.workspace.coding
    │   ├── SplitOverlapError (ValueError)    a task split                 pi_env.workspace.tasks
    │   └── LeakError (RuntimeError)          an eval set                  pi_env.learning.pipeline
    ├── InfraError                           "infra"                    EXIT_INFRA (3), retried
    │   ├── SandboxError (RuntimeError)       the sandbox                  pi_env.sandbox.base
    │   │   ├── SandboxUnavailable            the backend, on this machine
    │   │   ├── EnvironmentUnsupported       "environment_unsupported"  0
    │   │   └── EnvironmentBuildError        "environment_build_failed" 0
    │   ├── RuntimeInstallError (RuntimeError)  the agent's runtime        pi_env.agent.runtime
    │   ├── RoomError (OSError)               verify's room                pi_env.verify.room
    │   ├── CaptureWorkerError (RuntimeError) the capture pool             pi_env.proxy.capture_worker
    │   │   └── CapturePoolClosed
    │   ├── ServerBusy (RuntimeError)         the server's slots           pi_env.server.limiter
    │   ├── WorkerLost                        a Ray worker or node died    pi_env.collect.executors
    │   ├── RebuildMismatch (RuntimeError)    a carried run's checkpoint   pi_env.learning.state
    │   ├── EndpointFailure                  "endpoint_error"           EXIT_INFRA (3), retried
    │   │   └── ReplicasFailed (aiohttp.ClientError)                       pi_env.proxy.wire
    │   └── GateTimeout                      "gate_timeout"             0 (the trainer's)
    ├── AgentFailure                         (the agent's doing)        0
    │   ├── AgentError                       "agent_error"
    │   └── AgentTimeout                     "agent_timeout"
    ├── TaskFailure                          (the task's doing)         0
    │   ├── SetupFailed                      "setup_failed"
    │   └── NoVerify                         "no_verify"
    ├── ServerCallError (RuntimeError)       None                       EXIT_INFRA (3)
    │                                         a server's refusal, to its client (pi_env.server.client,
    │                                         importable there as `PiEnvError` too)
    └── InternalError                        "internal"                 EXIT_INFRA (3), never retried

A class's builtin base (in parentheses) is kept where callers catch it as one. `PiEnvError` adds
no state, so it mixes with any builtin, OSError included. Outside the tree on purpose:
`pi_env.verify.startup.pi_env_check.AgentError` (runs inside sandboxes on the standard library
alone) and `pi_env.cli.Terminated` (SIGTERM unwinding like Ctrl-C, not an error).

Most kinds are judged, not raised: `pi_env.judge` decides agent_error, endpoint_error, ... from
what the gateway saw and a rollout records the kind, so nothing raises the agent's and the
task's classes today; they complete the tree so that every kind has its class (ERROR_CLASSES).
What is raised maps to a kind here, in one place: `unscored(error)` gives the kind and the
message of an unscored result (used by the rollout's phases, `pi_env.results.unscored_result`
for the rollouts that raise in `pi-env run`, collect's executors and reverify, the harness and
the server), `exit_code_for(kind)` a command's exit code for a rollout that ended with `kind`,
`exit_code_of(error)` for an error that ended the command.
"""

from __future__ import annotations

import traceback
from typing import ClassVar, Literal

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

EXIT_BAD_INPUT = 2  # the input was wrong; the message says what to fix
EXIT_INFRA = 3  # a rollout could not be scored for infrastructure reasons (sandbox, runtime, endpoint)


def exit_code_for(kind: str | None) -> int:
    """A command's exit code for a rollout that ended with `kind` (None: scored): EXIT_INFRA
    for the infrastructure's kinds and ours (`internal`), else 0 (the rollout ran; unscored is
    its outcome, the agent's or the task's)."""
    return EXIT_INFRA if kind in EXIT_INFRA_ERROR_KINDS else 0


class PiEnvError(Exception):
    """The base of every pi-env exception (the tree: this module's docstring). No state of its
    own, so a subclass can keep any builtin base (ValueError, RuntimeError, OSError)."""

    error_kind: ClassVar[ErrorKind | None] = "internal"
    exit_code: ClassVar[int] = EXIT_INFRA


class BadInputError(PiEnvError):
    """Input pi-env cannot use (a task, a config, an endpoint, arguments, a caller's request):
    refused before a rollout starts, never a rollout's error kind. The message says what to fix."""

    error_kind = None
    exit_code = EXIT_BAD_INPUT


class InfraError(PiEnvError):
    """The infrastructure failed (sandbox, runtime, OS, endpoint), not the agent: never a score;
    `infra` and `endpoint_error` are retried by collect."""

    error_kind: ClassVar[ErrorKind | None] = "infra"
    exit_code = EXIT_INFRA


class EndpointFailure(InfraError):
    """The model endpoint failed a call (unreachable, 5xx, an answer broken mid-stream)."""

    error_kind = "endpoint_error"
    exit_code = exit_code_for("endpoint_error")


class GateTimeout(InfraError):
    """interception_gate: the trainer did not deliver a held call in time."""

    error_kind = "gate_timeout"
    exit_code = exit_code_for("gate_timeout")


class AgentFailure(PiEnvError):
    """The agent never got going: unscored, but the run itself went fine (exit 0)."""

    error_kind: ClassVar[ErrorKind | None] = "agent_error"
    exit_code = exit_code_for("agent_error")


class AgentError(AgentFailure):
    """The agent could not start, or its first model call was refused."""


class AgentTimeout(AgentFailure):
    """The agent's limit passed before it called the model."""

    error_kind = "agent_timeout"


class TaskFailure(PiEnvError):
    """The task (or its environment) cannot be scored as given: unscored, exit 0."""

    error_kind: ClassVar[ErrorKind | None] = "setup_failed"
    exit_code = exit_code_for("setup_failed")


class SetupFailed(TaskFailure):
    """A setup command failed."""


class NoVerify(TaskFailure):
    """Nothing to score: no verify commands and no reward file."""

    error_kind = "no_verify"


class ServerCallError(PiEnvError, RuntimeError):
    """A pi-env server refused or failed a client's call; the message is the server's (it names
    the argument). pi_env.server.client raises it (also importable there as `PiEnvError`)."""

    error_kind = None
    exit_code = EXIT_INFRA


class InternalError(PiEnvError):
    """A bug in pi-env: please report it (the unscored result keeps the traceback)."""

    error_kind = "internal"
    exit_code = exit_code_for("internal")


def error_kind_of(error: BaseException) -> ErrorKind:
    """The kind of an unscored rollout that `error` ended: the class's own for a pi-env error
    of a kind, `infra` for the OS (a file, a socket, a process), else `internal` (a bug of ours,
    input refused mid-rollout included)."""
    if isinstance(error, PiEnvError) and error.error_kind is not None:
        return error.error_kind
    if isinstance(error, OSError):
        return "infra"
    return "internal"


def unscored(error: BaseException, doing: str | None = None) -> tuple[ErrorKind, str]:
    """The error kind and the message of a rollout that `error` left unscored: the one mapping
    from an exception to `reward=None`. The message is the error's own for the kinds that name
    their cause (the environment's), its type and text for infrastructure, and with the
    traceback for `internal` (call it while handling `error`). `doing`: what failed, put first."""
    kind = error_kind_of(error)
    if kind == "internal":
        message = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
    elif kind == "infra":
        message = f"{type(error).__name__}: {error}"
    else:
        message = str(error)
    return kind, f"{doing}: {message}" if doing else message


def exit_code_of(error: BaseException) -> int:
    """A command's exit code for an error that ended it: the class's own for a pi-env error,
    else EXIT_BAD_INPUT (what commands catch besides theirs: ValueError, a config's
    ValidationError, an unsupported option)."""
    return error.exit_code if isinstance(error, PiEnvError) else EXIT_BAD_INPUT


# Each kind a class carries (the legacy `invalid_reward` has none): ERROR_CLASSES[kind](message)
# is the exception a phase would raise for it.
ERROR_CLASSES: dict[str, type[PiEnvError]] = {
    "setup_failed": SetupFailed,
    "agent_error": AgentError,
    "agent_timeout": AgentTimeout,
    "endpoint_error": EndpointFailure,
    "gate_timeout": GateTimeout,
    "no_verify": NoVerify,
    "infra": InfraError,
    "internal": InternalError,
}
