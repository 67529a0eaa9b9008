"""What every session of one `PiSessionFactory` shares: `FactoryState`, its base.

A factory's sessions run under one config (the `mode=` and `sampling=` given to the factory
applied to it, and checked, once), create their sandboxes with one backend, run one Pi runtime
(installed on the first session's start, then shared; the install itself is once per machine:
pi_env.agent.runtime) and stamp their model calls with one policy version, which a trainer moves
forward while sessions run (`set_policy_version`, docs/async-rl.md). None of this is a session's
lifecycle: `PiSessionFactory` (pi_env.rollout.factory) adds making the sessions (`create`,
`reverify`), and a rollout's context reads its factory as a `FactoryState`, so this module
imports nothing else of the rollout package.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from ..agent import get_agent
from ..agent.base import Installed
from ..config import AgentSettings, Mode, PiConfig
from ..proxy.records import PolicyVersion
from ..sandbox import SandboxBackend, get_backend
from ..specs import with_forced_sampling


class FactoryState:
    """The config, the sandbox backend, the Pi runtime and the policy version of a factory's sessions."""

    def __init__(
        self,
        config: PiConfig | None = None,
        sandbox_backend: str | SandboxBackend | None = None,
        mode: Mode | None = None,
        *,
        sampling: Mapping[str, float | int] | None = None,
        agent: str | None = None,
    ):
        config = config or PiConfig()
        if agent is not None:  # one argument switches the agent (validated like PiConfig.agent)
            config = config.model_copy()
            # The agent-wide settings (thinking, context window, node, Pi's own) stay.
            config.agent = AgentSettings(**{**config.agent.model_dump(), "name": agent, "version": None, "options": {}})
        if mode is not None:
            config = config.in_mode(mode)  # the settings both modes have carry over
        if sampling:
            config = with_forced_sampling(config, sampling, explicit_mode=mode is not None)
        self.config = config
        backend = sandbox_backend or config.sandbox.backend
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.agent = get_agent(config)  # an unknown agent is bad input: refused here
        self._runtime: Installed | None = None
        self._runtime_lock = threading.Lock()
        # The policy version in force, shared with every session's gateway session (async RL).
        self.policy = PolicyVersion(config.gateway.policy_version)

    def set_policy_version(self, version) -> None:
        """Record `version` (a JSON scalar, e.g. the training step) on every model call sent from
        now on, by every session of this factory, those already running included (their next
        call). Thread-safe. A call already sent keeps the version it was sent with (docs/async-rl.md)."""
        self.policy.set(version)

    @property
    def policy_version(self):
        """The policy version in force (PiConfig.gateway.policy_version until set_policy_version)."""
        return self.policy.value

    @property
    def runtime(self) -> Installed:
        """The agent every session runs, installed on first use (once per machine)."""
        with self._runtime_lock:
            if self._runtime is None:
                self._runtime = self.agent.install(self.config.sandbox.runtime_cache_dir)
                self.agent.mounts(self._runtime)  # what it mounts is installed now too (the launcher's Node)
            return self._runtime
