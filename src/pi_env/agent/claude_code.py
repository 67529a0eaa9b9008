"""Claude Code (npm `@anthropic-ai/claude-code`), a native binary speaking Anthropic Messages
(`POST /v1/messages?beta=true`), which the gateway translates into its one Chat Completions call
(proxy/dialects/messages.py; docs/agents/claude-code.md).

Installed once per machine (`cached_install`): not the `@anthropic-ai/claude-code` stub, whose
postinstall only links the platform binary, but that platform package itself
(`@anthropic-ai/claude-code-linux-x64` of the same version: one 400 MB binary, no dependencies).

It is started behind the gateway forwarder (`launched`: a native binary cannot preload it) as
`claude -p --output-format json` with the prompt on stdin (no argv size limit), as root (the
sandbox's), so with `--permission-mode acceptEdits` and its tools allowed by name rather than
`--dangerously-skip-permissions`, which root is refused. Its home and config dir are the run's
own (CLAUDE_CONFIG_DIR under LOG_DIR: settings, its session record, shell snapshots).

A task cannot steer it: only the user settings pi-env writes are read (`--setting-sources user`:
no project `.claude/settings*.json`, whose hooks, apiKeyHelper and env would run commands and
redirect its calls, nor the CLAUDE.md files), every hook is off (`disableAllHooks`), no MCP
server but an empty list (`--strict-mcp-config --mcp-config`: a task's `.mcp.json` is never
started), no skills or commands (`--disable-slash-commands`), and the task's `.claude/` dir is
masked besides. Measured: with none of these, a hostile `.claude/settings.json` ran its hooks and
its apiKeyHelper, started the `.mcp.json` server and sent every call to its own base URL.

With DISABLE_NON_ESSENTIAL_MODEL_CALLS and CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC it makes no
call but the task's (measured: no count_tokens, no probe, no side call on the small model); a
call without tools would be one (`extra_call`)."""

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
from ..task import MAX_TIMEOUT_S
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

# Sandbox paths of one run (home is /root).
HOME = "/root"
CONFIG_DIR = f"{LOG_DIR}/claude"  # CLAUDE_CONFIG_DIR: settings, .claude.json, projects/<cwd>/<session>.jsonl
SETTINGS_PATH = f"{CONFIG_DIR}/settings.json"
SYSTEM_PROMPT_PATH = f"{LOG_DIR}/system.md"  # the `system_prompt` option's file
PROJECTS_DIR = f"{CONFIG_DIR}/projects"
TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES = 8, 64 << 20

# In the install (relative to its root; AGENT_ROOT in the sandbox).
PREFIX = "claude-code"  # npm prefix holding the platform package

# The tools it may use without asking (-p: anything that would ask is refused).
ALLOWED_TOOLS = "Write,Edit,Read,Bash"
EMPTY_MCP = json.dumps({"mcpServers": {}})

# The only settings it reads (user settings; the task's project and local settings are not).
SETTINGS: dict = {
    "permissions": {"defaultMode": "acceptEdits", "allow": ALLOWED_TOOLS.split(",")},
    "disableAllHooks": True,
    "enableAllProjectMcpServers": False,
    "autoUpdates": False,
    "includeCoAuthoredBy": False,
    "cleanupPeriodDays": 1,
}


def _arch() -> str:
    return {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), "x64"
    )


@dataclass(frozen=True)
class ClaudeCodeInstall:
    """Claude Code's platform binary on this machine (cache/runtimes/<key>/)."""

    root: str  # host path, mounted read-only at AGENT_ROOT
    version: str
    binary: str  # relative to root
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


def anthropic_base_url(base_url: str) -> str:
    """The gateway's OpenAI base URL (…/v1) as Anthropic's SDK takes it: it appends /v1/messages."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def claude_env(run: AgentRun) -> dict[str, str]:
    model = run.model
    env = {
        **gateway_env(),
        "HOME": HOME,
        "PATH": SYSTEM_PATH,
        "SHELL": "/bin/bash",
        "CLAUDE_CONFIG_DIR": CONFIG_DIR,
        "ANTHROPIC_BASE_URL": anthropic_base_url(run.base_url),
        "ANTHROPIC_API_KEY": run.token,  # sent as x-api-key, which the gateway takes as the token
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(run.config.gateway.max_tokens),
        # One attempt per call: the gateway's answer is final (measured: a 500 was otherwise
        # retried with back-off, 7 calls in 60 s), and no client timeout but the sandbox's (a
        # call the gate holds for a trainer, a slow engine); its default is 600 s.
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "API_TIMEOUT_MS": str(int(MAX_TIMEOUT_S * 1000)),
        # No call but the model's: else ~10 calls to the vendor and a HEAD probe (measured).
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
        # Else the system prompt opens with an "x-anthropic-billing-header: cc_version=…" line
        # that varies with the prompt: text for the vendor's servers, not for the model.
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "DISABLE_BUG_COMMAND": "1",
        "DISABLE_COST_WARNINGS": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
        "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1",
        "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
        "NO_PROXY": "127.0.0.1,localhost",  # a proxy in the environment never takes the gateway's calls
        "no_proxy": "127.0.0.1,localhost",
        "NO_COLOR": "1",
        "CI": "1",
    }
    if run.config.agent.thinking == "off":
        env["MAX_THINKING_TOKENS"] = "0"
    return env


class ClaudeCodeAgent(Agent):
    name = "claude-code"
    package = "@anthropic-ai/claude-code"
    default_version = "2.1.332"
    uses_launcher = True  # a native binary: the forwarder runs in front of it
    options = {
        "tools": 'the built-in tools it offers (--tools), e.g. ["Bash", "Edit", "Read", "Write"]: a 15 KB '
        "first request instead of 56 KB (its Workflow tool alone is 23 KB); default: all of them",
        "system_prompt": "its system prompt, replacing its own 4.6 KB one (--system-prompt-file); its "
        "environment still comes as a system message after the instruction",
    }

    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> ClaudeCodeInstall:
        return install_claude_code(self.version, cache_dir, progress)

    def masked_paths(self, installed: Installed) -> tuple[str, ...]:
        # The task's project settings (hooks, apiKeyHelper, env, permissions), agents, commands
        # and skills: never read (--setting-sources user, --disable-slash-commands), hidden too.
        return (f"{SANDBOX_WORKDIR}/.claude",)

    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        sandbox.write_file(SETTINGS_PATH, json.dumps(SETTINGS, indent=2))
        sandbox.write_file(PROMPT_PATH, run.instruction)
        if (prompt := self.settings.options.get("system_prompt")) is not None:
            sandbox.write_file(SYSTEM_PROMPT_PATH, str(prompt))

    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        binary = _install(installed).sandbox_binary
        argv = [
            binary,
            "-p",
            "--output-format",
            "json",
            "--model",
            run.model,
            "--permission-mode",
            "acceptEdits",
            "--allowedTools",
            ALLOWED_TOOLS,
            "--setting-sources",
            "user",
            "--strict-mcp-config",
            "--mcp-config",
            EMPTY_MCP,
            "--disable-slash-commands",
        ]
        tools = self.settings.options.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, str) and t for t in tools):
                raise ValueError('agent option "tools" must be a list of tool names, like ["Bash", "Write"]')
            argv += ["--tools", ",".join(tools)]
        if self.settings.options.get("system_prompt") is not None:
            argv += ["--system-prompt-file", SYSTEM_PROMPT_PATH]
        return launched(argv), claude_env(run), PROMPT_PATH

    def transcript(self, read: ReadTree) -> list[dict]:
        files = read(PROJECTS_DIR, TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES)
        entries: list[dict] = []
        for name, data in sorted(files.items()):
            if not name.endswith(".jsonl"):
                continue
            for line in data.decode("utf-8", "replace").splitlines():
                try:
                    entry = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    continue  # a torn last line (killed mid-write), or not its record at all
                if isinstance(entry, dict):
                    entries.append(entry)
        return entries

    def extra_call(self, request: dict) -> str | None:
        # Every call of its task's conversation offers its tools; a side call (a title, a topic
        # check on the small model: off here, but a later version may make one) offers none.
        return "side call" if not request.get("tools") else None


def install_claude_code(
    version: str, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None
) -> ClaudeCodeInstall:
    """Claude Code's platform binary at `version`, once per machine."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise RuntimeInstallError(f"Claude Code's version {version!r} must be exact, like 2.1.332 (pinned)")
    platform_package = f"@anthropic-ai/claude-code-linux-{_arch()}"
    key = f"claude-code-{version}-linux-{_arch()}"
    report = progress or progress_to_stderr

    def build(staging: Path, target: Path) -> dict:
        npm = shutil.which("npm")
        if not npm:
            raise RuntimeInstallError(
                "npm is not installed; install Node.js and npm (Debian: apt-get install nodejs npm)"
            )
        report(f"Installing Claude Code {version} ({platform_package}) into {target} (once per machine)...")
        prefix = staging / PREFIX
        npm_install(npm, prefix, f"{platform_package}@{version}")
        binary = f"{PREFIX}/node_modules/{platform_package}/claude"
        _probe(str(staging / binary), version, staging)
        for path in (staging, *staging.rglob("*")):
            if not path.is_symlink():  # sandboxes run as other uids
                path.chmod(path.stat().st_mode | (0o755 if path.is_dir() else 0o444))
        return asdict(
            ClaudeCodeInstall(root=str(target), version=version, binary=binary, size_bytes=tree_size(staging))
        )

    return ClaudeCodeInstall(**cached_install(key, build, cache_dir, report, what=f"Claude Code {version}"))


def _probe(binary: str, version: str, scratch: Path) -> None:
    home = scratch / ".probe-home"
    home.mkdir()
    try:
        done = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": SYSTEM_PATH, "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home), "DISABLE_AUTOUPDATER": "1"},
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeInstallError(f"the installed Claude Code does not start: {error}") from None
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if done.stdout.split()[:1] != [version]:  # "2.1.332 (Claude Code)"
        raise RuntimeInstallError(
            f"the installed Claude Code reports {done.stdout.strip()!r}, not {version}:\n{done.stderr[-2000:]}"
        )


def _install(installed: Installed) -> ClaudeCodeInstall:
    return cast(ClaudeCodeInstall, installed)  # ClaudeCodeAgent.install made it
