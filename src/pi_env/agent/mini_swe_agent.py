"""mini-swe-agent (PyPI `mini-swe-agent`), a Python CLI speaking Chat Completions through litellm
(`openai/<model>` + `api_base`, never streamed), with one tool, `bash{command}`
(docs/agents/mini-swe-agent.md).

Installed once per machine into a venv made by the system's /usr/bin/python3 (the sandbox sees the
host's /usr, not a pyenv), built in a staging dir and renamed into place: so it is only ever run as
`<AGENT_ROOT>/venv/bin/python -I -m minisweagent.run.mini`, never through pip's shebang scripts,
whose interpreter path is the staging dir's. `-I` keeps the work dir off sys.path (a task's
`litellm.py` does not shadow litellm) and ignores PYTHON* variables and the user site.

Everything of one run is in one config file (`prepare`), given by absolute path after mini's own
default (a bare `-c mini.yaml` would be looked up in the work dir first): the model, the gateway as
its `api_base`, the session token as its key, a bounded step limit, the bash commands' cwd, and the
task itself (`run.task`: no argv size limit). The agent ends only when a command's output begins
with `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` (`submit_command`), at its step limit, or after three
answers in a row without a bash call."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

from ..sandbox import SANDBOX_WORKDIR, Sandbox
from .base import AGENT_ROOT, LOG_DIR, SYSTEM_PATH, Agent, AgentRun, Installed, ReadTree, gateway_env, launched
from .runtime import RuntimeInstallError, archive_dir_of, cached_install, progress_to_stderr, tree_size

SYSTEM_PYTHON = "/usr/bin/python3"  # the sandbox has the host's /usr (not /root/.pyenv)
PIP_INSTALL_TIMEOUT_S = 900
MINI_MODULE = "minisweagent.run.mini"
CONSTRAINTS = resources.files("pi_env.agent").joinpath(
    "mini_swe_agent_constraints.txt"
)  # what the `mini` entry point calls (mini.py runs app() as __main__)

# Sandbox paths of one run.
HOME = "/root"
RUN_DIR = f"{LOG_DIR}/mini-swe-agent"
CONFIG_PATH = f"{RUN_DIR}/config.yaml"
TRAJECTORY_NAME = "trajectory.json"
TRAJECTORY_PATH = f"{RUN_DIR}/{TRAJECTORY_NAME}"
GLOBAL_CONFIG_DIR = f"{RUN_DIR}/global"  # its ~/.config/mini-swe-agent (a .env it would load): empty
TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES = 8, 64 << 20

# Printed as the first line of a command's output (exit 0), it ends the run (LocalEnvironment).
SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
DEFAULT_STEP_LIMIT = 50
DEFAULT_COMMAND_TIMEOUT_S = 120  # one bash command (mini's own default is 30 s)

# What PyYAML 1.1 refuses in a stream (outside its reader's printable set) or folds in a
# double-quoted scalar (the line breaks NEL, LS, PS): escaped as \uXXXX, read back as itself.
_NOT_YAML_VERBATIM = re.compile("[^\x09\x0a\x0d\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True)
class MiniSweInstall:
    """mini-swe-agent's venv on this machine (cache/runtimes/<key>/venv)."""

    root: str  # host path, mounted read-only at AGENT_ROOT
    version: str
    python_version: str  # of /usr/bin/python3, which the venv's python links to
    site_packages: str  # relative to root
    size_bytes: int = 0
    install_s: float = 0.0

    @property
    def archive_dir(self) -> str:
        return archive_dir_of(self.root)

    @property
    def host_python(self) -> str:
        return str(Path(self.root) / "venv/bin/python")

    @property
    def sandbox_python(self) -> str:
        return f"{AGENT_ROOT}/venv/bin/python"

    @property
    def sandbox_builtin_config(self) -> str:
        """mini's own default config (its prompt templates), by absolute path."""
        return f"{AGENT_ROOT}/{self.site_packages}/minisweagent/config/mini.yaml"


def offline_env() -> dict[str, str]:
    """What keeps litellm and mini-swe-agent from any remote fetch, wizard or .env file."""
    return {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else a price list is fetched at import
        "LITELLM_OFFLINE_MODE": "true",  # any other catalogue or check litellm fetches on its own
        "LITELLM_MODE": "PRODUCTION",  # DEV (the default) loads a .env found above litellm's own dir
        "MSWEA_CONFIGURED": "true",  # else an interactive set-up wizard
        "MSWEA_COST_TRACKING": "ignore_errors",  # an unknown model has no price: not an error
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # retries belong to the harness
        "MSWEA_GLOBAL_CONFIG_DIR": GLOBAL_CONFIG_DIR,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def mini_env() -> dict[str, str]:
    """The agent's environment, which its bash commands inherit."""
    return {
        **gateway_env(),
        **offline_env(),
        "HOME": HOME,
        "PATH": SYSTEM_PATH,  # the task's python3, not the agent's venv
        "NO_COLOR": "1",
        "TERM": "dumb",
        "PAGER": "cat",
    }


def mini_config(run: AgentRun, step_limit: int, command_timeout_s: int) -> dict[str, Any]:
    """The run's config, merged over mini's default mini.yaml (which gives the prompt templates)."""
    config = run.config
    return {
        "run": {"task": run.instruction},
        "agent": {
            "step_limit": step_limit,
            "cost_limit": 0,  # no price for a local model: the step limit bounds the run
            "mode": "yolo",
            "confirm_exit": False,
            "output_path": TRAJECTORY_PATH,
        },
        "environment": {
            "environment_class": "local",
            "cwd": SANDBOX_WORKDIR,
            "timeout": command_timeout_s,
        },
        "model": {
            "model_class": "litellm",
            "model_name": f"openai/{run.model}",
            "cost_tracking": "ignore_errors",
            "set_cache_control": None,  # never added for a model whose name says "claude"
            "litellm_model_registry": None,
            "model_kwargs": {
                "api_base": run.base_url,
                "api_key": run.token,
                "max_tokens": config.gateway.max_tokens,
                "max_retries": 0,
                "drop_params": True,
            },
        },
    }


def config_text(config: dict[str, Any]) -> str:
    """`config` as YAML PyYAML reads back exactly: JSON (a subset of YAML), with the characters
    PyYAML refuses or folds escaped."""
    text = json.dumps(config, ensure_ascii=False, indent=1)
    return _NOT_YAML_VERBATIM.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


class MiniSweAgent(Agent):
    """mini-swe-agent behind the gateway forwarder (`launched`): docs/agents/mini-swe-agent.md."""

    name = "mini-swe-agent"
    package = "mini-swe-agent"
    default_version = "2.4.6"
    uses_launcher = True  # a Python CLI: the forwarder runs in front of it
    options = {
        "step_limit": "model calls before the run ends (default: max_turns, else 50)",
        "command_timeout_s": "seconds one bash command may run",
    }
    submit_command = f"echo {SUBMIT_SENTINEL}"

    @property
    def step_limit(self) -> int:
        value = self.settings.options.get("step_limit")
        if value is None:
            return self.config.gateway.max_turns or DEFAULT_STEP_LIMIT
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"mini-swe-agent's step_limit must be a positive integer, not {value!r}")
        return value

    @property
    def command_timeout_s(self) -> int:
        value = self.settings.options.get("command_timeout_s", DEFAULT_COMMAND_TIMEOUT_S)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"mini-swe-agent's command_timeout_s must be a positive integer, not {value!r}")
        return value

    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> MiniSweInstall:
        return install_mini(self.version, cache_dir, progress)

    def masked_paths(self, installed: Installed) -> tuple[str, ...]:
        return ()  # nothing in the work dir is read: the config is given by absolute path, `-I`

    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        config = mini_config(run, self.step_limit, self.command_timeout_s)
        sandbox.write_file(CONFIG_PATH, config_text(config))

    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        mini = _install(installed)
        argv = [
            mini.sandbox_python,
            "-I",  # isolated: no work dir on sys.path, no PYTHON* variables, no user site
            "-B",  # the install is read-only
            "-u",
            "-m",
            MINI_MODULE,
            "-y",
            "--exit-immediately",
            "-c",
            mini.sandbox_builtin_config,
            "-c",
            CONFIG_PATH,
            "-o",
            TRAJECTORY_PATH,
        ]
        return launched(argv), mini_env(), None

    def transcript(self, read: ReadTree) -> list[dict]:
        files = read(RUN_DIR, TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES)
        data = files.get(TRAJECTORY_NAME)
        return parse_trajectory(data) if data else []


def parse_trajectory(data: bytes) -> list[dict]:
    """The messages of mini's trajectory file (untrusted: whatever shape it has, never an error).
    Each message as mini kept it, less the raw response it copies into `extra`."""
    try:
        trajectory = json.loads(data)
    except (ValueError, RecursionError):
        return []
    messages = trajectory.get("messages") if isinstance(trajectory, dict) else None
    if not isinstance(messages, list):
        return []
    kept = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            continue
        message = dict(message)
        extra = message.get("extra")
        if isinstance(extra, dict) and "response" in extra:
            message["extra"] = {key: value for key, value in extra.items() if key != "response"}
        kept.append(message)
    return kept


def install_mini(
    version: str, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None
) -> MiniSweInstall:
    """mini-swe-agent==`version` in a venv of /usr/bin/python3, once per machine (cached_install)."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise RuntimeInstallError(f"mini-swe-agent's version {version!r} must be exact, like 2.4.6 (pinned)")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        raise RuntimeInstallError(f"mini-swe-agent needs {SYSTEM_PYTHON} (Debian: apt-get install python3-venv)")
    python_version = _python_version()
    # The versions of its dependencies (litellm & co.) this pin was measured with, so a later
    # release of one cannot change what runs (or start fetching at import); another mini-swe-agent
    # version resolves its own.
    constraints = CONSTRAINTS.read_text() if version == MiniSweAgent.default_version else ""
    digest = hashlib.sha256(constraints.encode()).hexdigest()[:8]
    key = f"mini-swe-agent-{version}-py{python_version}" + (f"-{digest}" if constraints else "")
    report = progress or progress_to_stderr

    def build(staging: Path, target: Path) -> dict:
        report(f"Installing mini-swe-agent=={version} into {target} (once per machine)...")
        venv = staging / "venv"
        _run([SYSTEM_PYTHON, "-m", "venv", str(venv)], "python3 -m venv", 300)
        python = str(venv / "bin/python")
        pinned: list[str] = []
        if constraints:
            (staging / "constraints.txt").write_text(constraints)
            pinned = ["-c", str(staging / "constraints.txt")]
        _run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--no-input",
                "--disable-pip-version-check",
                *pinned,
                f"mini-swe-agent=={version}",
            ],
            f"pip install mini-swe-agent=={version}",
            PIP_INSTALL_TIMEOUT_S,
        )
        _probe(python, version, staging)
        return asdict(
            MiniSweInstall(
                root=str(target),
                version=version,
                python_version=python_version,
                site_packages=f"venv/lib/python{python_version}/site-packages",
                size_bytes=tree_size(staging),
            )
        )

    return MiniSweInstall(**cached_install(key, build, cache_dir, report, what=f"mini-swe-agent=={version}"))


def _python_version() -> str:
    try:
        done = subprocess.run(
            [SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeInstallError(f"{SYSTEM_PYTHON} does not run: {error}") from None
    return done.stdout.strip()


def _run(command: list[str], what: str, timeout_s: int) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeInstallError(
            f"`{what}` did not finish in {timeout_s} s; is the package index reachable?"
        ) from None
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip().splitlines()
        head = "\n".join(line for line in output if not line.startswith("WARNING: Location"))[-3000:]
        raise RuntimeInstallError(f"`{what}` failed (exit {done.returncode}):\n{head}")


def _probe(python: str, version: str, scratch: Path) -> None:
    """The installed CLI imports offline (litellm included) and is the version asked for."""
    env = {
        **offline_env(),
        "MSWEA_GLOBAL_CONFIG_DIR": str(scratch / ".probe"),
        "PATH": SYSTEM_PATH,
        "HOME": str(scratch),
    }
    code = f"import minisweagent, litellm, {MINI_MODULE}; print(minisweagent.__version__)"
    try:
        done = subprocess.run(
            [python, "-I", "-c", code], capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeInstallError(f"the installed mini-swe-agent does not start: {error}") from None
    finally:
        shutil.rmtree(scratch / ".probe", ignore_errors=True)
    if done.returncode != 0 or done.stdout.strip().splitlines()[-1:] != [version]:
        raise RuntimeInstallError(
            f"the installed mini-swe-agent is not {version}:\n{(done.stdout + done.stderr)[-2000:]}"
        )


def _install(installed: Installed) -> MiniSweInstall:
    return cast(MiniSweInstall, installed)  # MiniSweAgent.install made it
