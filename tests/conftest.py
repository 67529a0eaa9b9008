"""Fixtures and hooks. Plain functions tests share live in helpers.py."""

import pytest
from helpers import CHROMIUM, bwrap_problem, missing_feature

from pi_env.proxy import Gateway
from pi_env.scripted import ScriptedServer


def pytest_runtest_setup(item):
    if "needs_bwrap" in item.keywords and bwrap_problem():
        missing_feature(bwrap_problem())
    if "needs_chromium" in item.keywords and CHROMIUM is None:
        missing_feature("chromium is not installed (bash scripts/bootstrap.sh installs it)")


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
