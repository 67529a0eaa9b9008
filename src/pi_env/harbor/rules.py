"""The rules a rollout applies to a Harbor task, from its `HarborFacts` alone (never the task
directory: the loader, `pi_env.harbor.loader`, is done by then).

- Steps (`pi_env.rollout.steps` runs them): `later_steps` (the task each later step makes), `step_own`
  (a step's own files and setup), `step_gate` (min_reward), `combine_step_rewards`
  (multi_step_reward_strategy).
- The environment: `unsupported_reasons` (what a backend cannot honour: never scored),
  `environment_spec` (what a building backend must build), `environment_record` (what the
  result says was built and approximated).
- `collect_artifacts`: Harbor's artifacts into the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sandbox.base import EnvironmentSpec
from ..task import PiTask
from .facts import HarborStep, harbor_facts

# Backends that build a task's environment (see SandboxSpec.environment) and give setup and verify
# the root of a container (SandboxSpec.container_root).
BUILDING_BACKENDS = ("local", "podman")
MAX_ARTIFACT_BYTES = 256 << 10


# -- steps ----------------------------------------------------------------------------------
def _steps(task: PiTask) -> list[HarborStep]:
    facts = harbor_facts(task)
    return facts.steps if facts else []


@dataclass(frozen=True)
class StepOwn:
    """What a later step brings before its agent, beyond the task each step before it made."""

    name: str | None
    files: dict[str, str] = field(default_factory=dict)  # its workdir/, into the work dir
    setup: list[str] = field(default_factory=list)  # its setup.sh, then its healthcheck


def step_own(task: PiTask, index: int) -> StepOwn:
    """Step `index`'s own work-dir files and setup commands (before its agent)."""
    steps = _steps(task)
    if index >= len(steps):
        return StepOwn(None)
    step = steps[index]
    return StepOwn(step.name, dict(step.files), list(step.setup))


def later_steps(task: PiTask) -> list[PiTask]:
    """The steps after the first of a multi-step Harbor task, each as the task it makes: its files
    and setup are everything staged and run before its agent (the task's, then each step's own up
    to it), which is what a fresh verify sandbox replays."""
    made, files, setup = [], dict(task.files), list(task.setup)
    for step in _steps(task)[1:]:
        files, setup = {**files, **step.files}, [*setup, *step.setup]
        made.append(
            task.model_copy(
                update={
                    "instruction": step.instruction,
                    "verify_files": step.verify_files,
                    "files": files,
                    "setup": setup,
                    "solution": step.solution,
                    "timeouts": task.timeouts.model_copy(
                        update={
                            "agent_s": step.agent_s or task.timeouts.agent_s,
                            "verify_s": step.verify_s or task.timeouts.verify_s,
                        }
                    ),
                }
            )
        )
    return made


def step_gate(task: PiTask, index: int, reward: float | None) -> str | None:
    """Why the steps after step `index` do not run (its min_reward not met), or None."""
    steps = _steps(task)
    threshold = steps[index].min_reward if index < len(steps) else None
    if threshold is not None and (reward is None or reward < threshold):
        return f"step {steps[index].name!r} scored {reward} below its min_reward {threshold}: later steps skipped"
    return None


def combine_step_rewards(task: PiTask, rewards: list[float | None]) -> float | None:
    """Harbor's multi_step_reward_strategy: "mean" over the steps that have a verifier result,
    "final": the last step run."""
    facts = harbor_facts(task)
    if facts and facts.multi_step_reward_strategy == "final":
        return rewards[-1] if rewards else None
    scored = [r for r in rewards if r is not None]
    return sum(scored) / len(scored) if scored else None


# -- the environment --------------------------------------------------------------------------
def unsupported_reasons(task: PiTask, backend: str = "local") -> list[str]:
    """What of a Harbor task's environment the named backend cannot honour ([] for other tasks).
    A rollout of such a task is never scored (error_kind "environment_unsupported")."""
    facts = harbor_facts(task)
    if facts is None:
        return []
    why = list(facts.unsupported)
    env = facts.environment
    if env is None or not env.needs_build:
        return why
    if backend not in BUILDING_BACKENDS:
        image = [f"[environment] docker_image = {env.image!r}"] if env.image else []
        return why + [f"{line}: the {backend} backend does not build environments" for line in image + env.build_steps]
    if backend == "local":
        if env.image:
            why.append(
                f"[environment] docker_image = {env.image!r}: the local backend builds Dockerfiles into "
                "layers and cannot run images"
            )
        why += env.local_unsupported
    return why


def environment_spec(task: PiTask, backend: str) -> EnvironmentSpec | None:
    """The environment a backend that builds them must give this task (None: none needed)."""
    facts = harbor_facts(task)
    env = facts.environment if facts else None
    if backend not in BUILDING_BACKENDS or env is None or not env.needs_build:
        return None
    return EnvironmentSpec(
        dockerfile=env.dockerfile,
        context=env.context,
        image=env.image,
        build_timeout_s=float(env.build_timeout_s or 600.0),
    )


def environment_record(task: PiTask, sandbox) -> dict | None:
    """For RolloutResult.environment: what was built (the backend's own record: layer or image)
    and what only approximates the task's environment (FROM as the host's userland, ...)."""
    facts = harbor_facts(task)
    env = facts.environment if facts else None
    built = getattr(sandbox, "environment_info", None)
    if not env and not built:
        return None
    return {**(built or {}), "base": env.base if env else None, "approximated": list(env.approximated) if env else []}


# -- what a rollout records -----------------------------------------------------------------
def collect_artifacts(task: PiTask, sandbox, result, step: int | None = None, *, max_total_bytes: int) -> int:
    """Harbor's `artifacts` (sandbox paths, after the path map) copied into result.artifacts:
    files as text, a directory's files each under their own path, within `max_total_bytes` (the
    rollout's read budget; returns what was read). A file that is not UTF-8 text, or past the
    budget, is named with its size instead. With `step`: that step's own artifacts ([[steps]]
    artifacts), under `steps/<name>` + the path."""
    facts = harbor_facts(task)
    if facts is None:
        paths, prefix = [], ""
    elif step is None:
        paths, prefix = facts.artifacts, ""
    else:
        steps = facts.steps
        paths, prefix = (steps[step].artifacts, f"steps/{steps[step].name}") if step < len(steps) else ([], "")
    used = 0

    def keep(name: str, data: bytes) -> None:
        nonlocal used
        used += len(data)
        try:
            result.artifacts[name] = data.decode("utf-8")
        except UnicodeDecodeError:  # binary: as text it would be mostly U+FFFD, several times its size
            result.artifacts[name] = f"<not collected: binary, {len(data)} bytes>"

    for path in paths:
        left = max(0, max_total_bytes - used)
        try:
            if not sandbox.exists(path):
                continue
            if not left:
                result.artifacts[prefix + path] = "<not collected: past the rollout's read budget>"
                continue
            try:  # a file: its first MAX_ARTIFACT_BYTES (what is left of the budget)
                keep(prefix + path, sandbox.read_file(path, max_bytes=min(MAX_ARTIFACT_BYTES, left)))
            except IsADirectoryError:
                files = sandbox.snapshot(path, max_file_bytes=min(MAX_ARTIFACT_BYTES, left), max_total_bytes=left)
                for rel, data in files.items():
                    keep(f"{prefix}{path.rstrip('/')}/{rel}", data)
        except (OSError, ValueError) as error:  # outside the home, or gone: say so, never fail the rollout
            result.artifacts[prefix + path] = f"<not collected: {error}>"
    return used
