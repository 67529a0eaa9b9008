"""Sandboxes: the protocol (base.py) and a registry of backends by name."""

from __future__ import annotations

import importlib

from pi_env.sandbox.base import (
    GATEWAY_SOCKET,
    RUNTIME_DIR,
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    ExecResult,
    Network,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    SandboxProcess,
    SandboxSpec,
    SandboxUnavailable,
)

# name -> "module:class"; imported on first use so one backend's dependencies never burden another.
_BACKENDS = {
    "e2b": "pi_env.sandbox.e2b:E2BSandboxBackend",
    "hf": "pi_env.sandbox.hf:HfSandboxBackend",
    "local": "pi_env.sandbox.local:LocalSandboxBackend",
    "podman": "pi_env.sandbox.podman:PodmanBackend",
    "unsafe-local": "pi_env.sandbox.unsafe_local:UnsafeLocalBackend",
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str = "local") -> SandboxBackend:
    """A new instance of the backend called `name`. SandboxUnavailable if it cannot run here."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; known: {', '.join(backend_names())}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = [
    "GATEWAY_SOCKET",
    "RUNTIME_DIR",
    "SANDBOX_HOME",
    "SANDBOX_WORKDIR",
    "ExecResult",
    "Network",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxLimits",
    "SandboxProcess",
    "SandboxSpec",
    "SandboxUnavailable",
    "backend_names",
    "get_backend",
]
