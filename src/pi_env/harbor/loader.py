"""The loader: a Harbor task directory read into a `PiTask` (its Harbor facts, `HarborFacts`,
under `metadata["harbor"]`). What a rollout does with them: `pi_env.harbor.rules`.

A Harbor task is a directory: `instruction.md`, `task.toml` ([agent], [verifier],
[environment], [solution], [metadata]), `environment/Dockerfile`, `tests/test.sh` (the
verifier, which writes `/logs/verifier/reward.txt` or `reward.json`) and `solution/solve.sh`
(what Harbor's oracle agent runs). Harbor runs it in a container built from the Dockerfile;
pi-env runs it in its bubblewrap sandbox, whose only writable place is `/root`. The mapping:

    Harbor                      pi-env sandbox
    WORKDIR (default /app)  ->  /root/workdir (the agent's and the verifier's cwd)
    /logs/...               ->  /root/logs/... (the verifier dir is cleared after the agent)
    /tests                  ->  /root/tests, staged only after the agent has finished
    /solution               ->  /root/solution (the oracle's bash step writes it)

These absolute paths are rewritten in instruction.md, in the tests and in the solution (a
path-prefix rewrite; each task records its map in `HarborFacts.path_map`). What no backend
honours (compose services, GPUs, COPY outside the work dir, binary files) is listed per task in
`HarborFacts.unsupported`, what only a build honours in `HarborFacts.environment`: a warning
for `pi-env run`, and `pi-env collect` skips such tasks unless told to run them anyway.

Reward, as Harbor reads it: reward.txt (one number) wins; else reward.json, a JSON object of
named rewards, whose "reward" entry (or its only entry) is the reward. Neither file, or a value
that is not a finite number in [0, 1], is a 0.0 with the reason in `verify_notes` (the agent's
code, run by test.sh, can cause either; see pi_env.verify). test.sh's exit code is recorded but
does not decide the reward.
"""

from __future__ import annotations

import base64
import logging
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from ..sandbox.base import SANDBOX_WORKDIR
from ..sandbox.layers import parse_dockerfile, unsupported_base
from ..task import PiTask, TaskError, validate_task
from .facts import METADATA_KEY, HarborEnvironment, HarborFacts, HarborStep, problems

log = logging.getLogger("pi_env.harbor")

DEFAULT_WORKDIR = "/app"
SANDBOX_TESTS = "/root/tests"
SANDBOX_SOLUTION = "/root/solution"
STAGED_TESTS = ".harbor/tests"  # verify_files are work-dir relative; the verifier moves them to /root/tests
MAX_FILE_BYTES = 1 << 20

# The verify command: move the tests out of the work dir (pi-env stages them into a dir the
# agent's files were set aside from, pi_env.verify), run test.sh. pi-env reads the reward file
# itself, host-side (reward.txt first, else reward.json's "reward"): nothing of pi-env's runs
# Python in the sandbox.
_VERIFY = """\
set -u
rm -rf {tests} && mkdir -p /root/logs/verifier /root/logs/agent && mv -T {workdir}/{staged} {tests} && \
rmdir {workdir}/{staged_top} 2>/dev/null
{env}bash {tests}/test.sh > /root/logs/verifier/test-stdout.txt 2>&1
status=$?
cat /root/logs/verifier/test-stdout.txt
exit $status
"""


def is_harbor_task(path: Path) -> bool:
    """A task.toml beside an instruction.md (or, for a multi-step task, a steps/ dir)."""
    return (
        path.is_dir()
        and (path / "task.toml").is_file()
        and ((path / "instruction.md").is_file() or (path / "steps").is_dir())
    )


def harbor_task_dirs(path: Path) -> list[Path]:
    """`path` itself when it is a Harbor task, else its Harbor task subdirectories (sorted)."""
    if is_harbor_task(path):
        return [path]
    return sorted(child for child in path.iterdir() if is_harbor_task(child))


def load_harbor_tasks(path: str | Path) -> list[PiTask]:
    dirs = harbor_task_dirs(Path(path))
    if not dirs:
        raise TaskError(f"{path}: no Harbor task here (a directory with instruction.md and task.toml)")
    return [load_harbor_task(d) for d in dirs]


def load_harbor_task(task_dir: str | Path) -> PiTask:
    task_dir = Path(task_dir)
    config = _read_toml(task_dir / "task.toml")
    agent, verifier = _table(config, "agent", task_dir), _table(config, "verifier", task_dir)
    environment, solution_cfg = _table(config, "environment", task_dir), _table(config, "solution", task_dir)
    unsupported: list[str] = []
    notes: list[str] = []

    workdir, env_files, env_info = _environment(task_dir, environment, unsupported, notes)
    path_map = {workdir: "/root/workdir", "/logs": "/root/logs", "/tests": SANDBOX_TESTS, "/solution": SANDBOX_SOLUTION}
    rewrite = _rewriter(path_map)

    verifier_env = _env_table(verifier, "verifier.env", task_dir, notes)
    verify = [
        _VERIFY.format(
            tests=SANDBOX_TESTS,
            staged=STAGED_TESTS,
            workdir=SANDBOX_WORKDIR,
            staged_top=STAGED_TESTS.split("/")[0],
            env="".join(f"{k}={shlex.quote(v)} " for k, v in verifier_env.items()),
        )
    ]
    solution_env = _env_table(solution_cfg, "solution.env", task_dir, notes)
    steps = _steps(config, task_dir, rewrite, unsupported, solution_env)
    if steps:  # multi-step: the task itself is the first step, the others run after it (pi_env.rollout.steps)
        verify_files, solution, instruction_file = (
            steps[0].verify_files,
            [step.model_dump() for step in steps[0].solution] if steps[0].solution is not None else None,
            task_dir / "steps" / steps[0].name / "instruction.md",
        )
        env_files = {**env_files, **steps[0].files}
    else:
        verify_files = _tests(task_dir, rewrite, unsupported)
        solution = _solution(task_dir, rewrite, unsupported, solution_env)
        instruction_file = task_dir / "instruction.md"

    if environment.get("docker_image"):
        env_info = (env_info or HarborEnvironment()).model_copy(
            update={"image": str(environment["docker_image"]), "needs_build": True}
        )
    if env_info is not None:
        env_info.build_timeout_s = _seconds(environment, "build_timeout_sec", task_dir) or 600.0
    setup_network, verify_network = _network_policy(environment, agent, verifier, notes)
    _schema_1_4(config, environment, agent, verifier, unsupported, notes)
    healthcheck = _healthcheck(environment.get("healthcheck"), "[environment] healthcheck", task_dir)
    healthcheck = rewrite(healthcheck) if healthcheck else None
    collect_hooks = [rewrite(hook) for hook in _collect_hooks(verifier, unsupported, task_dir)]
    artifacts = [rewrite(path) for path in _artifacts(config.get("artifacts"), "artifacts", unsupported, task_dir)]
    verify = [*collect_hooks, *verify]
    limits = {name: _megabytes(environment, f"{name}_mb", name, task_dir) for name in ("memory", "storage")}

    meta = dict(config.get("metadata") or {})
    package: dict = config["task"] if isinstance(config.get("task"), dict) else {}
    facts = HarborFacts(
        source=str(task_dir),
        path_map=path_map,
        unsupported=unsupported,
        notes=notes,
        environment=env_info,
        artifacts=artifacts,
        steps=steps,
        multi_step_reward_strategy=str(config.get("multi_step_reward_strategy") or "mean"),
        schema_version=str(config.get("schema_version") or config.get("version") or ""),
    )
    meta[METADATA_KEY] = facts.model_dump()  # JSON on the task (task sets, datasets); read by harbor_facts
    data: dict[str, Any] = {
        "task_id": str(package.get("name") or task_dir.name),
        "instruction": rewrite(_read_text(instruction_file)),
        "files": {rel: text for rel, text in env_files.items()},
        "setup": ([healthcheck] if healthcheck else []) + (steps[0].setup if steps else []),
        "verify": verify,
        "verify_files": verify_files,
        "solution": solution,
        "metadata": meta,
        "timeouts": {
            "agent_s": _seconds(agent, "timeout_sec", task_dir),
            "verify_s": _seconds(verifier, "timeout_sec", task_dir) or 600.0,
            "setup_s": _seconds(environment, "build_timeout_sec", task_dir),
        },
        "limits": {f"{name}_mb": value for name, value in limits.items() if value is not None},
        "setup_network": setup_network,
        "verify_network": verify_network,
        "reward_file": True,  # Harbor's contract: test.sh writes the reward
    }
    task = validate_task(data, source=str(task_dir))
    for problem in unsupported:
        log.warning("Harbor task %s: not honoured by any backend: %s", task.task_id, problem)
    return task


def _tests(directory: Path, rewrite, unsupported: list[str]) -> dict[str, str]:
    tests_dir = directory / "tests"
    if not (tests_dir / "test.sh").is_file():
        raise TaskError(f"{directory}: tests/test.sh is missing; Harbor runs it as the verifier")
    return {
        f"{STAGED_TESTS}/{rel}": rewrite(text) for rel, text in _text_files(tests_dir, "tests", unsupported).items()
    }


def _solution(directory: Path, rewrite, unsupported: list[str], env: dict[str, str]) -> list[dict] | None:
    if not (directory / "solution" / "solve.sh").is_file():
        return None
    files = _text_files(directory / "solution", "solution", unsupported)
    return _solution_steps({rel: rewrite(text) for rel, text in files.items()}, env)


def _steps(config: dict, task_dir: Path, rewrite, unsupported: list[str], solution_env: dict) -> list[HarborStep]:
    """[[steps]]: each step's instruction, tests, solution, limits and min_reward, from
    steps/<name>/ (Harbor's layout)."""
    steps = []
    for index, step in enumerate(config.get("steps") or []):
        name = step.get("name") if isinstance(step, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise TaskError(f"{task_dir}/task.toml: [[steps]] #{index + 1} needs a name (a directory under steps/)")
        directory = task_dir / "steps" / name
        if not (directory / "instruction.md").is_file():
            raise TaskError(f"{directory}: instruction.md is missing; each step has its own")
        agent, verifier = step.get("agent") or {}, step.get("verifier") or {}
        min_reward = step.get("min_reward")
        if isinstance(min_reward, dict):
            min_reward = min_reward.get("reward")  # pi-env scores the one "reward" key
        # Harbor, before the step's agent: steps/<name>/workdir/ uploaded into the work dir, its
        # setup.sh run there, then the step's healthcheck; after the step: its artifacts.
        workdir = directory / "workdir"
        files = (
            {rel: rewrite(text) for rel, text in _text_files(workdir, f"steps/{name}/workdir", unsupported).items()}
            if workdir.is_dir()
            else {}
        )
        healthcheck = _healthcheck(step.get("healthcheck"), f"[[steps]] {name} healthcheck", task_dir)
        fields = {
            "name": name,
            "instruction": rewrite(_read_text(directory / "instruction.md")),
            "verify_files": _tests(directory, rewrite, unsupported),
            "solution": _solution(directory, rewrite, unsupported, solution_env),
            "agent_s": _seconds(agent, "timeout_sec", task_dir),
            "verify_s": _seconds(verifier, "timeout_sec", task_dir),
            "min_reward": min_reward,
            "files": files,
            "setup": (["bash setup.sh"] if (workdir / "setup.sh").is_file() else [])
            + ([rewrite(healthcheck)] if healthcheck else []),
            "artifacts": [
                rewrite(path)
                for path in _artifacts(step.get("artifacts"), f"[[steps]] {name} artifacts", unsupported, task_dir)
            ],
        }
        try:
            steps.append(HarborStep.model_validate(fields))
        except ValidationError as error:
            raise TaskError(f"{task_dir}/task.toml: [[steps]] {name}: {problems(error)}") from None
    return steps


# -- task.toml schema 1.4 (harbor 0.26) ------------------------------------------------------
def _network_policy(environment: dict, agent: dict, verifier: dict, notes: list[str]) -> tuple[bool, bool]:
    """(setup network, verifier network). [environment] network_mode (or the deprecated
    allow_internet) is the baseline, [verifier] network_mode an override; "allowlist" cannot be
    enforced per host, so it gets no network. The agent only ever reaches the model gateway."""
    mode = environment.get("network_mode")
    if mode is None and "allow_internet" in environment:
        mode = "public" if environment["allow_internet"] else "no-network"
    mode = mode or "public"
    for where, value in (
        ("[environment]", mode),
        ("[verifier]", verifier.get("network_mode")),
        ("[agent]", agent.get("network_mode")),
    ):
        if value == "allowlist":
            notes.append(
                f'{where} network_mode = "allowlist": per-host allowlists are not enforced; that phase '
                "runs without network"
            )
    if agent.get("network_mode") == "public" or (mode == "public" and agent.get("network_mode") is None):
        notes.append(
            "the agent reaches only the model gateway, never the internet (Harbor's network_mode for the "
            "agent is not granted)"
        )
    setup = mode == "public"
    if verifier.get("network_mode") is not None:
        return setup, verifier["network_mode"] == "public"
    if mode == "public":
        notes.append(
            "the verifier runs offline in pi-env (Harbor would give it the environment's network); "
            'set [verifier] network_mode = "public" if test.sh needs it'
        )
    return setup, False


def _schema_1_4(
    config: dict, environment: dict, agent: dict, verifier: dict, unsupported: list[str], notes: list[str]
) -> None:
    """What of task.toml is read but not honoured: refused when it could change the score,
    noted when it cannot."""
    if int(environment.get("gpus") or 0) > 0 or environment.get("gpu_types"):
        unsupported.append(f"[environment] gpus = {environment.get('gpus')}: pi-env's backends have no GPUs")
    if environment.get("tpu"):
        unsupported.append("[environment] tpu: pi-env's backends have no TPUs")
    if str(environment.get("os", "linux")).lower() != "linux":
        unsupported.append(f"[environment] os = {environment['os']!r}: only Linux sandboxes")
    if environment.get("mcp_servers"):
        unsupported.append("[environment] mcp_servers: Pi is not given the task's MCP servers")
    if verifier.get("environment") or verifier.get("environment_mode") == "separate":
        unsupported.append(
            '[verifier] environment / environment_mode = "separate": the verifier runs in the '
            "agent's sandbox; a separate verifier environment is not built"
        )
    if "cpus" in environment:
        notes.append(f"[environment] cpus = {environment['cpus']!r} is not enforced per task")
    if environment.get("env"):
        notes.append(
            "[environment] env: not passed (Harbor fills it from the host; pi-env hands no host variable to a sandbox)"
        )
    for table, name in ((agent, "agent"), (verifier, "verifier")):
        if table.get("user") not in (None, "root", 0):
            notes.append(f"[{name}] user = {table['user']!r}: runs as root (the sandbox's own uid)")
    if environment.get("skills_dir"):
        notes.append("[environment] skills_dir: Pi is not given skills")


def _healthcheck(check: Any, where: str, task_dir: Path) -> str | None:
    """A setup command that retries Harbor's healthcheck as Docker would (start period, interval,
    retries); setup fails (the rollout is unscored, setup_failed) if it never passes."""
    if check is None:
        return None
    if not isinstance(check, dict) or not isinstance(check.get("command"), str):
        raise TaskError(f'{task_dir}/task.toml: {where} needs a command = "..."')
    retries = int(check.get("retries", 3))
    interval = float(check.get("interval_sec", 5.0))
    timeout = float(check.get("timeout_sec", 30.0))
    start = float(check.get("start_period_sec", 0.0))
    return (
        f"sleep {start:g}; for attempt in $(seq {max(1, retries)}); do timeout {timeout:g} bash -c "
        f"{shlex.quote(check['command'])} && exit 0; sleep {interval:g}; done; "
        f"echo 'healthcheck never passed: {check['command'][:100]}' >&2; exit 1"
    )


def _collect_hooks(verifier: dict, unsupported: list[str], task_dir: Path) -> list[str]:
    """[[verifier.collect]] hooks of the main service, run before test.sh (after the agent)."""
    hooks = []
    for index, hook in enumerate(verifier.get("collect") or []):
        if not isinstance(hook, dict) or not isinstance(hook.get("command"), str):
            raise TaskError(f"{task_dir}/task.toml: [[verifier.collect]] #{index + 1} needs a command")
        if hook.get("service", "main") != "main":
            unsupported.append(f"[[verifier.collect]] service = {hook['service']!r}: compose services are not started")
            continue
        hooks.append(f"timeout {float(hook.get('timeout_sec', 60.0)):g} bash -c {shlex.quote(hook['command'])}")
    return hooks


def _artifacts(entries: Any, where: str, unsupported: list[str], task_dir: Path) -> list[str]:
    """Harbor's artifacts (str or {source, destination, exclude, service}): the sources, as
    sandbox paths before the path map."""
    sources = []
    for entry in entries or []:
        source = entry if isinstance(entry, str) else entry.get("source") if isinstance(entry, dict) else None
        if not isinstance(source, str) or ".." in PurePosixPath(source).parts:
            raise TaskError(f"{task_dir}/task.toml: {where}: {entry!r} is not a path or a table with a source")
        if isinstance(entry, dict) and entry.get("service") not in (None, "main"):
            unsupported.append(f"{where}: {source} from service {entry['service']!r}: compose services are not started")
            continue
        sources.append(source)
    return sources


# -- task.toml -----------------------------------------------------------------------------
def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskError(f"{path}: missing; a Harbor task needs task.toml") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise TaskError(f"{path}: not valid TOML: {error}") from None


def _table(config: dict, name: str, task_dir: Path) -> dict:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise TaskError(f"{task_dir}/task.toml: [{name}] must be a table, found {type(table).__name__}")
    return table


def _seconds(table: dict, key: str, task_dir: Path) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskError(f"{task_dir}/task.toml: {key} = {value!r}; give a positive number of seconds")
    return float(value)


_SIZE_UNITS_MB = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}


def _megabytes(table: dict, mb_key: str, size_key: str, task_dir: Path) -> int | None:
    """memory_mb = 2048, or memory = "2G" (newer Harbor): megabytes, None when absent."""
    if (value := table.get(mb_key)) is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TaskError(f"{task_dir}/task.toml: {mb_key} = {value!r}; give a positive whole number of MB")
        return value
    if (value := table.get(size_key)) is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value), re.I)
    if not match or float(match[1]) <= 0:
        raise TaskError(f'{task_dir}/task.toml: {size_key} = {value!r}; give a size such as "512M" or "4G"')
    return max(1, round(float(match[1]) * _SIZE_UNITS_MB[match[2].upper()]))


def _env_table(table: dict, where: str, task_dir: Path, notes: list[str]) -> dict[str, str]:
    env = table.get("env", {}) or {}
    if not isinstance(env, dict):
        raise TaskError(f"{task_dir}/task.toml: {where} must be a table of strings")
    for key, value in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)):
            raise TaskError(f"{task_dir}/task.toml: {where}: {key!r} is not a valid variable name")
        if "${" in str(value):
            # Harbor fills ${VAR} from the host; pi-env never hands host variables to a sandbox.
            notes.append(f"{where}.{key}: ${{...}} templates are passed literally, not filled from the host")
    return {str(k): str(v) for k, v in env.items()}


# -- environment/Dockerfile ----------------------------------------------------------------
def _environment(
    task_dir: Path, environment: dict, unsupported: list[str], notes: list[str]
) -> tuple[str, dict[str, str], HarborEnvironment | None]:
    """The work dir, the text files COPY'd into it (staged as task files, for every backend) and
    what the environment needs beyond them (a build: see `environment_spec`)."""
    env_dir = task_dir.resolve() / "environment"
    dockerfile = env_dir / "Dockerfile"
    files: dict[str, str] = {}
    if (env_dir / "docker-compose.yaml").exists() or (env_dir / "docker-compose.yml").exists():
        unsupported.append("environment/docker-compose.yaml: services next to the task are not started")
    if not dockerfile.is_file():
        return DEFAULT_WORKDIR, files, None
    plan = parse_dockerfile(_read_text(dockerfile), DEFAULT_WORKDIR)
    staged_workdir = DEFAULT_WORKDIR
    build_only: list[str] = []  # what only an environment build honours
    for step in plan.steps:
        if step.kind == "WORKDIR":
            staged_workdir = step.args[0]
        elif step.kind in ("COPY", "ADD"):
            if not _copy(env_dir, staged_workdir, step, files):
                build_only.append(f"{step.where}: {step.kind} {' '.join(step.args)}")
        else:
            build_only.append(f"{step.where}: {step.kind} {' '.join(step.args)[:200]}")
    for line in plan.approximated:
        notes.append(line)
    info = HarborEnvironment(
        dockerfile=str(dockerfile),
        context=str(env_dir),
        base=plan.base,
        needs_build=bool(build_only) or bool(plan.unsupported),
        build_steps=build_only,
        approximated=list(plan.approximated),
        local_unsupported=unsupported_base(plan),
    )
    return plan.workdir.rstrip("/") or "/", files, info


def _copy(env_dir: Path, workdir: str, step, files: dict) -> bool:
    """Stage a COPY into the work dir as text task files; False when only a build can honour
    it (globs, a destination outside the work dir, binary or big files)."""
    *sources, dest = step.args
    if any(ch in a for a in sources for ch in "*?["):
        return False
    try:
        dest_rel = PurePosixPath(dest).relative_to(workdir)
    except ValueError:
        return False
    staged: dict[str, str] = {}
    problems: list[str] = []
    for source in sources:
        src = (env_dir / source).resolve()
        if not src.is_relative_to(env_dir.resolve()) or not src.exists():
            return False
        if src.is_dir():
            for rel, text in _text_files(src, f"environment/{source}", problems).items():
                staged[str(dest_rel / rel)] = text
        else:
            target = dest_rel / src.name if dest.endswith("/") or len(sources) > 1 else dest_rel
            content = _text_file(src, f"environment/{source}", problems)
            if content is not None:
                staged[str(target)] = content
    files.update(staged)
    return not problems


# -- files, paths, the oracle --------------------------------------------------------------
def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TaskError(f"{path}: cannot read: {error}") from None


def _text_file(path: Path, where: str, unsupported: list[str]) -> str | None:
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        unsupported.append(f"{where}: {len(data)} bytes; files are staged as text up to {MAX_FILE_BYTES} bytes")
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        unsupported.append(f"{where}: binary file; pi-env stages text files only")
        return None


def _text_files(directory: Path, where: str, unsupported: list[str]) -> dict[str, str]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        text = _text_file(path, f"{where}/{rel}", unsupported)
        if text is not None:
            files[rel] = text
    return files


def _rewriter(path_map: dict[str, str]):
    """Rewrite Harbor's absolute paths (as whole path prefixes, longest first) to the sandbox's."""
    prefixes = sorted((p for p in path_map if p != "/"), key=len, reverse=True)
    if not prefixes:
        return lambda text: text
    pattern = re.compile(r"(?<![\w./~-])(" + "|".join(re.escape(p) for p in prefixes) + r")(?![\w.-])")
    return lambda text: pattern.sub(lambda m: path_map[m.group(1)], text)


def _solution_steps(files: dict[str, str], env: dict[str, str]) -> list[dict]:
    """What Harbor's oracle does (run solution/solve.sh in the work dir) as Pi bash calls. A
    lone solve.sh is sent as the command itself, so the conversation shows the solution."""
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    if set(files) == {"solve.sh"}:
        return [{"tool": "bash", "command": exports + files["solve.sh"]}]
    lines = [f"mkdir -p {SANDBOX_SOLUTION}"]
    for rel, text in files.items():
        target = shlex.quote(f"{SANDBOX_SOLUTION}/{rel}")
        encoded = base64.b64encode(text.encode()).decode()
        lines.append(f"mkdir -p $(dirname {target}) && echo {encoded} | base64 -d > {target}")
    return [
        {"tool": "bash", "command": "\n".join(lines)},
        {"tool": "bash", "command": f"{exports}bash {SANDBOX_SOLUTION}/solve.sh"},
    ]
