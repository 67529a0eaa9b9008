"""Fixtures and hooks. Plain functions tests share live in helpers.py."""

import shutil

import pytest

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
