"""Functions the tests share (fixtures and hooks are in conftest.py): one home each, importable
from every tier (`from helpers import ...`; tests/ is on the path, as for conftest)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import urllib.request

import pytest

from pi_env.config import PiConfig
from pi_env.scripted import ScriptedServer, ScriptedToolCall, ScriptedTurn

USER = {"role": "user", "content": "Fix the bug."}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def chat(messages=(USER,), *, stream=True, tools=False, model="pi-side-model", **extra) -> dict:
    """A chat/completions request body as an agent sends it (`tools=True`: one bash tool)."""
    body = {"model": model, "messages": list(messages), "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if tools:
        body["tools"] = TOOLS
    return body


def bash(command: str) -> ScriptedTurn:
    """A scripted model turn that calls Pi's bash tool."""
    return ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": command})])


def wait_for(condition, timeout_s: float = 5.0, what: str = "the condition"):
    """Poll `condition()` until it is truthy and return its value; fail after `timeout_s`. Polls
    often at first and less often later, so long waits (scans of /proc) stay cheap."""
    deadline, interval = time.monotonic() + timeout_s, 0.01
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval)
        interval = min(interval * 1.5, 0.2)


def free_port(avoid: range = range(0)) -> int:
    """A loopback port nothing listens on now (and outside `avoid`)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in avoid:
            return port


def scripted_config(server: ScriptedServer, key: str, **overrides) -> PiConfig:
    """A config whose endpoint is the scripted server, as if it were a real model server."""
    return PiConfig(
        endpoint={"name": server.base_url, "model": "scripted-model", "api_key": key},
        **overrides,
    )


def processes_of_uid(uid: int) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes running under `uid` (a sandbox's own uid)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                real_uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
            if real_uid == uid:
                with open(f"/proc/{entry}/cmdline", "rb") as cmd:
                    found.append((int(entry), cmd.read().replace(b"\0", b" ").decode(errors="replace")))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return found


def direct_answer(server: ScriptedServer, key: str, body: dict) -> dict:
    """The same request sent straight to the upstream, unstreamed: what the engine says."""
    request = urllib.request.Request(server.base_url + "/chat/completions",
                                     data=json.dumps({**body, "stream": False}).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


# .ci/run sets PI_ENV_CI=1: there, a feature a test exists to check (bubblewrap that runs,
# chromium) missing is a failure, never a skip. On a laptop it is a skip that says what to install.
CI = os.environ.get("PI_ENV_CI") == "1"
CHROMIUM = shutil.which("chromium")  # what scripts/bootstrap.sh checks and installs


def missing_feature(reason: str):
    """Skip for `reason`, or fail under PI_ENV_CI=1."""
    if CI:
        pytest.fail(f"PI_ENV_CI=1 and {reason}", pytrace=False)
    pytest.skip(reason)


_bwrap_problem: list = []


def bwrap_problem() -> str | None:
    """Why sandboxes cannot run here (bubblewrap missing, or present but unable to create its
    namespaces), or None; found once per session."""
    if not _bwrap_problem:
        from pi_env.sandbox import SandboxError
        from pi_env.sandbox.local import LocalSandboxBackend

        try:
            LocalSandboxBackend()
            _bwrap_problem.append(None)
        except SandboxError as error:
            _bwrap_problem.append(f"bubblewrap cannot run here: {error}")
    return _bwrap_problem[0]
