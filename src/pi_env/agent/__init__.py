"""Coding agents, registered by name like sandbox backends: the protocol is base.py's; Pi
(pi.py) is the default and every other agent implements the same protocol (docs/agents.md)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import PiConfig
    from .base import Agent

# name -> "module:class"; imported on first use so one agent's code never burdens another.
_AGENTS = {
    "claude-code": "pi_env.agent.claude_code:ClaudeCodeAgent",
    "codex": "pi_env.agent.codex:CodexAgent",
    "gemini-cli": "pi_env.agent.gemini_cli:GeminiCliAgent",
    "mini-swe-agent": "pi_env.agent.mini_swe_agent:MiniSweAgent",
    "opencode": "pi_env.agent.opencode:OpenCodeAgent",
    "pi": "pi_env.agent.pi:PiAgent",
    "qwen-code": "pi_env.agent.qwen_code:QwenCodeAgent",
}


def agent_names() -> list[str]:
    return sorted(_AGENTS)


def get_agent(config: PiConfig) -> Agent:
    """The agent `config.agent` names, configured by `config`. ValueError for an unknown name."""
    name = config.agent.name
    if name not in _AGENTS:
        raise ValueError(f"unknown agent {name!r}; known: {', '.join(agent_names())}")
    module, cls = _AGENTS[name].split(":")
    return getattr(importlib.import_module(module), cls)(config)


__all__ = ["agent_names", "get_agent"]
