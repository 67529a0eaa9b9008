"""Qwen Code (npm `@qwen-code/qwen-code`), a Node CLI speaking Chat Completions through the OpenAI
JS SDK: installed once with a Node >= 22 from npm (the system node is too old), started as
`node --expose-gc --import forward.mjs cli.js --yolo --output-format json` with the prompt on
stdin (no argv size limit), its settings in ~/.qwen/settings.json (docs/agents/qwen-code.md).

Its bin entry (cli-entry.js) is bypassed on purpose: it re-executes the CLI in a child Node (which
would not carry the forwarder) and may switch to a "managed update" under ~/.qwen/updates; cli.js
is the CLI itself, and --expose-gc is what the entry would have added.

Node's compile cache is built once at install time, by one real run at the sandbox's paths
(compile_cache.build_compile_cache), and read-only with the install in every sandbox: measured 2.67 ->
2.10 CPU s per run (median of 8, bare). Not a cache per sandbox (cold on every rollout, no gain),
nor one shared and writable (one rollout's agent would change what the next one loads)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import cast

from ..sandbox import SANDBOX_WORKDIR, Sandbox
from .base import FORWARDER_PATH, LOG_DIR, PROMPT_PATH, SYSTEM_PATH, Agent, AgentRun, Installed, ReadTree, gateway_env
from .compile_cache import build_compile_cache
from .runtime import PiRuntime, ensure_runtime

HOME = "/root"
QWEN_DIR = f"{HOME}/.qwen"
SETTINGS_PATH = f"{QWEN_DIR}/settings.json"
# Where it keeps its chat record: projects/<work dir as a name>/chats/<session id>.jsonl.
PROJECTS_DIR = f"{QWEN_DIR}/projects"
TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES = 8, 64 << 20
SYSTEM_PROMPT_PATH = f"{LOG_DIR}/system.md"  # the `system_prompt` option's file

# User-level settings (the task's own .qwen/ is masked). Usage statistics are on by default and go
# to a remote host; telemetry, update checks and the IDE bridge are off; the run's key and base URL
# come from the environment, which no settings or .env file can override (they only fill unset keys).
HERMETIC_SETTINGS: dict = {
    "$version": 4,
    "security": {"auth": {"selectedType": "openai"}, "folderTrust": {"enabled": False}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False, "logPrompts": False},
    # No systemd-inhibit child per model call and tool (it fails without D-Bus anyway).
    "general": {"enableAutoUpdate": False, "preventSystemSleep": False},
    "ide": {"enabled": False},
    "model": {"skipNextSpeakerCheck": True},
}


def qwen_env(runtime: PiRuntime, run: AgentRun) -> dict[str, str]:
    """Every value set (non-empty): a .env file in the work dir only fills keys that are unset."""
    env = {
        **gateway_env(),
        "HOME": HOME,
        "PATH": f"{runtime.sandbox_node.rsplit('/', 1)[0]}:{SYSTEM_PATH}",
        "OPENAI_BASE_URL": run.base_url,
        "OPENAI_API_KEY": run.token,
        "OPENAI_MODEL": run.model,
        "QWEN_CODE_MAX_OUTPUT_TOKENS": str(run.config.gateway.max_tokens),
        "QWEN_TELEMETRY_ENABLED": "false",
        "QWEN_USAGE_STATISTICS_ENABLED": "false",
        "QWEN_CODE_DISABLE_PRECONNECT": "1",
        # Else it re-executes itself in a child Node (a larger heap): a second start-up's CPU.
        "QWEN_CODE_NO_RELAUNCH": "true",
        # A proxy a .env names would take the gateway's calls too (measured: a 90 s hang).
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",  # the sandbox is pi-env's, not its own
        "NO_COLOR": "1",
        "CI": "1",
    }
    cache = getattr(runtime, "sandbox_compile_cache", None)  # an install that has one
    if cache:  # built at install time, read-only in the sandbox
        env["NODE_COMPILE_CACHE"] = cache
    return env


class QwenCodeAgent(Agent):
    name = "qwen-code"
    package = "@qwen-code/qwen-code"
    default_version = "0.24.4"
    options = {
        "exclude_tools": 'tools left out of its requests (--exclude-tools), e.g. ["agent", "skill"]',
        "system_prompt": "its system prompt, replacing its own (QWEN_SYSTEM_MD)",
    }

    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> PiRuntime:
        return ensure_runtime(
            self.package,
            self.version,
            self.config.agent.node_version,
            cache_dir,
            progress,
            bin_name="qwen",
            warm=lambda runtime, staging: build_compile_cache(self, runtime, staging),
        )

    def masked_paths(self, installed: Installed) -> tuple[str, ...]:
        # The task's project settings (.qwen/settings.json: env, hooks, MCP servers, model
        # providers), its .qwen/.env and its agents, commands and skills.
        return (f"{SANDBOX_WORKDIR}/.qwen",)

    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        sandbox.write_file(SETTINGS_PATH, json.dumps(HERMETIC_SETTINGS))
        sandbox.write_file(PROMPT_PATH, run.instruction)
        if (prompt := self.settings.options.get("system_prompt")) is not None:
            sandbox.write_file(SYSTEM_PROMPT_PATH, str(prompt))

    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        runtime = _runtime(installed)
        cli = runtime.sandbox_cli.rsplit("/", 1)[0] + "/cli.js"
        argv = [
            runtime.sandbox_node,
            "--expose-gc",
            "--import",
            FORWARDER_PATH,
            cli,
            "--yolo",
            # No context files, hooks, extensions, skills or MCP servers (Pi's -nc -ns -ne --no-mcp):
            # else a task's .mcp.json server is started before the first call and its .agents/skills
            # join the prompt. Chat recording and the settings above still apply.
            "--safe-mode",
            "--output-format",
            "json",
            "--auth-type",
            "openai",
            "--model",
            run.model,
        ]
        # Honoured in safe mode, unlike settings' tools.core (a smaller request, e.g. for a small
        # model's context).
        for tool in self.settings.options.get("exclude_tools") or ():
            argv += ["--exclude-tools", str(tool)]
        env = qwen_env(runtime, run)
        if self.settings.options.get("system_prompt") is not None:
            env["QWEN_SYSTEM_MD"] = SYSTEM_PROMPT_PATH
        return argv, env, PROMPT_PATH

    def transcript(self, read: ReadTree) -> list[dict]:
        files = read(PROJECTS_DIR, TRANSCRIPT_FILES, TRANSCRIPT_FILE_BYTES)
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


def _runtime(installed: Installed) -> PiRuntime:
    return cast(PiRuntime, installed)  # QwenCodeAgent.install made it
