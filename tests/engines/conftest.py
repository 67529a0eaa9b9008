"""Fixtures of the real engine tier (run with `make test-engines` / scripts/test_engines.sh).

The default `pytest` run never collects this directory (pyproject's addopts ignore it); the tier
names it explicitly. A test here that cannot run (engine not installed) is skipped with the
reason, unless ENGINE_TIER=1 (set by the tier command): then every skip is an error, so the
tier can never pass by running nothing.

Set ENGINE_BASE_URL=http://127.0.0.1:PORT/v1 to use a vLLM you started yourself
(scripts/engines/serve_vllm.sh) instead of one per session.
"""

from __future__ import annotations

import os
import time

import pytest

import engine as engines

TIER = os.environ.get("ENGINE_TIER") == "1"


def _unavailable(reason: str):
    if TIER:
        pytest.fail(f"ENGINE_TIER=1 and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_engine():
    """vLLM (CPU, float32) serving SmolLM2-135M-Instruct on 127.0.0.1, once per session.

    An :class:`engine.Engine`: ``base_url`` (…/v1), ``model`` (served name), ``model_dir``
    (the same weights, tokenizer and chat template, for transformers), ``pid``.
    """
    url = os.environ.get("ENGINE_BASE_URL")
    if url:
        url = url.rstrip("/")
        url = url if url.endswith("/v1") else url + "/v1"
        yield engines.Engine("vllm", url, os.environ.get("ENGINE_MODEL", engines.MODEL_NAME), engines.MODEL_DIR, None)
        return
    missing = engines.vllm_missing()
    if missing:
        _unavailable(missing)
    started = time.monotonic()
    eng = engines.start_vllm()
    print(f"\n[engines] vLLM up in {time.monotonic() - started:.1f} s at {eng.base_url} (PID {eng.pid}, log {eng.log})")
    try:
        yield eng
    finally:
        engines.stop(eng)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if TIER and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"ENGINE_TIER=1: a skip is an error in the engine tier: {reason}"


def pytest_terminal_summary(terminalreporter):
    if engines.NOTES:
        terminalreporter.section("engine tier numbers")
        for line in engines.NOTES:
            terminalreporter.write_line(line)
