"""The sandbox backends that tests/test_sandbox_contract.py runs its contract against.

Each entry of BACKENDS is a `BackendEntry(name, make, features)`:
- `make()` returns a ready backend instance (something with `.name` and `.create(spec)`), or
  calls `pytest.skip(reason)` when the backend cannot run here (the reason says what is
  missing and how to get it). It is called once per test module.
- `features` says which host-bound parts of the contract the backend really exercises here;
  a contract test that needs a feature the entry lacks is skipped with that reason:
    "network":  network="none" reaches nothing; network="full" reaches the outside but no
                host service (not on 127.0.0.1, not on the host's own addresses);
    "host_mounts": spec.ro_mounts (host paths) are mounted read-only;
    "gateway_socket": spec.gateway_socket (a host Unix socket) is reachable at GATEWAY_SOCKET
                  with network="gateway" only, and agent_masked_paths hide their content then;
    "limits":   spec.limits (open files, file size, processes) are enforced.
  A backend whose transport is faked (a remote service's SDK against a loopback stand-in)
  passes ALL_FEATURES minus what its stand-in cannot honour, and its docs say so.

A CI that must not skip a backend silently lists it in PI_ENV_REQUIRE_BACKENDS (comma-separated):
then an unavailable backend fails instead (make() functions of new entries should do the same:
use `unavailable(name, reason)`).

To add a backend: write `def _make_mine(): ...` (import its module inside, skip with a reason
when unusable) and append `BackendEntry("mine", _make_mine, ALL_FEATURES - {...})` below.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import pytest

from pi_env.sandbox import SandboxBackend, SandboxUnavailable, get_backend

ALL_FEATURES = frozenset({"network", "host_mounts", "gateway_socket", "limits"})


class BackendEntry(NamedTuple):
    name: str
    make: Callable[[], SandboxBackend]
    features: frozenset[str] = ALL_FEATURES


def unavailable(name: str, reason: str):
    """Skip (or fail, when PI_ENV_REQUIRE_BACKENDS names it) a backend that cannot run here."""
    if name in os.environ.get("PI_ENV_REQUIRE_BACKENDS", "").split(","):
        pytest.fail(f"sandbox backend {name!r} is required (PI_ENV_REQUIRE_BACKENDS) but cannot run here: {reason}")
    pytest.skip(f"sandbox backend {name!r} cannot run here: {reason}")


def registered(name: str) -> Callable[[], SandboxBackend]:
    """make() for a backend of pi_env.sandbox's registry: skips when it is unavailable here."""

    def make() -> SandboxBackend:
        try:
            return get_backend(name)
        except SandboxUnavailable as exc:
            unavailable(name, str(exc))

    return make


BACKENDS: list[BackendEntry] = [
    BackendEntry("local", registered("local")),
    BackendEntry("podman", registered("podman")),
]


_FAKE_SERVICES: list = []  # loopback stand-ins started for this test process, stopped at exit


def _make_hf() -> SandboxBackend:
    """The hf backend: the real huggingface_hub Sandbox client against the loopback stand-in
    (pi_env.testing.fake_hf_sandbox: HF Jobs + an in-job server running commands in bwrap)."""
    import atexit
    import shutil

    try:
        import huggingface_hub.constants
        from huggingface_hub import Sandbox  # noqa: F401

        from pi_env.sandbox.hf import HfSandboxBackend
        from pi_env.testing.fake_hf_sandbox import FakeHfJobs
    except ImportError as exc:
        unavailable("hf", f"{exc}: pip install 'pi-env[hf]'")
    if not shutil.which("bwrap"):
        unavailable("hf", "its loopback stand-in runs commands in bubblewrap, which is not installed")
    fake = FakeHfJobs().__enter__()
    _FAKE_SERVICES.append(fake)
    atexit.register(fake.close)
    huggingface_hub.constants.ENDPOINT = fake.endpoint  # only the stand-in is ever reached
    return HfSandboxBackend(token="hf_pi_env_fake", namespace="pi-env-test")


# Remote services through their real SDKs and a loopback stand-in: the network, the gateway
# socket and limits are the service's, not exercised here; ro_mounts are delivered by upload.
BACKENDS.append(BackendEntry("hf", _make_hf, frozenset({"host_mounts"})))


def _make_e2b() -> SandboxBackend:
    """The e2b backend: the real e2b client against the loopback stand-in
    (pi_env.testing.fake_e2b: the E2B API + envd, commands entering a bwrap'd namespace)."""
    import atexit
    import shutil

    try:
        from pi_env.sandbox.e2b import E2BSandboxBackend
        from pi_env.testing.fake_e2b import FakeE2B
    except ImportError as exc:
        unavailable("e2b", f"{exc}: pip install 'pi-env[e2b]'")
    if not (shutil.which("bwrap") and shutil.which("nsenter")):
        unavailable("e2b", "its loopback stand-in needs bubblewrap and nsenter")
    fake = FakeE2B().__enter__()
    _FAKE_SERVICES.append(fake)
    atexit.register(fake.close)
    return E2BSandboxBackend(api_key=fake.api_key, api_url=fake.url, sandbox_url=fake.url, http_version="1.1")


BACKENDS.append(BackendEntry("e2b", _make_e2b, frozenset({"host_mounts"})))
