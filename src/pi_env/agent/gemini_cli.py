"""Gemini CLI (npm `@google/gemini-cli`), a Node CLI speaking only Gemini's generateContent
(`POST {base}/v1beta/models/<model>:streamGenerateContent?alt=sse`, key in `x-goog-api-key`),
which the gateway's `gemini` dialect turns into the one Chat Completions call every mode handles
(docs/agents/gemini-cli.md).

Installed once per machine (`ensure_runtime`: one bundled package, about 100 MB). It runs on the
launcher's Node (npm's node-linux-<arch>, `uses_launcher`: mounted in every sandbox whatever its
image has, and a Node with a compile cache) with the forwarder preloaded:
`node --import forward.mjs bundle/gemini.js --yolo --output-format json -m <model> -p ""`, the
prompt on stdin (`-p` is appended to stdin: no argv size limit). GEMINI_CLI_NO_RELAUNCH keeps it
from re-executing itself in a child Node (a second start-up).

Its settings are the run's ~/.gemini/settings.json (HERMETIC_SETTINGS: the API-key auth, usage
statistics, telemetry, update checks, IDE, hooks and skills off, local .env files ignored) and
its environment (GOOGLE_GEMINI_BASE_URL, GEMINI_API_KEY = the session token). Headless it runs
only in a trusted workspace (GEMINI_CLI_TRUST_WORKSPACE), so a task's .gemini/ (settings: MCP
servers, tool discovery and call commands, hooks, env; .env, commands, agents, skills, policies,
extensions) is masked; a task's GEMINI.md files are read as project context into its first
message (0.61.0 has no switch for that in a trusted workspace): task text, like any file it
reads, that changes no setting.

Besides the task's conversation it may make calls with a JSON response schema and no tools: a
loop check after 30 turns, a next-speaker check (off by default), a history summary near the
context limit (`extra_call`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast

from ..endpoints import Endpoint
from ..sandbox import SANDBOX_WORKDIR, Sandbox
from .base import (
    FORWARDER_PATH,
    LAUNCHER_NODE_DIR,
    LOG_DIR,
    PROMPT_PATH,
    SYSTEM_PATH,
    Agent,
    AgentRun,
    Installed,
    ReadTree,
    gateway_env,
)
from .runtime import (
    COMPILE_CACHE_RELPATH,
    SANDBOX_RUNTIME_DIR,
    WARM_UP_TIMEOUT_S,
    PiRuntime,
    RuntimeInstallError,
    ensure_launcher_node,
    ensure_runtime,
)

HOME = "/root"
GEMINI_DIR = f"{HOME}/.gemini"
SETTINGS_PATH = f"{GEMINI_DIR}/settings.json"
# Where it keeps its chat record: tmp/<project name>/chats/session-<time>-<id>.jsonl.
CHATS_DIR = f"{GEMINI_DIR}/tmp"
TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES = 8, 64 << 20
SYSTEM_PROMPT_PATH = f"{LOG_DIR}/system.md"  # the `system_prompt` option's file (GEMINI_SYSTEM_MD)
NODE = f"{LAUNCHER_NODE_DIR}/bin/node"

# User-level settings (the task's own .gemini/ is masked). Without the auth type it stops with
# "Invalid auth method" in -p mode; usage statistics are on by default and go to a remote host;
# telemetry, update checks, the IDE bridge, hooks and skills (which a workspace's .agents/skills
# would add) are off; a .env in the work dir (or above it, up to the home) is not read: the run's
# environment only, which a .env could not override anyway (it only fills unset keys). One
# attempt per call: the gateway's answer is final (a budget's 429 is not retried 10 times).
HERMETIC_SETTINGS: dict = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False, "logPrompts": False},
    "general": {
        "enableAutoUpdate": False,
        "enableAutoUpdateNotification": False,
        "checkpointing": {"enabled": False},
        "maxAttempts": 1,
    },
    "ide": {"enabled": False},
    "model": {"skipNextSpeakerCheck": True},
    "advanced": {"ignoreLocalEnv": True, "autoConfigureMemory": False},
    "skills": {"enabled": False},
    "hooksConfig": {"enabled": False},
}


def gemini_settings(run: AgentRun, exclude_tools: list[str]) -> dict:
    """HERMETIC_SETTINGS for one run: every call's maxOutputTokens is the run's max_tokens (an
    override on the `base` alias, which every model the CLI resolves extends)."""
    settings = json.loads(json.dumps(HERMETIC_SETTINGS))
    limit = {"generateContentConfig": {"maxOutputTokens": run.config.gateway.max_tokens}}
    settings["modelConfigs"] = {"customOverrides": [{"match": {"model": "base"}, "modelConfig": limit}]}
    if exclude_tools:
        settings["tools"] = {"exclude": exclude_tools}
    return settings


def base_url(run: AgentRun) -> str:
    """The gateway's root: the Gemini SDK appends /v1beta/models/... itself."""
    url = run.base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def gemini_env(runtime: PiRuntime, run: AgentRun) -> dict[str, str]:
    env = {
        **gateway_env(),
        "HOME": HOME,
        "PATH": f"{LAUNCHER_NODE_DIR}/bin:{SYSTEM_PATH}",
        "GOOGLE_GEMINI_BASE_URL": base_url(run),
        "GEMINI_API_KEY": run.token,
        "GEMINI_MODEL": run.model,
        # Headless it refuses an untrusted workspace (and an untrusted one drops --yolo).
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
        "GEMINI_CLI_NO_RELAUNCH": "true",  # else a child Node (a larger heap): a second start-up
        # A proxy in the environment would take the gateway's calls too.
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "NO_COLOR": "1",
    }
    cache = getattr(runtime, "sandbox_compile_cache", None)  # an install that has one
    if cache:
        env["NODE_COMPILE_CACHE"] = cache
    return env


class GeminiCliAgent(Agent):
    name = "gemini-cli"
    package = "@google/gemini-cli"
    default_version = "0.61.0"
    uses_launcher = True  # its Node: the launcher's, in every sandbox (the forwarder preloaded)
    options = {
        "exclude_tools": 'tools left out of its requests (settings tools.exclude), e.g. ["google_web_search"]',
        "system_prompt": "its system prompt, replacing its own (GEMINI_SYSTEM_MD)",
    }

    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> PiRuntime:
        return ensure_runtime(
            self.package,
            self.version,
            self.config.agent.node_version,
            cache_dir,
            progress,
            bin_name="gemini",
            warm=lambda runtime, staging: build_gemini_compile_cache(self, runtime, staging, cache_dir),
        )

    def masked_paths(self, installed: Installed) -> tuple[str, ...]:
        # The task's project settings (.gemini/settings.json: MCP servers, tools.discoveryCommand
        # and callCommand, hooks, model configs), its .gemini/.env, commands, agents, skills,
        # policies and extensions.
        return (f"{SANDBOX_WORKDIR}/.gemini",)

    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        exclude = [str(tool) for tool in self.settings.options.get("exclude_tools") or ()]
        sandbox.write_file(SETTINGS_PATH, json.dumps(gemini_settings(run, exclude)))
        sandbox.write_file(PROMPT_PATH, run.instruction)
        if (prompt := self.settings.options.get("system_prompt")) is not None:
            sandbox.write_file(SYSTEM_PROMPT_PATH, str(prompt))

    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        runtime = _runtime(installed)
        argv = [NODE, "--import", FORWARDER_PATH, runtime.sandbox_cli, "--yolo", "--output-format", "json"]
        argv += ["-m", run.model, "-p", ""]  # the prompt: stdin, to which -p's text is appended
        env = gemini_env(runtime, run)
        if self.settings.options.get("system_prompt") is not None:
            env["GEMINI_SYSTEM_MD"] = SYSTEM_PROMPT_PATH
        return argv, env, PROMPT_PATH

    def transcript(self, read: ReadTree) -> list[dict]:
        files = read(CHATS_DIR, TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES)
        entries: list[dict] = []
        for name, data in sorted(files.items()):
            if not name.endswith(".jsonl"):
                continue
            for line in data.decode("utf-8", "replace").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line (killed mid-write)
                if isinstance(entry, dict):
                    entries.append(entry)
        return entries

    def extra_call(self, request: dict) -> str | None:
        """Its side calls have no tools: a loop check or next-speaker check (a JSON response
        schema), a history summary."""
        if request.get("tools"):
            return None
        schema = json.dumps((request.get("response_format") or {}).get("json_schema") or {})
        if "unproductive_state" in schema:
            return "loop check"
        if "next_speaker" in schema:
            return "next-speaker check"
        return "side call"


def build_gemini_compile_cache(agent: GeminiCliAgent, runtime: PiRuntime, staging: Path, cache_dir: str | None) -> bool:
    """Fill staging/compile-cache with Node's compile cache of one real run (as
    compile_cache.build_compile_cache does for a Chat Completions agent, whose warm-up server this
    agent cannot speak to): the launcher's Node, the CLI at the sandbox's paths in a mount
    namespace, as uid 0, writing hello.txt through its write_file tool against `_WarmUpModel`.
    Read-only with the install in every sandbox."""
    from ..sandbox import SANDBOX_HOME
    from ..task import PiTask
    from .compile_cache import _HostHome

    bwrap = shutil.which("bwrap")
    if not bwrap:
        raise RuntimeInstallError("bwrap is not installed")
    node = ensure_launcher_node(agent.config.agent.node_version, cache_dir) / "bin" / "node"  # a host path
    task = PiTask(task_id="compile-cache-warm-up", instruction="Create hello.txt containing hello.", verify=[])
    home = Path(tempfile.mkdtemp(prefix="warm-up-home-"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WarmUpModel)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = Endpoint(name="warm-up", base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", model="warm-up")
        run = AgentRun(agent.config, endpoint, "warm-up", task.instruction, base_url=endpoint.base_url)
        host = _HostHome(home, SANDBOX_HOME)
        Path(host.path(SANDBOX_WORKDIR)).mkdir(parents=True)
        agent.prepare(host, runtime, run)  # type: ignore[arg-type]
        argv, env, stdin_path = agent.command(runtime, run)
        at = argv.index("--import")  # the server is reached directly
        argv = [str(node), *argv[1:at], *argv[at + 2 :]]
        cache = staging / COMPILE_CACHE_RELPATH
        cache.mkdir()
        namespace = [bwrap, "--unshare-all", "--share-net", "--die-with-parent"]
        if os.geteuid() != 0:
            namespace += ["--unshare-user", "--uid", "0", "--gid", "0"]
        namespace += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        namespace += ["--tmpfs", "/opt", "--ro-bind", str(staging), SANDBOX_RUNTIME_DIR]
        namespace += ["--bind", str(cache), f"{SANDBOX_RUNTIME_DIR}/{COMPILE_CACHE_RELPATH}"]
        namespace += ["--bind", str(home), SANDBOX_HOME, "--chdir", SANDBOX_WORKDIR, "--"]
        env = {"TMPDIR": "/tmp", "LANG": "C.UTF-8", **env}
        env["NODE_COMPILE_CACHE"] = f"{SANDBOX_RUNTIME_DIR}/{COMPILE_CACHE_RELPATH}"
        with open(host.path(stdin_path) if stdin_path else os.devnull) as stdin:
            done = subprocess.run(
                namespace + argv, stdin=stdin, capture_output=True, env=env, timeout=WARM_UP_TIMEOUT_S
            )
        if not Path(host.path(f"{SANDBOX_WORKDIR}/hello.txt")).exists():
            tail = (done.stdout + done.stderr).decode("utf-8", "replace")[-600:]
            raise RuntimeInstallError(f"the warm-up run did not write its file (exit {done.returncode}): {tail}")
        return True
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(home, ignore_errors=True)


class _WarmUpModel(BaseHTTPRequestHandler):
    """The warm-up run's model, in Gemini's own shape: a write_file call, then "done"."""

    def do_POST(self) -> None:  # http.server's name for it
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        answered = b'"functionResponse"' in body
        part = {"text": "done"} if answered else {
            "functionCall": {"name": "write_file", "args": {"file_path": "hello.txt", "content": "hello\n"}}
        }  # fmt: skip
        event = {"candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}]}
        data = b"data: " + json.dumps(event).encode() + b"\r\n\r\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def _runtime(installed: Installed) -> PiRuntime:
    return cast(PiRuntime, installed)  # GeminiCliAgent.install made it
