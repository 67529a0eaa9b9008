"""Codex (npm `@openai/codex`), OpenAI's Rust CLI, which speaks only the Responses API
(`POST {base_url}/responses`, streamed): the gateway translates each call into its one Chat
Completions call (proxy/dialects/responses.py) (docs/agents/codex.md).

Installed once per machine (`cached_install`): not the `@openai/codex` launcher package, whose
optional dependencies are the six platform builds, but this platform's build alone (npm
`@openai/codex@<version>-linux-x64`, a static musl binary with `rg` beside it). It is started
behind the gateway forwarder (`launched`: a native binary cannot preload it) as
`codex exec --json --skip-git-repo-check --strict-config -` with the instruction on stdin (no argv
size limit).

Its whole configuration is one file of the run, `$CODEX_HOME/config.toml`, CODEX_HOME being a dir
of the run outside the work dir: the gateway the only model provider (`wire_api = "responses"`,
the session's token from an environment variable, no retries), approvals never asked, its own
sandbox off (pi-env's is the isolation), update checks, analytics, feedback, telemetry, history,
plugins, apps, skills, memories, web search, hooks, sub-agents and goals off. `--strict-config`
makes an unknown key a start-up error, so no offline setting is silently ignored. A task's
AGENTS.md is never read (`project_doc_max_bytes = 0`), its `.codex/` (project config, skills,
hooks) and `.agents/` (skills) are masked, and its project is never trusted (trust lives in our
config).

Codex's tools for a model that is not OpenAI's: `exec_command{cmd, workdir?, ...}` (a PTY),
`write_stdin{session_id, chars?}` and `request_user_input` (Plan mode only); file changes are an
`apply_patch` heredoc inside `exec_command`. It makes no call outside the task's conversation in
`exec` (auto-compaction is pushed out of reach: `extra_call` marks a call with no tools if one
ever comes)."""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

from ..sandbox import SANDBOX_WORKDIR, Sandbox
from .base import (
    AGENT_ROOT,
    LOG_DIR,
    PROMPT_PATH,
    SYSTEM_PATH,
    Agent,
    AgentRun,
    Installed,
    ReadTree,
    gateway_env,
    launched,
)
from .runtime import RuntimeInstallError, archive_dir_of, cached_install, npm_install, progress_to_stderr, tree_size

PROVIDER = "pi-env"  # the one model provider Codex knows: the gateway
TOKEN_ENV = "PI_ENV_GATEWAY_KEY"  # holds the session's token (Codex's env_key)

# Sandbox paths of one run (home is /root).
HOME = "/root"
CODEX_HOME = f"{LOG_DIR}/codex"  # config.toml, its session record, state databases: never the work dir
CONFIG_PATH = f"{CODEX_HOME}/config.toml"
SESSIONS_DIR = f"{CODEX_HOME}/sessions"  # sessions/YYYY/MM/DD/rollout-<time>-<thread>.jsonl
TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES = 8, 64 << 20
TRANSCRIPT_ENTRIES = 50_000
SYSTEM_PROMPT_PATH = f"{LOG_DIR}/instructions.md"  # the `system_prompt` option's file

PREFIX = "codex"  # npm prefix in the install (relative to its root; AGENT_ROOT in the sandbox)
# No compaction call: a context that overflows is the gateway's error, not a summary the agent asks for.
NO_AUTO_COMPACT = 1 << 60


def _arch() -> tuple[str, str]:
    """(npm's cpu name, the Rust target triple of Codex's build)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "arm64", "aarch64-unknown-linux-musl"
    return "x64", "x86_64-unknown-linux-musl"


@dataclass(frozen=True)
class CodexInstall:
    """Codex's platform build on this machine (cache/runtimes/<key>/)."""

    root: str  # host path, mounted read-only at AGENT_ROOT
    version: str
    binary: str  # relative to root
    path_dir: str  # relative to root: `rg`, which the npm launcher puts on PATH
    size_bytes: int = 0
    install_s: float = 0.0

    @property
    def archive_dir(self) -> str:
        return archive_dir_of(self.root)

    @property
    def host_binary(self) -> str:
        return str(Path(self.root) / self.binary)

    @property
    def sandbox_binary(self) -> str:
        return f"{AGENT_ROOT}/{self.binary}"

    @property
    def sandbox_path_dir(self) -> str:
        return f"{AGENT_ROOT}/{self.path_dir}"


def codex_config(run: AgentRun, system_prompt: bool = False) -> dict:
    """The run's whole configuration (written as TOML): the gateway the only provider, nothing
    asked, nothing fetched or sent anywhere else (`system_prompt`: its base instructions are the
    option's file)."""
    config = run.config
    thinking = config.agent.thinking if config.agent.thinking and config.agent.thinking != "off" else None
    settings: dict = {
        "model": run.model,
        "model_provider": PROVIDER,
        "approval_policy": "never",
        "sandbox_mode": "danger-full-access",  # pi-env's sandbox is the isolation
        "check_for_update_on_startup": False,
        "web_search": "disabled",  # a hosted tool: no open engine runs it
        "project_doc_max_bytes": 0,  # no AGENTS.md of the task's (nor of any dir above it)
        "project_doc_fallback_filenames": [],
        "model_context_window": config.agent.context_window,
        "model_auto_compact_token_limit": NO_AUTO_COMPACT,
        "model_reasoning_summary": "auto" if thinking else "none",
        "show_raw_agent_reasoning": True,  # reasoning_content is the model's own text
        "file_opener": "none",
        # Its commands run as `bash -c`, not `bash -lc`: a login shell's profile would reset PATH
        # (and read ~/.profile); the session's token stays out of their environment.
        "allow_login_shell": False,
        "shell_environment_policy": {"exclude": [TOKEN_ENV]},
        "cli_auth_credentials_store": "file",  # never the OS keyring
        "mcp_oauth_credentials_store": "file",
        "model_providers": {
            PROVIDER: {
                "name": "pi-env gateway",
                "base_url": run.base_url,
                "env_key": TOKEN_ENV,
                "wire_api": "responses",
                "request_max_retries": 0,  # a failed call is the gateway's to report, not to repeat
                "stream_max_retries": 0,
                "stream_idle_timeout_ms": 3_600_000,  # a slow engine is not a dropped stream
            }
        },
        "analytics": {"enabled": False},
        "feedback": {"enabled": False},
        "otel": {"exporter": "none", "log_user_prompt": False},
        "history": {"persistence": "none"},
        "skills": {"include_instructions": False, "bundled": {"enabled": False}},
        "agents": {"enabled": False},  # no sub-agent tools
        "features": {
            "plugins": False,  # else plugins are synced from remote hosts
            "remote_plugin": False,
            "apps": False,
            "goals": False,
            "view_image": False,
            "image_generation": False,
            "hooks": False,
            "skill_search": False,
            "skill_mcp_dependency_install": False,
            "tool_suggest": False,
            "computer_use": False,
            "browser_use": False,
            "memories": False,
            "shell_snapshot": False,
            "enable_request_compression": False,  # the gateway reads plain JSON
            # Else a refused connection is retried forever ("Reconnecting... waiting for network").
            "unbounded_connection_retries": False,
        },
    }
    if thinking:
        settings["model_reasoning_effort"] = thinking
    if system_prompt:
        settings = {"model_instructions_file": SYSTEM_PROMPT_PATH, **settings}
    return settings


def toml_text(value: dict, table: tuple[str, ...] = ()) -> str:
    """`value` as TOML: scalars and lists first, then each table (what codex_config holds)."""
    lines, tables = [], []
    for key, item in value.items():
        if isinstance(item, dict):
            tables.append((key, item))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(item)}")
    text = "\n".join(lines)
    if table and (lines or not tables):
        text = f"[{'.'.join(_toml_key(k) for k in table)}]\n{text}"
    parts = [text] if text else []
    parts += [toml_text(item, (*table, key)) for key, item in tables]
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__}")


def codex_env(installed: CodexInstall, run: AgentRun) -> dict[str, str]:
    return {
        **gateway_env(),
        "HOME": HOME,
        "PATH": f"{installed.sandbox_path_dir}:{SYSTEM_PATH}",
        "CODEX_HOME": CODEX_HOME,
        TOKEN_ENV: run.token,
        "NO_PROXY": "127.0.0.1,localhost",  # a proxy in the environment never takes the gateway's calls
        "no_proxy": "127.0.0.1,localhost",
        "NO_COLOR": "1",
    }


class CodexAgent(Agent):
    name = "codex"
    package = "@openai/codex"
    default_version = "0.171.0"
    uses_launcher = True  # a native binary: the forwarder runs in front of it
    options = {
        "system_prompt": "its base instructions, replacing its own 17 KB (model_instructions_file), "
        "e.g. for a small model's context",
    }

    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> CodexInstall:
        return install_codex(self.version, cache_dir, progress)

    def masked_paths(self, installed: Installed) -> tuple[str, ...]:
        # The task's project config (.codex/config.toml: providers, instructions, MCP servers),
        # its hooks and skills (.codex/skills, .agents/skills).
        return (f"{SANDBOX_WORKDIR}/.codex", f"{SANDBOX_WORKDIR}/.agents")

    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        prompt = self.settings.options.get("system_prompt")
        sandbox.write_file(CONFIG_PATH, toml_text(codex_config(run, system_prompt=prompt is not None)))
        sandbox.write_file(PROMPT_PATH, run.instruction)
        if prompt is not None:
            sandbox.write_file(SYSTEM_PROMPT_PATH, str(prompt))

    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        codex = _install(installed)
        argv = [codex.sandbox_binary, "exec", "--json", "--skip-git-repo-check", "--strict-config", "-"]
        return launched(argv), codex_env(codex, run), PROMPT_PATH

    def transcript(self, read: ReadTree) -> list[dict]:
        return read_rollouts(read(SESSIONS_DIR, TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES))

    def extra_call(self, request: dict) -> str | None:
        return "no tools" if not request.get("tools") else None


def read_rollouts(files: dict[str, bytes]) -> list[dict]:
    """Codex's own record of its run (untrusted: any bytes): the JSON objects of its rollout files
    (`{"timestamp", "type", "payload"}` lines), in file-name order (a name starts with its time),
    at most TRANSCRIPT_ENTRIES of them; a line that is not a JSON object is skipped."""
    entries: list[dict] = []
    for name, data in sorted(files.items()):
        if not name.endswith(".jsonl"):
            continue
        for line in data.decode("utf-8", "replace").splitlines():
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                continue  # a torn last line (killed mid-write)
            if isinstance(entry, dict):
                entries.append(entry)
                if len(entries) >= TRANSCRIPT_ENTRIES:
                    return entries
    return entries


def install_codex(
    version: str, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None
) -> CodexInstall:
    """Codex's build for this platform at `version`, once per machine."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise RuntimeInstallError(f"Codex's version {version!r} must be exact, like 0.171.0 (pinned)")
    cpu, triple = _arch()
    spec = f"@openai/codex@{version}-linux-{cpu}"
    key = f"codex-{version}-linux-{cpu}"
    report = progress or progress_to_stderr

    def build(staging: Path, target: Path) -> dict:
        npm = shutil.which("npm")
        if not npm:
            raise RuntimeInstallError(
                "npm is not installed; install Node.js and npm (Debian: apt-get install nodejs npm)"
            )
        report(f"Installing Codex {version} ({spec}) into {target} (once per machine)...")
        npm_install(npm, staging / PREFIX, spec)
        vendor = f"{PREFIX}/node_modules/@openai/codex/vendor/{triple}"
        binary = f"{vendor}/bin/codex"
        _probe(str(staging / binary), version, staging)
        for path in (staging, *staging.rglob("*")):
            if not path.is_symlink():  # sandboxes run as other uids
                path.chmod(path.stat().st_mode | (0o755 if path.is_dir() else 0o444))
        return asdict(
            CodexInstall(
                root=str(target),
                version=version,
                binary=binary,
                path_dir=f"{vendor}/codex-path",
                size_bytes=tree_size(staging),
            )
        )

    return CodexInstall(**cached_install(key, build, cache_dir, report, what=f"Codex {version}"))


def _probe(binary: str, version: str, scratch: Path) -> None:
    home = scratch / ".probe-home"
    home.mkdir()
    try:
        done = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": SYSTEM_PATH, "HOME": str(home), "CODEX_HOME": str(home)},
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeInstallError(f"the installed Codex does not start: {error}") from None
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if done.stdout.strip() != f"codex-cli {version}":
        raise RuntimeInstallError(
            f"the installed Codex reports {done.stdout.strip()!r}, not {version}:\n{done.stderr[-2000:]}"
        )


def _install(installed: Installed) -> CodexInstall:
    return cast(CodexInstall, installed)  # CodexAgent.install made it
