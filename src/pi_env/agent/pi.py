"""Hermetic Pi: the files the harness writes for one run, its command line, starting it in a
sandbox, and reading the outcome back from Pi's own session file (stopReason/errorMessage), not
from the exit code."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from ..config import DEFAULT_PI_PACKAGE, DEFAULT_PI_VERSION, PiConfig
from ..endpoints import Endpoint
from ..sandbox import SANDBOX_WORKDIR, Sandbox, SandboxProcess
from .base import FORWARDER_PATH, GATEWAY_PORT, LOG_DIR, PROMPT_PATH, Agent, AgentRun, Installed, ReadTree
from .compile_cache import build_compile_cache
from .runtime import PiRuntime, ensure_runtime

# Sandbox paths of one run (home is /root; the reference layout).
AGENT_DIR = "/root/.pi/agent"
SESSION_DIR = f"{LOG_DIR}/session"
FORWARDER_PORT = GATEWAY_PORT

# Retries and auto-compaction belong to the harness: with Pi's defaults one HTTP 500 became 12
# requests over 21 s, and compaction sends extra summary requests. Project trust "never" keeps a
# task's .pi/ files from changing Pi's settings.
HERMETIC_SETTINGS = {
    "retry": {"enabled": False, "maxRetries": 0, "provider": {"maxRetries": 0}},
    "compaction": {"enabled": False},
    "defaultProjectTrust": "never",
    "cacheWarming": "off",
    "quietStartup": True,
}


def models_json(config: PiConfig, endpoint: Endpoint, session_token: str, base_url: str = "") -> dict:
    """Pi's provider config. The key is the gateway's per-session token, never the real one;
    the base URL the forwarder's (a bench's bare run gives its server's)."""
    compat = dict(endpoint.compat)
    return {
        "providers": {
            config.agent.pi.provider_name: {
                "baseUrl": base_url or f"http://127.0.0.1:{FORWARDER_PORT}/v1",
                "api": "openai-completions",
                "apiKey": session_token,
                "compat": compat,
                "models": [
                    {
                        "id": endpoint.model,
                        "reasoning": bool(config.agent.thinking and config.agent.thinking != "off"),
                        "input": ["text"],
                        "contextWindow": config.agent.context_window,
                        "maxTokens": config.gateway.max_tokens,
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                    }
                ],
            }
        }
    }


def pi_env(runtime: PiRuntime) -> dict[str, str]:
    env = {
        "PI_CODING_AGENT_DIR": AGENT_DIR,
        "PI_OFFLINE": "1",
        "PI_TELEMETRY": "0",
        "PI_SKIP_VERSION_CHECK": "1",
        "PI_ENV_GATEWAY_PORT": str(FORWARDER_PORT),
        "NO_COLOR": "1",
        "PATH": f"{runtime.sandbox_node.rsplit('/', 1)[0]}:/usr/local/bin:/usr/bin:/bin",
    }
    # Pi's CLI turns Node's compile cache on (in $TMPDIR by default): a sandbox's /tmp is empty on
    # every rollout, so each started cold (about 0.25 s more than a warm run). The install's own
    # cache, built once at install time and read-only, keeps every rollout warm.
    if runtime.sandbox_compile_cache:
        env["NODE_COMPILE_CACHE"] = runtime.sandbox_compile_cache
    return env


def pi_command(runtime: PiRuntime, config: PiConfig, endpoint: Endpoint) -> list[str]:
    """Print mode with the prompt on stdin (a file: no argv size limit, EOF at its end)."""
    command = [
        runtime.sandbox_node,
        "--import",
        FORWARDER_PATH,
        runtime.sandbox_cli,
        "-p",
        "--model",
        f"{config.agent.pi.provider_name}/{endpoint.model}",
        "--session-dir",
        SESSION_DIR,
        "--tools",
        ",".join(config.agent.pi.tools) if config.agent.pi.tools else "",
        "-ne",
        "-nc",
        "-ns",
        "-np",
        "--no-themes",
    ]
    if not config.agent.pi.tools:
        command[command.index("--tools") : command.index("--tools") + 2] = ["--no-tools"]
    for flag in ("-na", "--no-mcp"):  # newer Pi only
        if runtime.supports(flag):
            command.append(flag)
    if config.agent.thinking:
        command += ["--thinking", config.agent.thinking]
    if config.agent.pi.system_prompt:
        command += ["--system-prompt", config.agent.pi.system_prompt]
    if config.agent.pi.append_system_prompt:
        command += ["--append-system-prompt", config.agent.pi.append_system_prompt]
    return command


def write_run_files(
    sandbox: Sandbox, config: PiConfig, endpoint: Endpoint, session_token: str, prompt: str, base_url: str = ""
) -> None:
    """One run's files in the sandbox: Pi's provider config and hermetic settings, the prompt."""
    models = models_json(config, endpoint, session_token, base_url)
    sandbox.write_file(f"{AGENT_DIR}/models.json", json.dumps(models))
    sandbox.write_file(f"{AGENT_DIR}/settings.json", json.dumps(HERMETIC_SETTINGS))
    sandbox.write_file(PROMPT_PATH, prompt)


def start_pi(sandbox: Sandbox, runtime: PiRuntime, config: PiConfig, endpoint: Endpoint) -> SandboxProcess:
    """Pi started on the files `write_run_files` wrote, in the work dir, reaching only the gateway."""
    return sandbox.start(
        pi_command(runtime, config, endpoint),
        cwd=SANDBOX_WORKDIR,
        env=pi_env(runtime),
        network="gateway",
        stdin_path=PROMPT_PATH,
    )


@dataclass
class PiOutcome:
    messages: list[dict] = field(default_factory=list)  # Pi's conversation, in Pi's own format
    stop_reason: str | None = None  # of the last assistant message: stop, toolUse, error, aborted, length
    error_message: str | None = None
    assistant_turns: int = 0

    @property
    def failed(self) -> bool:
        return self.stop_reason in ("error", "aborted") or self.stop_reason is None


def system_prompt_text(message: dict) -> str:
    """The system prompt as Pi sends it: its session file keeps it only as named `sections`
    (preamble, tools, rules, docs, cwd, ...), which Pi joins with blank lines."""
    sections = message.get("sections") or {}
    return "\n\n".join(str(text) for text in sections.values() if text)


def parse_session(jsonl: str) -> PiOutcome:
    """Read Pi's session file. Tolerates a torn last line (Pi killed mid-write)."""
    outcome = PiOutcome()
    for line in jsonl.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("type") != "message" or not isinstance(entry.get("message"), dict):
            continue
        message = entry["message"]
        if message.get("role") == "system" and not message.get("content"):
            message["content"] = system_prompt_text(message)  # what the model saw; `sections` kept
        outcome.messages.append(message)
        if message.get("role") == "assistant":
            outcome.assistant_turns += 1
            outcome.stop_reason = message.get("stopReason")
            outcome.error_message = message.get("errorMessage")
    return outcome


class PiAgent(Agent):
    """Pi, the default agent: its runtime (pi_env.agent.runtime), files and command above."""

    name = "pi"
    package = DEFAULT_PI_PACKAGE
    default_version = DEFAULT_PI_VERSION

    @property
    def version(self) -> str:
        return self.settings.version or self.config.agent.pi.version

    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> PiRuntime:
        config = self.config
        return ensure_runtime(
            config.agent.pi.package,
            self.version,
            config.agent.node_version,
            cache_dir,
            progress,
            warm=lambda runtime, staging: build_compile_cache(self, runtime, staging),
        )

    def masked_paths(self, installed: Installed) -> tuple[str, ...]:
        # Old Pi has no -na: hide the task's .pi/ so it cannot change Pi's settings.
        return () if _runtime(installed).supports("-na") else (f"{SANDBOX_WORKDIR}/.pi",)

    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        write_run_files(sandbox, run.config, run.endpoint, run.token, run.instruction, run.base_url)

    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        runtime = _runtime(installed)
        return pi_command(runtime, run.config, run.endpoint), pi_env(runtime), PROMPT_PATH

    def transcript(self, read: ReadTree) -> list[dict]:
        files = read(SESSION_DIR, 4, 256 << 20)
        text = "\n".join(
            data.decode("utf-8", "replace") for name, data in sorted(files.items()) if name.endswith(".jsonl")
        )
        return parse_session(text).messages


def _runtime(installed: Installed) -> PiRuntime:
    return cast(PiRuntime, installed)  # PiAgent.install made it
