"""OpenCode (npm `opencode-ai`), a Bun-built native binary speaking Chat Completions through its
built-in `@ai-sdk/openai-compatible` provider (docs/agents/opencode.md).

Installed once per machine (`cached_install`): not the `opencode-ai` stub, whose postinstall only
links the platform binary (and whose optional dependencies bring a `-baseline` twin of 177 MB),
but that platform package itself (`opencode-linux-x64` of the same version) beside
`@opencode-ai/plugin` of the same version. The npm prefix holding both is also OpenCode's config
dir: OpenCode installs `@opencode-ai/plugin` in the background into every config dir it may
write to, so the run's ~/.config/opencode is a link to that prefix in the read-only mount (a dir
it cannot write is skipped).

It is started behind the gateway forwarder (`launched`: a native binary cannot preload it) as
`opencode run --format json` with the prompt on stdin (no argv size limit). Its configuration is
one file of the run (OPENCODE_CONFIG): the gateway the only provider, the run's model as `model`
and `small_model`, every permission allowed; a task's opencode.json, .opencode/ and AGENTS.md are
never read (OPENCODE_DISABLE_PROJECT_CONFIG), nor are external plugins (OPENCODE_PURE), a model
catalogue (an empty OPENCODE_MODELS_PATH, OPENCODE_DISABLE_MODELS_FETCH) or stored credentials
(OPENCODE_AUTH_CONTENT).

Besides the task's conversation it makes one call per session with no tools, on `small_model`:
the session's title (`extra_call` -> "title")."""

from __future__ import annotations

import json
import platform
import re
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

from ..sandbox import Sandbox
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

PROVIDER = "pi-env"  # the one provider OpenCode knows: the gateway

# Sandbox paths of one run (home is /root).
HOME = "/root"
CONFIG_PATH = f"{LOG_DIR}/opencode.json"
USER_CONFIG_DIR = f"{HOME}/.config/opencode"  # a link to the install's config dir (read-only)
DB_DIR = f"{LOG_DIR}/opencode"  # its session database (SQLite, WAL): OPENCODE_DB
DB_NAME = "opencode.db"
TRANSCRIPT_BYTES = 64 << 20  # of the database and its WAL, each
TRANSCRIPT_ROWS = 20_000
SQLITE_STEPS = 50_000_000  # VM steps before a read of the database is abandoned (a hostile schema)

# In the install (relative to its root; AGENT_ROOT in the sandbox).
PREFIX = "opencode"  # npm prefix: the binary, @opencode-ai/plugin, and OpenCode's config dir
EMPTY_HOME = "home"  # OPENCODE_TEST_HOME: no ~/.opencode of the task's is read
MODELS = "models.json"  # an empty model catalogue: the gateway's model is the config's


def _arch() -> str:
    return {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), "x64"
    )


@dataclass(frozen=True)
class OpenCodeInstall:
    """OpenCode's binary and plugin package on this machine (cache/runtimes/<key>/)."""

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


def opencode_config(run: AgentRun) -> dict:
    """The run's whole configuration: the gateway the only provider, nothing asked, nothing shared."""
    config = run.config
    model = {
        "name": run.model,
        "tool_call": True,
        "reasoning": bool(config.agent.thinking and config.agent.thinking != "off"),
        "temperature": True,
        "attachment": False,
        "modalities": {"input": ["text"], "output": ["text"]},
        "limit": {"context": config.agent.context_window, "output": config.gateway.max_tokens},
        "cost": {"input": 0, "output": 0},
    }
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "pi-env gateway",
                "options": {"baseURL": run.base_url, "apiKey": run.token, "timeout": False},
                "models": {run.model: model},
            }
        },
        "enabled_providers": [PROVIDER],
        "model": f"{PROVIDER}/{run.model}",
        "small_model": f"{PROVIDER}/{run.model}",
        "autoupdate": False,
        "share": "disabled",
        "snapshot": False,  # no git snapshot of the work dir per step
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "allow", "external_directory": "allow"},
        "lsp": False,
        "formatter": False,
        "mcp": {},
        "plugin": [],
        "instructions": [],
    }


def opencode_env(run: AgentRun) -> dict[str, str]:
    return {
        **gateway_env(),
        "HOME": HOME,
        "PATH": SYSTEM_PATH,
        "OPENCODE_CONFIG": CONFIG_PATH,
        "OPENCODE_DB": f"{DB_DIR}/{DB_NAME}",
        "OPENCODE_DISABLE_PROJECT_CONFIG": "1",  # a task's opencode.json, .opencode/, AGENTS.md
        "OPENCODE_PURE": "1",  # no external plugins, wherever named
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_MODELS_PATH": f"{AGENT_ROOT}/{MODELS}",
        "OPENCODE_AUTH_CONTENT": "{}",  # no stored credentials (nor their remote configs)
        "OPENCODE_TEST_HOME": f"{AGENT_ROOT}/{EMPTY_HOME}",  # no ~/.opencode of the task's
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # no ~/.claude or CLAUDE.md
        "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
        "OPENCODE_DISABLE_AUTOCOMPACT": "1",  # compaction's extra calls are the harness's business
        "OPENCODE_DISABLE_EMBEDDED_WEB_UI": "1",
        "OPENCODE_DISABLE_TERMINAL_TITLE": "1",
        "NO_PROXY": "127.0.0.1,localhost",  # a proxy in the environment never takes the gateway's calls
        "NO_COLOR": "1",
        "CI": "1",
    }


class OpenCodeAgent(Agent):
    name = "opencode"
    package = "opencode-ai"
    default_version = "1.18.33"
    uses_launcher = True  # a native binary: the forwarder runs in front of it

    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> OpenCodeInstall:
        return install_opencode(self.version, cache_dir, progress)

    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        sandbox.write_file(CONFIG_PATH, json.dumps(opencode_config(run), indent=2))
        sandbox.write_file(PROMPT_PATH, run.instruction)
        # ~/.config/opencode: the install's config dir, whatever setup left there.
        sandbox.remove(USER_CONFIG_DIR)
        link = 'mkdir -p "$(dirname "$2")" "$3" && ln -s "$1" "$2"'
        argv = ["/bin/sh", "-c", link, "sh", f"{AGENT_ROOT}/{PREFIX}", USER_CONFIG_DIR, DB_DIR]
        done = sandbox.exec(argv, timeout_s=30)
        if done.exit_code != 0:
            raise OSError(f"could not link {USER_CONFIG_DIR}: {done.stderr.strip()[:500]}")

    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        binary = _install(installed).sandbox_binary
        argv = [binary, "run", "--format", "json", "--model", f"{PROVIDER}/{run.model}"]
        return launched(argv), opencode_env(run), PROMPT_PATH

    def transcript(self, read: ReadTree) -> list[dict]:
        files = read(DB_DIR, 4, TRANSCRIPT_BYTES)
        return read_sessions(files.get(DB_NAME), files.get(f"{DB_NAME}-wal"))

    def extra_call(self, request: dict) -> str | None:
        return "title" if not request.get("tools") else None


def read_sessions(db: bytes | None, wal: bytes | None) -> list[dict]:
    """OpenCode's own record from its database as the agent left it (untrusted: any bytes): one
    entry per message in order, `{"session": id, "info": message, "parts": [part, ...]}` as
    `opencode export` gives them; [] when it is not a database of OpenCode's. Read from a copy
    (with its WAL, which holds everything until OpenCode checkpoints), no schema code trusted, the
    work bounded."""
    if not db:
        return []
    with tempfile.TemporaryDirectory(prefix="pi-env-opencode-") as scratch:
        path = Path(scratch) / DB_NAME
        path.write_bytes(db)
        if wal:
            (Path(scratch) / f"{DB_NAME}-wal").write_bytes(wal)
        try:
            return _read_sessions(path)
        except (sqlite3.Error, ValueError, TypeError, OverflowError, RecursionError):
            return []


def _read_sessions(path: Path) -> list[dict]:
    steps = [0]

    def budget() -> int:
        steps[0] += 1
        return 1 if steps[0] * 1000 > SQLITE_STEPS else 0  # non-zero aborts the statement

    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.set_progress_handler(budget, 1000)
        for pragma in ("trusted_schema=OFF", "cell_size_check=ON", "mmap_size=0", "query_only=ON"):
            connection.execute(f"PRAGMA {pragma}")
        kinds = dict(connection.execute("SELECT name, type FROM sqlite_master WHERE name IN ('message', 'part')"))
        if kinds != {"message": "table", "part": "table"}:
            return []
        parts: dict[str, list] = {}
        query = "SELECT message_id, data FROM part ORDER BY message_id, id LIMIT ?"
        for message_id, data in connection.execute(query, (TRANSCRIPT_ROWS,)):
            parts.setdefault(str(message_id), []).append(_json(data))
        entries = []
        query = "SELECT id, session_id, data FROM message ORDER BY time_created, id LIMIT ?"
        for message_id, session_id, data in connection.execute(query, (TRANSCRIPT_ROWS,)):
            info = _json(data)
            entries.append({"session": str(session_id), "info": info, "parts": parts.get(str(message_id), [])})
        return entries
    finally:
        connection.close()


def _json(data: object) -> object:
    if not isinstance(data, str | bytes):
        return data
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return data if isinstance(data, str) else data.decode("utf-8", "replace")


def install_opencode(
    version: str, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None
) -> OpenCodeInstall:
    """OpenCode's platform binary and @opencode-ai/plugin at `version`, once per machine."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise RuntimeInstallError(f"OpenCode's version {version!r} must be exact, like 1.18.33 (pinned)")
    platform_package = f"opencode-linux-{_arch()}"
    key = f"opencode-{version}-linux-{_arch()}"
    report = progress or progress_to_stderr

    def build(staging: Path, target: Path) -> dict:
        npm = shutil.which("npm")
        if not npm:
            raise RuntimeInstallError(
                "npm is not installed; install Node.js and npm (Debian: apt-get install nodejs npm)"
            )
        report(f"Installing OpenCode {version} ({platform_package}) into {target} (once per machine)...")
        prefix = staging / PREFIX
        npm_install(npm, prefix, f"{platform_package}@{version}")
        npm_install(npm, prefix, f"@opencode-ai/plugin@{version}")
        # What OpenCode writes into a config dir that lacks it (a start-up error where read-only).
        (prefix / ".gitignore").write_text("node_modules\npackage.json\npackage-lock.json\nbun.lock\n.gitignore")
        (staging / EMPTY_HOME).mkdir()
        (staging / MODELS).write_text("{}")
        binary = f"{PREFIX}/node_modules/{platform_package}/bin/opencode"
        _probe(str(staging / binary), version, staging)
        for path in (staging, *staging.rglob("*")):
            if not path.is_symlink():  # sandboxes run as other uids
                path.chmod(path.stat().st_mode | (0o755 if path.is_dir() else 0o444))
        return asdict(OpenCodeInstall(root=str(target), version=version, binary=binary, size_bytes=tree_size(staging)))

    return OpenCodeInstall(**cached_install(key, build, cache_dir, report, what=f"OpenCode {version}"))


def _probe(binary: str, version: str, scratch: Path) -> None:
    home = scratch / ".probe-home"
    home.mkdir()
    try:
        done = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": SYSTEM_PATH, "HOME": str(home), "OPENCODE_DISABLE_MODELS_FETCH": "1"},
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeInstallError(f"the installed OpenCode does not start: {error}") from None
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if done.stdout.strip() != version:
        raise RuntimeInstallError(
            f"the installed OpenCode reports {done.stdout.strip()!r}, not {version}:\n{done.stderr[-2000:]}"
        )


def _install(installed: Installed) -> OpenCodeInstall:
    return cast(OpenCodeInstall, installed)  # OpenCodeAgent.install made it
