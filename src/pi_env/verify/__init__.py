"""The verifier's world: nothing the agent left in its work dir decides its own score.

Verify must read the agent's work dir, so the work dir is where a hostile agent plants what it
hopes the verifier will run instead of its own tools. What this module does about it, in the
order a rollout calls it (`PiSession` in pi_env.rollout; `record_setup`, `verify_env` and `reserve`
through `world.py`'s `VerifyWorld`, which also restores the home or makes a fresh sandbox for
verify; docs/isolation.md has the guarantees and the residue):

- `record_setup` (after setup, before the agent): which paths of the work dir that configure
  the verifier's tools setup made, and the PATH setup's commands had.
- `verify_env`: the environment of every verify command. PATH with nothing of the work dir in
  front; Python started with pi-env's start-up (startup/sitecustomize.py), which looks up a top-level
  module in the verifier's part of sys.path first, so the agent's `pytest.py` or `json.py` is
  imported only where the verifier has nothing of that name; git with no fsmonitor and no hooks;
  no shell start-up file; no user site unless setup made one.
- `set_aside` (before verify): what the agent planted that a verifier's tool would load on its
  own (conftest.py, pytest.ini and the pytest sections of pyproject.toml/setup.cfg/tox.ini,
  sitecustomize.py, __pycache__, .npmrc, node_modules, an `__init__.py` beside a hidden verify
  file, anything in a directory hidden verify files are staged into) is moved out of the work
  dir for the verify phase and put back after it (`put_back`); the task's own files of those
  names are staged again as the task wrote them.
- `stage` (before each verify command): an empty logs/verifier and the hidden verify files
  written afresh, so one command's agent code cannot rewrite the next's.
- `read_reward`: the reward file counts only where the task uses one (`uses_reward_file`),
  only as the last verify command left it, and only as a finite number within the task's
  `reward_range`; anything else there is a 0.0 with the reason, never an unscored rollout.

Every command pi-env itself runs here is an absolute program with PATH=/usr/bin:/bin, started
from the home, never from the work dir, and never runs Python.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources

from ..results import CommandResult
from ..sandbox import SANDBOX_HOME, SANDBOX_WORKDIR, Sandbox
from ..sandbox.base import HostPaths
from ..task import PiTask
from .room import TOOL_CONFIG, VERIFIER_DIR, stage

__all__ = ["VERIFIER_DIR", "stage"]  # (staging is the room's: pi_env.verify.room)

REWARD_FILE = f"{VERIFIER_DIR}/reward.txt"
REWARD_JSON = f"{VERIFIER_DIR}/reward.json"
# pi-env's Python start-up (startup/sitecustomize.py), mounted read-only in every sandbox.
STARTUP_DIR = "/opt/pi-env-verify"
STARTUP_HOST_DIR = str(resources.files(__package__).joinpath("startup"))
# pi-env's own notes in the home (verify's home is setup's, restored; see world.py).
SETUP_PATHS = f"{SANDBOX_HOME}/.pi-env-verify/setup-paths"
# Room in a capped home (blocks and inodes) kept for verify's own files while the agent runs:
# hidden from the agent (SandboxSpec.agent_masked_paths), freed when verify's world is restored.
RESERVE_DIR = f"{SANDBOX_HOME}/.pi-env-reserve"
RESERVE_MIN_BYTES, RESERVE_INODES = 8 << 20, 64
OWN_PATH = "/usr/bin:/bin"  # what pi-env's own commands in the sandbox find their tools on
OWN_ENV = {"PATH": OWN_PATH, "BASH_ENV": "", "ENV": "", "LC_ALL": "C"}

# Verify's environment: no shell start-up file named by the environment; git runs no fsmonitor
# and no hook the work dir's .git/config names (`git status` in a verifier would run them).
# Python writes no compiled modules into the agent's work dir (they would outlive verify).
VERIFY_ENV = {
    "BASH_ENV": "",
    "ENV": "",
    "PYTHONDONTWRITEBYTECODE": "1",
    "GIT_CONFIG_COUNT": "3",
    "GIT_CONFIG_KEY_0": "core.fsmonitor",
    "GIT_CONFIG_VALUE_0": "false",
    "GIT_CONFIG_KEY_1": "core.hooksPath",
    "GIT_CONFIG_VALUE_1": "/dev/null",
    # No directory of the agent's is taken for a bare repository (its config would be read).
    "GIT_CONFIG_KEY_2": "safe.bareRepository",
    "GIT_CONFIG_VALUE_2": "explicit",
}
# Hooks verify turns off unless setup made them (then they are the task's, restored with the
# home): name -> (value, home paths whose presence after setup means setup made them).
# GIT_CONFIG_GLOBAL names the home's own file, never /dev/null: a `git config --global` run as
# root would replace /dev/null with a regular file.
VERIFY_HOOKS = {
    "PYTHONNOUSERSITE": ("1", (f"{SANDBOX_HOME}/.local/lib",)),
    "GIT_CONFIG_GLOBAL": (f"{SANDBOX_HOME}/.gitconfig", (f"{SANDBOX_HOME}/.config/git",)),
}
MAX_REWARD_BYTES = 64 << 10
MAX_NOTE_NAMES = 20
# A verify command or verify file naming this uses a reward file (when the task does not say).
REWARD_FILE_MARK = "logs/verifier/reward"


def uses_reward_file(task: PiTask) -> bool:
    """Does a reward file decide this task's reward? `task.reward_file` when set; else True when a
    verify command or a hidden verify file names logs/verifier/reward (the verifier writes one)."""
    if task.reward_file is not None:
        return task.reward_file
    return any(REWARD_FILE_MARK in text for text in [*task.verify, *task.verify_files.values()])


# -- after setup ----------------------------------------------------------------------------

_RECORD = r"""set -u
out=$1; shift
printf '%s\0%s' "${PATH-}" "${PYTHONPATH-}"
PATH=/usr/bin:/bin
mkdir -p -- "${out%/*}"
find "$@" 2>/dev/null | sort -z > "$out"
"""


def record_setup(sandbox: Sandbox, task: PiTask, *, setup_ran: bool, env: dict[str, str]) -> dict[str, str]:
    """Remember (in the sandbox's home, restored for verify like the rest of setup's home) which
    of the paths `set_aside` would move setup itself made; returns the PATH and PYTHONPATH that
    setup's commands had. Without setup commands or a built environment (`setup_ran` False)
    setup made nothing but the task's files, which set_aside handles on its own, and the
    environment is `env` (SandboxSpec.env): no command needs to run."""
    if not setup_ran:
        sandbox.remove(SETUP_PATHS)
        return {"PATH": env.get("PATH", ""), "PYTHONPATH": env.get("PYTHONPATH", "")}
    outcome = _own(
        sandbox,
        ["/bin/bash", "-c", _RECORD, "pi-env", _in_sandbox(sandbox, SETUP_PATHS), *_config_find_args(sandbox)],
        keep_path=True,
    )
    if outcome.exit_code != 0:
        raise OSError(f"could not record what setup left for the verifier: {outcome.stderr[-300:]}")
    path, _, python_path = outcome.stdout.partition("\0")
    return {"PATH": path, "PYTHONPATH": python_path}


def verify_env(sandbox: Sandbox, task: PiTask, setup_env: dict[str, str], caller_env: dict[str, str]) -> dict[str, str]:
    """The environment of every verify command: VERIFY_ENV and the hooks setup did not make
    turned off (unless the caller set them on purpose in PiConfig.sandbox.extra_env), pi-env's Python
    start-up first on PYTHONPATH (setup's after it), and PATH (setup's, the caller's included)
    without any entry in the work dir or relative to the cwd: a runner on PATH is the
    verifier's, never a program of the agent's (a task runs its program by its path)."""
    env = dict(VERIFY_ENV)
    for name, (value, made_by_setup) in VERIFY_HOOKS.items():
        if not any(sandbox.exists(path) for path in made_by_setup):
            env[name] = _in_sandbox(sandbox, value)
    env = {name: value for name, value in env.items() if name not in caller_env}
    # unsafe-local mounts nothing: its commands read the start-up where pi-env is installed.
    startup = STARTUP_HOST_DIR if isinstance(sandbox, HostPaths) else STARTUP_DIR
    env["PYTHONPATH"] = ":".join(filter(None, [startup, setup_env.get("PYTHONPATH")]))
    env["PI_ENV_WORKDIR"] = workdir = _in_sandbox(sandbox, SANDBOX_WORKDIR).rstrip("/")
    env.update(verifier_modules_env(task))
    entries = setup_env["PATH"].split(":") if setup_env.get("PATH") else []

    def agents(entry: str) -> bool:
        return not entry.startswith("/") or entry.rstrip("/") == workdir or entry.startswith(workdir + "/")

    kept = [entry for entry in entries if not agents(entry)]
    if kept != entries:
        env["PATH"] = ":".join(kept)
    return env


# `python3 -m NAME` at the start of a verify command (or after `&&`, `;`, `|`, `(`): the runner
# pi-env checks for after setup. A command that changes its Python first (a venv, uv, PATH) is
# not checked: pi-env cannot tell which Python it runs.
_RUNNER = re.compile(
    r"(?:^|&&|\|\||[;|(])\s*(?:\w+=\S*\s+)*((?:/\S*/)?python(?:3(?:\.\d+)?)?)((?:\s+-[A-Za-z]+)*)\s+-m\s*([A-Za-z_]\w*)"
)
_OWN_PYTHON = re.compile(r"activate|\buv\b|poetry|conda|pipenv|hatch|pdm|\btox\b|\bnox\b|\bPATH=|\bpip\b")
_HAS_MODULE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"


def missing_runner(sandbox: Sandbox, task: PiTask, env: dict[str, str]) -> str | None:
    """After setup, before the agent: a `python3 -m NAME` runner a verify command names that the
    sandbox's Python lacks, as the task's error (never the agent's: a runner the image lacks
    is not looked up in the work dir, pi_env.verify.startup). None when every one is there, or
    pi-env cannot tell (a verify with network may install it; a command that picks its Python)."""
    if task.verify_network:
        return None
    wanted = {
        (match.group(1), match.group(3))
        for command in task.verify
        if not _OWN_PYTHON.search(command)
        for match in _RUNNER.finditer(command)
        if "m" not in match.group(2).replace("-", "")  # `-Bm x`: rare, not checked
    }
    for python, module in sorted(wanted):
        outcome = sandbox.exec(
            [python, "-c", _HAS_MODULE, module], cwd=SANDBOX_HOME, env=env, timeout_s=60, network="none"
        )
        if outcome.exit_code == 3:
            return (
                f"a verify command runs `{python} -m {module}`, but the sandbox's {python} has no module "
                f"{module!r}: install it in setup (or the task's image); it is never taken from the agent's work dir"
            )
    return None


def reserve(sandbox: Sandbox, task: PiTask, disk_bytes: int | None) -> None:
    """Keep room for verify in a capped home, after setup and before the agent: a file the size
    of the hidden files twice over plus 8 MiB (for the verifier's logs and reward), at most a
    tenth of the disk total, and RESERVE_INODES empty files. The agent cannot reach them (the
    dir is masked in its commands); restoring setup's home for verify deletes them, so however
    full the agent leaves its home, staging the hidden files and logs/verifier does not fail."""
    hidden = sum(len(text.encode()) for text in task.verify_files.values())
    size = 2 * hidden + RESERVE_MIN_BYTES
    if disk_bytes:
        size = min(size, disk_bytes // 10)
    sandbox.write_file(f"{RESERVE_DIR}/room", b"\xff" * size)  # written: tmpfs holds no room for holes
    for index in range(RESERVE_INODES + len(task.verify_files)):
        sandbox.write_file(f"{RESERVE_DIR}/{index}", b"")


# The verifier's own Python files, mounted read-only in every sandbox at STARTUP_DIR (first on
# verify's PYTHONPATH): the start-up, and the helpers a check imports (pi_env_check.py).
STARTUP_FILES = ("sitecustomize.py", "pi_env_check.py")


def startup_mount() -> dict[str, str]:
    """The sandbox's read-only mounts of pi-env's verifier files (SandboxSpec.ro_mounts): each
    file alone, which a backend can bind from a copy where pi-env is installed out of the
    sandbox uid's reach (a private dir, a package under /root)."""
    return {f"{STARTUP_DIR}/{name}": f"{STARTUP_HOST_DIR}/{name}" for name in STARTUP_FILES}


# -- after verify ---------------------------------------------------------------------------


@dataclass
class RewardReading:
    """What the reward file said. `reward` None: the task scores by pass rate. `valid` False: a
    reward file counted but was missing or not a number in range (then `reward` is 0.0)."""

    reward: float | None = None
    valid: bool = True
    notes: list[str] = field(default_factory=list)


def read_reward(sandbox: Sandbox, task: PiTask, last: CommandResult | None = None) -> RewardReading:
    """The reward file as the last verify command (`last`) left it: reward.txt (one number)
    first, else reward.json (an object whose "reward" entry, or only entry, is a number). It
    counts only when that command ended on its own: one killed by a signal (a status of 128 or
    more, as shells report it) or timed out may have been killed by the agent's code it ran,
    which then wrote the file in its place."""
    if not uses_reward_file(task):
        written = [path for path in (REWARD_FILE, REWARD_JSON) if sandbox.exists(path)]
        return RewardReading(
            notes=[
                f"{written[0]} ignored: this task scores by pass rate (it does not set "
                "reward_file, and no verify command or file names the reward file)"
            ]
            if written
            else []
        )
    if last is not None and (last.timed_out or last.exit_code is None or not 0 <= last.exit_code < 128):
        ended = "timed out" if last.timed_out else f"ended with status {last.exit_code} (killed)"
        return RewardReading(
            0.0, valid=False, notes=[f"reward 0.0: the last verify command {ended}, so its reward file does not count"]
        )
    low, high = task.reward_range
    value, why = _reward_value(sandbox)
    if why is None and not low <= value <= high:
        why = f"holds {value!r}, outside the task's reward_range [{low:g}, {high:g}]"
    if why is not None:
        return RewardReading(0.0, valid=False, notes=[f"reward 0.0: the reward file {why}"])
    named = _named_rewards(sandbox)
    return RewardReading(value, notes=[named] if named else [])


def _reward_value(sandbox: Sandbox) -> tuple[float, str | None]:
    """(the reward, None) or (nan, why there is none)."""
    text, why = _read(sandbox, REWARD_FILE)
    if text is not None:
        try:
            value = float(text.strip())
        except ValueError:
            return math.nan, f"{REWARD_FILE} holds {text.strip()[:80]!r}, not a number"
        return value, None if math.isfinite(value) else f"{REWARD_FILE} holds {text.strip()[:80]!r}, not finite"
    if why is not None:
        return math.nan, why
    text, why = _read(sandbox, REWARD_JSON)
    if text is None:
        return math.nan, why or "is missing: the verifier wrote neither reward.txt nor reward.json"
    try:
        rewards = json.loads(text)
    except ValueError as error:
        return math.nan, f"{REWARD_JSON} is not JSON: {error}"
    if not isinstance(rewards, dict):
        return math.nan, f"{REWARD_JSON} is not a JSON object"
    entry = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
    if isinstance(entry, bool) or not isinstance(entry, (int, float)) or not math.isfinite(entry):
        return math.nan, f"{REWARD_JSON} has no finite numeric 'reward' entry: {sorted(rewards)[:10]}"
    return float(entry), None


def _named_rewards(sandbox: Sandbox) -> str | None:
    """reward.json as the verifier wrote it, for the result, when it decided the reward."""
    if sandbox.exists(REWARD_FILE):
        return None
    text, _ = _read(sandbox, REWARD_JSON)
    return f"reward.json: {text.strip()[:500]}" if text else None


def _read(sandbox: Sandbox, path: str) -> tuple[str | None, str | None]:
    """(the file's text, None), (None, None) when there is no file, or (None, why it cannot be read)."""
    try:
        data = sandbox.read_file(path, max_bytes=MAX_REWARD_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as error:  # a directory, a fifo, ...: agent code run by verify can make it so
        return None, f"{path} cannot be read as a file ({type(error).__name__})"
    if len(data) > MAX_REWARD_BYTES:
        return None, f"{path} is larger than {MAX_REWARD_BYTES >> 10} KiB"
    return data.decode("utf-8", "replace"), None


# -- helpers --------------------------------------------------------------------------------


def verifier_modules_env(task: PiTask) -> dict[str, str]:
    """Top-level modules of `task`'s hidden files (a staged `test/` package, a `helpers.py`): the
    verifier's own, so found where Python would find them, as the stdlib's `test` is not. Per
    verified task: a later Harbor step stages hidden files of its own."""
    return {"PI_ENV_VERIFIER_MODULES": ",".join(sorted(_verifier_modules(task)))}


def _verifier_modules(task: PiTask) -> set[str]:
    """Top-level module names the hidden verify files make in the work dir."""
    names = set()
    for path in task.verify_files:
        top = path.split("/")[0]
        names.add(top.removesuffix(".py") if "/" not in path else top)
    return {name for name in names if name.isidentifier()}


def _in_sandbox(sandbox: Sandbox, path: str) -> str:
    """A sandbox path as the sandbox's commands see it (unsafe-local runs on host paths)."""
    return sandbox.host_path(path) if isinstance(sandbox, HostPaths) and path.startswith("/") else path


def _config_find_args(sandbox: Sandbox) -> list[str]:
    """find's arguments for the work dir's tool configuration (room.TOOL_CONFIG), absolute."""
    names: list[str] = []
    for pattern in TOOL_CONFIG:
        names += ["-o", "-name", pattern]
    workdir = _in_sandbox(sandbox, SANDBOX_WORKDIR).rstrip("/")
    return [workdir, "-mindepth", "1", "(", *names[1:], ")", "-prune", "-print0"]


def _own(sandbox: Sandbox, argv: list[str], *, keep_path: bool = False):
    """One of pi-env's own commands: an absolute program, from the home, PATH=/usr/bin:/bin
    (keep_path: the task's PATH, for a script that reads it before setting its own)."""
    env = {name: value for name, value in OWN_ENV.items() if not (keep_path and name == "PATH")}
    return sandbox.exec(argv, cwd=SANDBOX_HOME, env=env, timeout_s=120, network="none")
