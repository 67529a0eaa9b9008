"""Harbor task directories as `PiTask`s.

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
path-prefix rewrite; each task records its map in `metadata["harbor"]["path_map"]`). What the
local backend cannot honour (RUN steps, a prebuilt `docker_image`, GPUs, COPY outside the
work dir, binary files) is listed per task in `metadata["harbor"]["unsupported"]`: a warning
for `pi-env run`, and `pi-env collect` skips such tasks unless told to run them anyway.

Reward, as Harbor reads it: reward.txt (one number) wins; else reward.json, a JSON object of
named rewards, whose "reward" entry (or its only entry) is the reward; neither file: the
rollout is unscored (`invalid_reward`), never scored 0. test.sh's exit code is recorded but
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

from .task import PiTask, TaskError, validate_task

log = logging.getLogger(__name__)

DEFAULT_WORKDIR = "/app"
SANDBOX_TESTS = "/root/tests"
SANDBOX_SOLUTION = "/root/solution"
STAGED_TESTS = ".harbor/tests"  # verify_files are work-dir relative; the verifier moves them to /root/tests
MAX_FILE_BYTES = 1 << 20

# The verify command: move the tests out of the work dir, run test.sh, then turn Harbor's
# reward files into pi-env's one reward.txt (reward.txt first, else reward.json's "reward").
_VERIFY = """\
set -u
rm -rf {tests} && mkdir -p /root/logs/verifier /root/logs/agent && mv {staged} {tests} && rmdir .harbor 2>/dev/null
{env}bash {tests}/test.sh > /root/logs/verifier/test-stdout.txt 2>&1
status=$?
cat /root/logs/verifier/test-stdout.txt
python3 - <<'PI_ENV_HARBOR'
import json, math, os
d = "/root/logs/verifier"
txt, js = os.path.join(d, "reward.txt"), os.path.join(d, "reward.json")
if os.path.exists(txt):
    raise SystemExit(0)  # Harbor reads reward.txt first; pi-env scores it as it is
if not os.path.exists(js):
    why = "no reward file: test.sh wrote neither reward.txt nor reward.json"
else:
    try:
        rewards = json.load(open(js))
    except ValueError as error:
        rewards, why = None, f"reward.json is not JSON: {{error}}"
    if isinstance(rewards, dict):
        value = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
        why = None if isinstance(value, (int, float)) and not isinstance(value, bool) else \\
            f"reward.json has no numeric 'reward' entry: {{sorted(rewards)}}"
        print("reward.json:", json.dumps(rewards))
    elif rewards is not None:
        why = "reward.json is not a JSON object"
open(txt, "w").write(str(value) if why is None else why)
PI_ENV_HARBOR
exit $status
"""


def is_harbor_task(path: Path) -> bool:
    return path.is_dir() and (path / "instruction.md").is_file() and (path / "task.toml").is_file()


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

    workdir, env_files = _environment(task_dir, environment, unsupported, notes)
    path_map = {workdir: "/root/workdir", "/logs": "/root/logs", "/tests": SANDBOX_TESTS, "/solution": SANDBOX_SOLUTION}
    rewrite = _rewriter(path_map)

    tests_dir = task_dir / "tests"
    if not (tests_dir / "test.sh").is_file():
        raise TaskError(f"{task_dir}: tests/test.sh is missing; Harbor runs it as the verifier")
    verify_files = {f"{STAGED_TESTS}/{rel}": rewrite(text)
                    for rel, text in _text_files(tests_dir, "tests", unsupported).items()}
    verifier_env = _env_table(verifier, "verifier.env", task_dir, notes)
    verify = [_VERIFY.format(tests=SANDBOX_TESTS, staged=STAGED_TESTS,
                             env="".join(f"{k}={shlex.quote(v)} " for k, v in verifier_env.items()))]

    solution = None
    solve = task_dir / "solution" / "solve.sh"
    if solve.is_file():
        files = _text_files(task_dir / "solution", "solution", unsupported)
        solution = _solution_steps({rel: rewrite(text) for rel, text in files.items()},
                                   _env_table(solution_cfg, "solution.env", task_dir, notes))

    if environment.get("docker_image"):
        unsupported.append(f"[environment] docker_image = {environment['docker_image']!r}: the local backend "
                           "runs on the host's read-only /usr, not on an image")
    if int(environment.get("gpus") or 0) > 0:
        unsupported.append(f"[environment] gpus = {environment['gpus']}: the local backend has no GPUs")
    if verifier.get("network_mode") == "public":
        verify_network = True
    else:
        verify_network = False
        if environment.get("allow_internet", True) and verifier.get("network_mode") is None:
            notes.append("the verifier runs offline in pi-env (Harbor would give it the environment's network); "
                         "set [verifier] network_mode = \"public\" if test.sh needs it")
    if "cpus" in environment:
        notes.append(f"[environment] cpus = {environment['cpus']!r} is not enforced per task")
    limits = {name: _megabytes(environment, f"{name}_mb", name, task_dir) for name in ("memory", "storage")}

    meta = dict(config.get("metadata") or {})
    package = config.get("task") if isinstance(config.get("task"), dict) else {}
    meta["harbor"] = {"source": str(task_dir), "path_map": path_map, "unsupported": unsupported, "notes": notes}
    data: dict[str, Any] = {
        "task_id": str(package.get("name") or task_dir.name),
        "instruction": rewrite(_read_text(task_dir / "instruction.md")),
        "files": {rel: text for rel, text in env_files.items()},
        "verify": verify,
        "verify_files": verify_files,
        "solution": solution,
        "metadata": meta,
        "timeouts": {"agent_s": _seconds(agent, "timeout_sec", task_dir),
                     "verify_s": _seconds(verifier, "timeout_sec", task_dir) or 600.0,
                     "setup_s": _seconds(environment, "build_timeout_sec", task_dir)},
        "limits": {f"{name}_mb": value for name, value in limits.items() if value is not None},
        "setup_network": bool(environment.get("allow_internet", True)),
        "verify_network": verify_network,
    }
    task = validate_task(data, source=str(task_dir))
    for problem in unsupported:
        log.warning("Harbor task %s: not honoured by the local backend: %s", task.task_id, problem)
    return task


def unsupported_reasons(task: PiTask) -> list[str]:
    """What of a Harbor task's environment pi-env cannot honour ([] for other tasks)."""
    return list((task.metadata.get("harbor") or {}).get("unsupported") or [])


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
        raise TaskError(f"{task_dir}/task.toml: {size_key} = {value!r}; give a size such as \"512M\" or \"4G\"")
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
def _environment(task_dir: Path, environment: dict, unsupported: list[str], notes: list[str]):
    """The work dir and the files COPY'd into it; everything else a Dockerfile does is listed."""
    env_dir = task_dir / "environment"
    dockerfile = env_dir / "Dockerfile"
    workdir, files = DEFAULT_WORKDIR, {}
    if (env_dir / "docker-compose.yaml").exists() or (env_dir / "docker-compose.yml").exists():
        unsupported.append("environment/docker-compose.yaml: services next to the task are not started")
    if not dockerfile.is_file():
        return workdir, files
    for number, instruction in _dockerfile_instructions(_read_text(dockerfile)):
        where = f"environment/Dockerfile:{number}"
        word, _, rest = instruction.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            notes.append(f"{where}: FROM {rest}: runs on the host's read-only /usr instead of this image")
        elif word == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / rest)
        elif word in ("COPY", "ADD"):
            _copy(env_dir, workdir, rest, where, files, unsupported)
        elif word in ("LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "ARG", "SHELL", "STOPSIGNAL"):
            continue  # nothing a one-shot sandbox needs
        else:
            unsupported.append(f"{where}: {instruction[:200]}")
    return workdir.rstrip("/") or "/", files


def _dockerfile_instructions(text: str):
    number, parts, start = 0, [], 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not parts and (not stripped or stripped.startswith("#")):
            continue
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        yield start, " ".join(p for p in parts if p)
        parts = []
    if parts:
        yield start, " ".join(parts)


def _copy(env_dir: Path, workdir: str, rest: str, where: str, files: dict, unsupported: list[str]) -> None:
    args = [a for a in shlex.split(rest) if not a.startswith("--")]
    if len(args) < 2 or any(ch in a for a in args[:-1] for ch in "*?["):
        unsupported.append(f"{where}: COPY {rest}: only plain sources are staged")
        return
    *sources, dest = args
    dest_path = PurePosixPath(dest if dest.startswith("/") else f"{workdir}/{dest}")
    try:
        dest_rel = dest_path.relative_to(workdir)
    except ValueError:
        unsupported.append(f"{where}: COPY {rest}: the destination is outside the work dir {workdir}")
        return
    for source in sources:
        src = (env_dir / source).resolve()
        if not src.is_relative_to(env_dir.resolve()) or not src.exists():
            unsupported.append(f"{where}: COPY {source}: not a file or directory inside environment/")
            continue
        if src.is_dir():
            for rel, text in _text_files(src, f"environment/{source}", unsupported).items():
                files[str(dest_rel / rel)] = text
        else:
            target = dest_rel / src.name if dest.endswith("/") or len(sources) > 1 else dest_rel
            text = _text_file(src, f"environment/{source}", unsupported)
            if text is not None:
                files[str(target)] = text


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
    return [{"tool": "bash", "command": "\n".join(lines)},
            {"tool": "bash", "command": f"{exports}bash {SANDBOX_SOLUTION}/solve.sh"}]
