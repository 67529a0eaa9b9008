"""Fixtures of the real engine tier (run with `make test-engines` / scripts/test_engines.sh).

The default `pytest` run never collects this directory (pyproject's addopts ignore it); the tier
names it explicitly. A test here that cannot run (engine not installed) is skipped with the
reason, unless ENGINE_TIER=1 (set by the tier command): then every skip is an error, so the
tier can never pass by running nothing.

Set ENGINE_BASE_URL (vLLM) or LLAMA_BASE_URL (llama.cpp) to http://127.0.0.1:PORT/v1 to use an
engine you started yourself (scripts/engines/serve_*.sh) instead of one per session.
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


def _engine(kind: str, url_var: str, missing, start):
    url = os.environ.get(url_var)
    if url:
        url = url.rstrip("/")
        url = url if url.endswith("/v1") else url + "/v1"
        yield engines.Engine(kind, url, os.environ.get("ENGINE_MODEL", engines.MODEL_NAME), engines.MODEL_DIR, None)
        return
    reason = missing()
    if reason:
        _unavailable(reason)
    started = time.monotonic()
    eng = start()
    print(f"\n[engines] {kind} up in {time.monotonic() - started:.1f} s at {eng.base_url} (PID {eng.pid}, log {eng.log})")
    try:
        yield eng
    finally:
        engines.stop(eng)


@pytest.fixture(scope="session")
def openenv_harness():
    """openenv's harness module. Missing, the test skips (fails under ENGINE_TIER=1): a
    module-level importorskip would skip at collection, out of reach of the tier's skip hook."""
    try:
        import openenv.core.harness as harness
    except ImportError as error:
        _unavailable(f"the openenv extra is not installed ({error})")
    return harness


@pytest.fixture(scope="session")
def vllm_engine():
    """vLLM (CPU, float32) serving SmolLM2-135M-Instruct on 127.0.0.1, once per session.

    An :class:`engine.Engine`: ``base_url`` (…/v1), ``model`` (served name), ``model_dir``
    (the same weights, tokenizer and chat template, for transformers), ``pid``.
    ENGINE_BASE_URL=http://127.0.0.1:PORT/v1 uses a vLLM you started instead.
    """
    yield from _engine("vllm", "ENGINE_BASE_URL", engines.vllm_missing, engines.start_vllm)


@pytest.fixture(scope="session")
def llama_engine():
    """llama.cpp's llama-server serving the SmolLM2-135M-Instruct GGUF (Q4_1), once per session.

    Same fields as ``vllm_engine``; ``model_dir`` is the dequantized copy of the same weights.
    LLAMA_BASE_URL=http://127.0.0.1:PORT/v1 uses a llama-server you started instead.
    """
    yield from _engine("llama.cpp", "LLAMA_BASE_URL", engines.llama_missing, engines.start_llama)


# The engines the tier command installed (scripts/test_engines.sh sets ENGINE_TIER_ENGINES,
# default "vllm llama"); under ENGINE_TIER=1, tests needing another engine are deselected.
_FIXTURE_OF = {"vllm": "vllm_engine", "llama": "llama_engine"}


def pytest_collection_modifyitems(config, items):
    if not TIER:
        return
    wanted = os.environ.get("ENGINE_TIER_ENGINES", "vllm llama").split()
    unwanted = {fixture for name, fixture in _FIXTURE_OF.items() if name not in wanted}
    keep, drop = [], []
    for item in items:
        (drop if unwanted & set(getattr(item, "fixturenames", ())) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
