"""The verifier's world: nothing the agent left in its work dir decides its own score.

Verify must read the agent's work dir, so the work dir is where a hostile agent plants what it
hopes the verifier will run instead of its own tools. What this module does about it, in the
order a rollout calls it (`PiSession` in rollout.py; `record_setup`, `verify_env` and `reserve`
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

from ..sandbox import SANDBOX_HOME, SANDBOX_WORKDIR, Sandbox
from ..sandbox.base import HostPaths
from ..task import PiTask

VERIFIER_DIR = f"{SANDBOX_HOME}/logs/verifier"
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
ASIDE_DIR = f"{SANDBOX_HOME}/.pi-env-verify/set-aside"
OWN_PATH = "/usr/bin:/bin"  # what pi-env's own commands in the sandbox find their tools on
OWN_ENV = {"PATH": OWN_PATH, "BASH_ENV": "", "ENV": "", "LC_ALL": "C"}

# Verify's environment: no shell start-up file named by the environment; git runs no fsmonitor
# and no hook the work dir's .git/config names (`git status` in a verifier would run them).
# Python writes no compiled modules into the agent's work dir (they would outlive verify).
VERIFY_ENV = {
    "BASH_ENV": "",
    "ENV": "",
    "PYTHONDONTWRITEBYTECODE": "1",
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.fsmonitor",
    "GIT_CONFIG_VALUE_0": "false",
    "GIT_CONFIG_KEY_1": "core.hooksPath",
    "GIT_CONFIG_VALUE_1": "/dev/null",
}
# Hooks verify turns off unless setup made them (then they are the task's, restored with the
# home): name -> (value, home paths whose presence after setup means setup made them).
# GIT_CONFIG_GLOBAL names the home's own file, never /dev/null: a `git config --global` run as
# root would replace /dev/null with a regular file.
VERIFY_HOOKS = {
    "PYTHONNOUSERSITE": ("1", (f"{SANDBOX_HOME}/.local/lib",)),
    "GIT_CONFIG_GLOBAL": (f"{SANDBOX_HOME}/.gitconfig", (f"{SANDBOX_HOME}/.config/git",)),
}
# Work-dir files a verifier's tool loads on its own, wherever they are (pytest: conftest.py and
# its ini files; Python: sitecustomize, and compiled modules it prefers to their source when the
# source's mtime and size match; npm: the project .npmrc; node: node_modules).
TOOL_DIRS = ("node_modules", "__pycache__")
TOOL_FILES = ("conftest.py", "pytest.ini", ".pytest.ini", "sitecustomize.py", "usercustomize.py", ".npmrc", *TOOL_DIRS)
# Files that configure pytest only when they have its section (grep -E finds the section's header).
TOOL_SECTIONS = {"pyproject.toml": "tool.pytest", "setup.cfg": "tool:pytest", "tox.ini": "pytest"}
SECTION_PATTERN = (
    r"^[[:space:]]*\[(" + "|".join(section.replace(".", r"\.") for section in TOOL_SECTIONS.values()) + ")"
)
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
        sandbox, ["/bin/bash", "-c", _RECORD, "pi-env", SETUP_PATHS, *_find_args(sandbox, task)], keep_path=True
    )
    if outcome.exit_code != 0:
        raise OSError(f"could not record what setup left for the verifier: {outcome.stderr[-300:]}")
    path, _, python_path = outcome.stdout.partition("\0")
    return {"PATH": path, "PYTHONPATH": python_path}


def verify_env(sandbox: Sandbox, task: PiTask, setup_env: dict[str, str], caller_env: dict[str, str]) -> dict[str, str]:
    """The environment of every verify command: VERIFY_ENV and the hooks setup did not make
    turned off (unless the caller set them on purpose in PiConfig.extra_env), pi-env's Python
    start-up first on PYTHONPATH (setup's after it), and PATH (setup's, the caller's included)
    with every entry in the work dir, or relative to the cwd, after the others."""
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

    ordered = [e for e in entries if not agents(e)] + [e for e in entries if agents(e)]
    if ordered != entries:
        env["PATH"] = ":".join(ordered)
    return env


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


def startup_mount() -> dict[str, str]:
    """The sandbox's read-only mount of pi-env's Python start-up (SandboxSpec.ro_mounts): the
    file alone, which a backend can bind from a copy where pi-env is installed out of the
    sandbox uid's reach (a private dir, a package under /root)."""
    return {f"{STARTUP_DIR}/sitecustomize.py": f"{STARTUP_HOST_DIR}/sitecustomize.py"}


# -- before verify --------------------------------------------------------------------------

# Each path moved is printed as "<n> <hex of its bytes>": pi-env keeps the list (a full home
# could not hold it) and hands it back to _PUT_BACK; names need not be UTF-8.
_SET_ASIDE = r"""set -u
list=$1 aside=$2 count=$3; shift 3
always=("${@:1:count}"); shift "$count"
PATH=/usr/bin:/bin
rm -rf -- "$aside"; mkdir -p -- "$aside"
[ -f "$list" ] || list=/dev/null
{ find "$@" 2>/dev/null | sort -z | comm -z -23 - "$list"; [ "$count" = 0 ] || printf '%s\0' "${always[@]}"; } | {
    i=0
    while IFS= read -r -d '' path; do
        if mv -T -- "$path" "$aside/$i" 2>/dev/null; then
            printf '%s %s\n' "$i" "$(printf '%s' "$path" | od -An -v -tx1 | tr -d ' \n')"; i=$((i+1))
        fi
    done
}
"""

_PUT_BACK = r"""set -u
aside=$1; shift
PATH=/usr/bin:/bin
for entry in "$@"; do
    i=${entry%% *} hex=${entry#* } escaped=
    for ((k = 0; k < ${#hex}; k += 2)); do escaped+="\\x${hex:k:2}"; done
    printf -v path '%b' "$escaped"
    rm -rf -- "$path"; mkdir -p -- "${path%/*}"; mv -T -- "$aside/$i" "$path"
done
rm -rf -- "$aside"
"""


def set_aside(sandbox: Sandbox, task: PiTask) -> tuple[list[str], list[str]]:
    """Move out of the work dir, for the verify phase, what the agent planted that a verifier's
    tool loads on its own (see the module docstring), then stage the task's own files of those
    names again. Returns (what to hand to put_back, notes for the result)."""
    workdir = _in_sandbox(sandbox, SANDBOX_WORKDIR).rstrip("/") + "/"
    # The task's own files of those names (the agent may have changed them), and whatever the
    # agent left where hidden files go: set aside whether setup made them or not.
    own = (
        [workdir + path for path in task.files if _is_tool_path(task, path)]
        + [workdir + path for path in task.verify_files]
        + [
            workdir + name
            for module in _verifier_modules(task)
            for name in (module, f"{module}.py")
            if name not in task.verify_files and name not in _staging_dirs(task)
        ]
    )
    outcome = _own(
        sandbox,
        [
            "/bin/bash",
            "-c",
            _SET_ASIDE,
            "pi-env",
            SETUP_PATHS,
            ASIDE_DIR,
            str(len(own)),
            *own,
            *_find_args(sandbox, task),
        ],
    )
    if outcome.exit_code != 0:
        raise OSError(f"could not set aside the agent's verifier files: {outcome.stderr[-300:]}")
    moved = [line for line in outcome.stdout.splitlines() if re.fullmatch(r"\d+ [0-9a-f]+", line)]
    for path, text in task.files.items():
        if _is_tool_path(task, path):
            sandbox.write_file(path, text)
    # The notes name only what the agent planted: not the task's own, nor where hidden files go.
    expected = set(own)
    names = [
        name.removeprefix(workdir)
        for name in (bytes.fromhex(line.split()[1]).decode("utf-8", "replace") for line in moved)
        if name not in expected
    ]
    if not names:
        return moved, []
    shown = ", ".join(names[:MAX_NOTE_NAMES]) + (
        f" and {len(names) - MAX_NOTE_NAMES} more" if len(names) > MAX_NOTE_NAMES else ""
    )
    return moved, [f"set aside for verify (the agent's, and a verifier's tool would load it): {shown}"]


def put_back(sandbox: Sandbox, task: PiTask, moved: list[str]) -> None:
    """Undo set_aside() and stage(): the hidden files gone, the agent's files back where it left
    them, so the work dir is the agent's again (the collected files, a later step's agent).
    Call with nothing running."""
    for path in task.verify_files:
        sandbox.remove(path)
    for start in range(0, len(moved), 500):  # nothing moved: no command; 500 a command, well within ARG_MAX
        outcome = _own(sandbox, ["/bin/bash", "-c", _PUT_BACK, "pi-env", ASIDE_DIR, *moved[start : start + 500]])
        if outcome.exit_code != 0:
            raise OSError(f"could not put back the agent's verifier files: {outcome.stderr[-300:]}")


def stage(sandbox: Sandbox, task: PiTask) -> None:
    """Before each verify command: an empty logs/verifier and the hidden verify files as the
    task wrote them."""
    sandbox.remove(VERIFIER_DIR)  # whatever the agent (or an earlier command's agent code) wrote there
    sandbox.write_file(f"{VERIFIER_DIR}/.keep", "")
    for path, text in task.verify_files.items():
        sandbox.write_file(path, text)


# -- after verify ---------------------------------------------------------------------------


@dataclass
class RewardReading:
    """What the reward file said. `reward` None: the task scores by pass rate. `valid` False: a
    reward file counted but was missing or not a number in range (then `reward` is 0.0)."""

    reward: float | None = None
    valid: bool = True
    notes: list[str] = field(default_factory=list)


def read_reward(sandbox: Sandbox, task: PiTask) -> RewardReading:
    """The reward file as the last verify command left it: reward.txt (one number) first, else
    reward.json (an object whose "reward" entry, or only entry, is a number)."""
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


def _is_tool_path(task: PiTask, path: str) -> bool:
    """Does `path` (work-dir relative) fall under what set_aside moves? (TOOL_SECTIONS files are
    the task's own: staged again whatever their content.)"""
    parts = path.split("/")
    return (
        parts[-1] in TOOL_FILES
        or parts[-1] in TOOL_SECTIONS
        or any(d in parts[:-1] for d in TOOL_DIRS)
        or parts[0] in _staging_dirs(task)
        or path in _init_files(task)
    )


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


def _staging_dirs(task: PiTask) -> set[str]:
    """Top-level work-dir dirs hidden verify files are staged into: the verifier's alone."""
    return {path.split("/")[0] for path in task.verify_files if "/" in path}


def _init_files(task: PiTask) -> set[str]:
    """An `__init__.py` beside a hidden verify file would make pytest import it as a package."""
    return {"/".join([*path.split("/")[:-1], "__init__.py"]) for path in task.verify_files}


def _find_args(sandbox: Sandbox, task: PiTask) -> list[str]:
    """find's arguments for every path set_aside moves (printed NUL-terminated, absolute)."""
    workdir = _in_sandbox(sandbox, SANDBOX_WORKDIR).rstrip("/")
    names: list[str] = []
    for name in TOOL_FILES:
        if name not in TOOL_DIRS:
            names += ["-o", "-name", name]
    pruned: list[str] = []
    for name in TOOL_DIRS:
        pruned += ["-o", "-name", name]
    for path in sorted(_init_files(task)):
        names += ["-o", "-path", _glob_escape(f"{workdir}/{path}")]
    for top in sorted(_staging_dirs(task)):
        base = _glob_escape(f"{workdir}/{top}")
        names += ["-o", "-path", base, "-o", "-path", f"{base}/*"]
    sections: list[str] = []
    for name in TOOL_SECTIONS:
        sections += ["-o", "-name", name]
    return [
        workdir,
        "-mindepth",
        "1",
        "(",
        "(",
        *pruned[1:],
        ")",
        "-prune",
        "-print0",
        ")",
        "-o",
        "(",
        "(",
        *names[1:],
        ")",
        "-print0",
        ")",
        "-o",
        "(",
        "(",
        *sections[1:],
        ")",
        "-type",
        "f",
        "-exec",
        "grep",
        "-qsE",
        SECTION_PATTERN,
        "{}",
        ";",
        "-print0",
        ")",
    ]


def _glob_escape(path: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", path)


def _in_sandbox(sandbox: Sandbox, path: str) -> str:
    """A sandbox path as the sandbox's commands see it (unsafe-local runs on host paths)."""
    return sandbox.host_path(path) if isinstance(sandbox, HostPaths) and path.startswith("/") else path


def _own(sandbox: Sandbox, argv: list[str], *, keep_path: bool = False):
    """One of pi-env's own commands: an absolute program, from the home, PATH=/usr/bin:/bin
    (keep_path: the task's PATH, for a script that reads it before setting its own)."""
    env = {name: value for name, value in OWN_ENV.items() if not (keep_path and name == "PATH")}
    return sandbox.exec(argv, cwd=SANDBOX_HOME, env=env, timeout_s=120, network="none")
