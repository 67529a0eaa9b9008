"""The agent layer's protocol: what every coding agent CLI pi-env runs implements.

An agent is installed once per machine at a pinned version (`install`: cached like Pi's runtime,
pi_env.agent.runtime.cached_install, never per rollout) and mounted read-only at `AGENT_ROOT` in
every sandbox. For one run it writes its configuration (`prepare`: the gateway as its only model
server, the gateway session's token as its key, telemetry, update checks and remote fetches off)
and is started on the instruction in the work dir with no network but the gateway (`start`). It
has ended when its process has. What it records of its own run (`transcript`) is untrusted
extra: the rollout's record is always the gateway's.

The gateway reaches the sandbox as a Unix socket; agents speak HTTP to a host:port. A Node agent
preloads `FORWARDER_PATH` (`node --import`), which listens on 127.0.0.1:`GATEWAY_PORT` in the
sandbox's own network namespace; any other agent is started by `LAUNCHER_PATH`, which runs the
same forwarder and then the agent as its child (`launched`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from ..config import AgentSettings, PiConfig
from ..endpoints import Endpoint
from ..sandbox import SANDBOX_WORKDIR, Sandbox, SandboxProcess
from .runtime import SANDBOX_RUNTIME_DIR, ensure_launcher_node

AGENT_ROOT = SANDBOX_RUNTIME_DIR  # where the agent's install appears inside every sandbox
FORWARDER_PATH = "/opt/pi-env/forward.mjs"
LAUNCHER_PATH = "/opt/pi-env/launch.mjs"
LAUNCHER_NODE_DIR = "/opt/pi-env/node"  # the Node that runs the launcher (runtime.ensure_launcher_node)
GATEWAY_PORT = 11434  # inside the sandbox's own network namespace, so never contended
LOG_DIR = "/root/logs/agent"  # the agent's own files of one run (home is /root)
PROMPT_PATH = f"{LOG_DIR}/prompt.md"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"

# Reads what the agent left under a sandbox path, within the rollout's read budget:
# (path, max_files, max_file_bytes) -> {relative path: bytes}.
ReadTree = Callable[[str, int, int], dict[str, bytes]]


class Installed(Protocol):
    """An agent's install on this machine (Pi's `PiRuntime`, or `AgentInstall`)."""

    @property
    def root(self) -> str: ...  # host path, mounted read-only at AGENT_ROOT

    @property
    def version(self) -> str: ...

    @property
    def archive_dir(self) -> str: ...  # where backends that upload the install keep its archive

    @property
    def install_s(self) -> float: ...


@dataclass(frozen=True)
class AgentRun:
    """What one start of an agent is given."""

    config: PiConfig
    endpoint: Endpoint  # the upstream model (the agent only ever reaches the gateway)
    token: str  # the gateway session's token: the agent's API key, never the upstream's
    instruction: str
    # The gateway's OpenAI base URL as the agent reaches it (the forwarder in the sandbox); a
    # bench's bare run points the agent straight at a server instead.
    base_url: str = f"http://127.0.0.1:{GATEWAY_PORT}/v1"

    @property
    def model(self) -> str:
        return self.endpoint.model


class Agent(ABC):
    """One coding agent CLI. Subclasses set the class attributes and implement `install`,
    `prepare` and `command`; the rest has defaults that fit most agents."""

    name: ClassVar[str]  # the registry's name (`--agent NAME`)
    package: ClassVar[str]  # what is installed (an npm or PyPI package)
    default_version: ClassVar[str]  # pinned: a rollout is reproducible
    # The oracle's last call for an agent that ends only when told so by a command's output
    # (mini-swe-agent's sentinel); None: a final text message ends the agent.
    submit_command: ClassVar[str | None] = None
    # The `PiConfig.agent.options` this agent takes: name -> what it does (its docs page too).
    options: ClassVar[dict[str, str]] = {}
    # Started by `launched` (a native binary, a Python CLI): its sandbox gets the launcher's Node.
    uses_launcher: ClassVar[bool] = False

    def __init__(self, config: PiConfig):
        self.config = config
        self.settings: AgentSettings = config.agent
        self._launcher_node: Path | None = None  # the launcher's Node on this machine, once installed
        unknown = sorted(set(self.settings.options) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise ValueError(f"agent {self.name!r} has no options {unknown}; its options: {known}")

    @property
    def version(self) -> str:
        return self.settings.version or self.default_version

    @abstractmethod
    def install(self, cache_dir: str | None, progress: Callable[[str], None] | None = None) -> Installed:
        """Install the agent once per machine (cached; safe when many processes call it at once)."""

    def mounts(self, installed: Installed) -> dict[str, str]:
        """Sandbox path -> host path, mounted read-only into every sandbox: the install, and the
        launcher's Node for an agent that `uses_launcher` (installed once per machine too)."""
        found = {AGENT_ROOT: installed.root}
        if self.uses_launcher:
            if self._launcher_node is None:  # once per agent: sandbox_spec asks on every rollout
                self._launcher_node = ensure_launcher_node(
                    self.config.agent.node_version, self.config.sandbox.runtime_cache_dir
                )
            found[LAUNCHER_NODE_DIR] = str(self._launcher_node)
        return found

    def masked_paths(self, installed: Installed) -> tuple[str, ...]:
        """Sandbox paths hidden from the agent while it runs (a task's own project settings that
        would change the agent's configuration)."""
        return ()

    @abstractmethod
    def prepare(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> None:
        """Write the run's files into the sandbox: configuration and the prompt."""

    @abstractmethod
    def command(self, installed: Installed, run: AgentRun) -> tuple[list[str], dict[str, str], str | None]:
        """The agent's argv, environment and stdin file (None: no stdin)."""

    def start(self, sandbox: Sandbox, installed: Installed, run: AgentRun) -> SandboxProcess:
        """Started on what `prepare` wrote, in the work dir, reaching only the gateway."""
        argv, env, stdin_path = self.command(installed, run)
        return sandbox.start(argv, cwd=SANDBOX_WORKDIR, env=env, network="gateway", stdin_path=stdin_path)

    def transcript(self, read: ReadTree) -> list[dict]:
        """The agent's own record of its run, as it left it (untrusted: the agent can rewrite it)."""
        return []

    def extra_call(self, request: dict) -> str | None:
        """Why a model call the agent made is not part of its task's conversation (OpenCode's
        title call), or None. A trainer can leave such calls out of the loss."""
        return None


def launched(argv: list[str]) -> list[str]:
    """`argv` started behind the gateway forwarder (an agent that cannot preload it), by the
    launcher's own Node (`Agent.uses_launcher`), whatever the sandbox's image has."""
    return [f"{LAUNCHER_NODE_DIR}/bin/node", LAUNCHER_PATH, *argv]


def gateway_env() -> dict[str, str]:
    """What the forwarder reads (the socket path is the backend's default)."""
    return {"PI_ENV_GATEWAY_PORT": str(GATEWAY_PORT)}
