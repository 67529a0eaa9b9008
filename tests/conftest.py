import json
import os
import shutil
import urllib.request

import pytest

from pi_env.config import PiConfig
from pi_env.proxy import Gateway
from pi_env.testing import ScriptedServer


def pytest_collection_modifyitems(config, items):
    if shutil.which("bwrap") is None:
        skip = pytest.mark.skip(reason="bubblewrap is not installed (bash scripts/bootstrap.sh installs it)")
        for item in items:
            if "needs_bwrap" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def server():
    """A fresh scripted OpenAI-compatible server (the sanctioned test double)."""
    with ScriptedServer() as scripted:
        yield scripted


@pytest.fixture(scope="module")
def gateway():
    """A gateway of the test module's own (2 s upstream read timeout, so hangs end quickly)."""
    gw = Gateway(read_timeout_s=2.0).start()
    yield gw
    gw.close()


def scripted_config(server: ScriptedServer, key: str, **overrides) -> PiConfig:
    """A config whose endpoint is the scripted server, as if it were a real model server."""
    return PiConfig(endpoint=server.base_url, model="scripted-model", api_key=key, **overrides)


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
