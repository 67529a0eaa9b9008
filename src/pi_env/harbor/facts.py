"""What a Harbor task carries beyond a plain `PiTask`: `HarborFacts`, one typed model.

The loader (`pi_env.harbor.loader`) writes it, and the rules applied at rollout time
(`pi_env.harbor.rules`, `pi_env.rollout.steps`, the command line) read it, only through
`harbor_facts(task)`. On a task it lives as JSON under `metadata["harbor"]`, the shape every
version of the loader has written (task sets, collected datasets and the server's `task`
argument carry it as is): keys added since the first loader have defaults, so an older task
dict still loads, and a malformed one fails when the task is validated, naming the key to fix
(`check_facts`, plugged into `PiTask`'s validation by `pi_env.harbor`).

A leaf: it imports no loader and no rule.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..task import PiTask, SolutionStep, TaskError, check_command, check_file_keys, check_solution

METADATA_KEY = "harbor"


class HarborEnvironment(BaseModel):
    """The task's environment beyond the files staged for every backend: what only a backend
    that builds environments honours (`environment/Dockerfile`, `[environment] docker_image`)."""

    model_config = ConfigDict(extra="forbid")

    dockerfile: str | None = None
    """The Dockerfile's host path (None: only a `docker_image`)."""
    context: str | None = None
    """The build context: the task's `environment/` dir, host path."""
    image: str | None = None
    """`[environment] docker_image`: a prebuilt image (podman runs it; local cannot)."""
    base: str | None = None
    """The Dockerfile's FROM, as written (the local backend approximates it by the host's userland)."""
    needs_build: bool = False
    """Does the task need a build (RUN steps, COPY outside the work dir, an image...)? False: the
    staged files are the whole environment, every backend honours it."""
    build_steps: list[str] = Field(default_factory=list)
    """The Dockerfile steps only a build honours (`Dockerfile:LINE: STEP args`): the reasons a
    backend that does not build refuses the task."""
    approximated: list[str] = Field(default_factory=list)
    """What a build only approximates (FROM as the host's userland, ...): noted, never refused."""
    local_unsupported: list[str] = Field(default_factory=list)
    """What the local backend's layers cannot build (a base it cannot stand in for)."""
    build_timeout_s: float | None = None
    """`[environment] build_timeout_sec` (the loader's default: 600)."""


class HarborStep(BaseModel):
    """One `[[steps]]` entry of a multi-step task, from `steps/<name>/` (paths already rewritten by
    the path map). The first step is the task itself; `pi_env.rollout.steps` runs the others after it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """The step's directory under `steps/`."""
    instruction: str
    """`steps/<name>/instruction.md`."""
    verify_files: dict[str, str]
    """Its tests, staged after its agent (work-dir relative, under `.harbor/tests/`)."""
    solution: list[SolutionStep] | None = None
    """Its `solve.sh` as the oracle's tool calls (None: no solution)."""
    agent_s: float | None = None
    """`[steps.agent] timeout_sec` (None: the task's)."""
    verify_s: float | None = None
    """`[steps.verifier] timeout_sec` (None: the task's)."""
    min_reward: int | float | None = None
    """Below it (or without a reward) the later steps do not run (None: no threshold)."""
    files: dict[str, str] = Field(default_factory=dict)
    """`steps/<name>/workdir/`: written into the work dir before the step's agent."""
    setup: list[str] = Field(default_factory=list)
    """Run before the step's agent: its `setup.sh`, then its healthcheck."""
    artifacts: list[str] = Field(default_factory=list)
    """The step's own artifacts (sandbox paths), collected under `steps/<name>` after its verifier."""

    # The checks PiTask applies to the same things: a later step runs as a task made from these.
    @field_validator("files", "verify_files")
    @classmethod
    def _relative_keys(cls, files: dict[str, str], info) -> dict[str, str]:
        return check_file_keys(files, info.field_name)

    @field_validator("setup")
    @classmethod
    def _commands(cls, commands: list[str]) -> list[str]:
        for index, command in enumerate(commands):
            check_command(command, f"setup[{index}]")
        return commands

    @field_validator("solution")
    @classmethod
    def _solution(cls, steps):
        return check_solution(steps)


class HarborFacts(BaseModel):
    """Everything pi-env keeps of a Harbor task directory that `PiTask`'s own fields do not say."""

    model_config = ConfigDict(extra="forbid")

    source: str
    """The task directory it was loaded from."""
    path_map: dict[str, str]
    """Harbor's absolute paths -> the sandbox's (WORKDIR -> /root/workdir, /logs, /tests,
    /solution), as rewritten in the instruction, tests and solution."""
    unsupported: list[str] = Field(default_factory=list)
    """What no backend honours (compose services, GPUs, binary files...): such a task is refused
    by `pi-env run`, skipped by `collect`, and unscored when forced."""
    notes: list[str] = Field(default_factory=list)
    """What is read but honoured differently, never affecting the score (network, users...)."""
    environment: HarborEnvironment | None = None
    """The environment to build, if any (None: no Dockerfile and no docker_image)."""
    artifacts: list[str] = Field(default_factory=list)
    """Harbor's `artifacts` (sandbox paths), copied into the result after the last step."""
    steps: list[HarborStep] = Field(default_factory=list)
    """`[[steps]]`, the first included ([]: a one-step task)."""
    multi_step_reward_strategy: str = "mean"
    """How the steps' rewards combine: "final" is the last step run's; anything else the mean
    over the steps with a verifier result."""
    schema_version: str = ""
    """task.toml's `schema_version` (or `version`), as written."""


def problems(error: ValidationError) -> str:
    """Each problem of a failed validation as `key.path: what is wrong`, joined by "; "."""
    return "; ".join(
        f"{'.'.join(str(part) for part in item['loc']) or 'the whole value'}: {item['msg'].removeprefix('Value error, ')}"
        for item in error.errors()
    )


def check_facts(value: Any) -> HarborFacts:
    """`metadata["harbor"]` as `HarborFacts`; a ValueError naming each key to fix."""
    try:
        return HarborFacts.model_validate(value)
    except ValidationError as error:
        raise ValueError(
            f'metadata["{METADATA_KEY}"] is not Harbor\'s facts as pi_env.harbor writes them ({problems(error)}); '
            "fix those keys, or load the task again from its Harbor directory"
        ) from None


def harbor_facts(task: PiTask) -> HarborFacts | None:
    """The task's Harbor facts, None for a task that is not a Harbor task."""
    if METADATA_KEY not in task.metadata:
        return None
    try:
        return check_facts(task.metadata[METADATA_KEY])
    except ValueError as error:  # a task copied or built past validation
        raise TaskError(f"task {task.task_id}: {error}") from None


def is_harbor(task: PiTask) -> bool:
    return harbor_facts(task) is not None
