"""The web UI at /web in a real browser: headless Debian chromium driven by Playwright, against
`pi-env serve` on 127.0.0.1 with one rollout slot and no queue, so the limit shows."""

import json
import shutil
from pathlib import Path

import pytest

from helpers import CHROMIUM, processes_of_uid, wait_for
from test_server import FIZZBUZZ, ServerProcess, sandbox_processes, sleeping_task
from pi_env.server.client import PiEnv
from pi_env.server.limiter import ServerBusy

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow, pytest.mark.needs_chromium]
# ../shared/notes/sandbox.md: what headless chromium needs here (no GPU, no network extras).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def web_server(tmp_path_factory):
    presets = tmp_path_factory.mktemp("presets")
    (presets / "fizzbuzz.json").write_text(json.dumps(FIZZBUZZ))
    (presets / "slow.json").write_text(json.dumps(sleeping_task(1234, "slow")))
    served = ServerProcess(tmp_path_factory.mktemp("web"), web=True, MAX_CONCURRENT_ENVS="1", PI_ENV_MAX_QUEUE="0",
                           PI_ENV_EXAMPLES=str(presets))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def open_ui(browser, server):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server.url + "/web/")
    page.wait_for_selector("#run", timeout=60_000)
    return page


def pick_preset(page, name: str, marker: str) -> None:
    page.locator("#preset input").click()
    page.get_by_role("option", name=name, exact=True).click()
    page.wait_for_function(f"document.querySelector('#instruction textarea').value.includes({marker!r})",
                           timeout=20_000)


def phase_log(page) -> str:
    return page.locator("#phase-log textarea").input_value()


def test_preset_run_streams_phases_and_shows_reward_and_logprob_plot(browser, web_server, tmp_path):
    page = open_ui(browser, web_server)
    pick_preset(page, "fizzbuzz", "fizzbuzz.py")
    page.locator("#run").click()
    page.wait_for_selector("#reward h2", timeout=120_000)
    page.screenshot(path=str(tmp_path / "web-ui.png"), full_page=True)
    assert page.locator("#reward").inner_text().strip() == "Reward: 1.0 (synthetic: oracle)"
    log = phase_log(page)
    for line in ("sandbox_create …", "setup done", "model call 0:", "model call 2:", "verify done", "done: reward 1.0"):
        assert line in log, log
    assert log.index("model call 0:") < log.index("agent done") < log.index("verify …")  # live, in order
    # The logprob plot: one bar per reported token, the three turns marked, some tokens below p=0.1.
    bars = page.locator("#logprob-svg rect")
    assert bars.count() > 20
    assert page.locator("#logprob-svg .turn-mark").count() == 3
    assert page.locator("#logprob-svg rect.low").count() > 0
    assert page.locator("#verify-table").inner_text().count("fizzbuzz.py") >= 3
    assert (tmp_path / "web-ui.png").stat().st_size > 10_000
    page.close()


def test_the_agent_selector_runs_another_agent(browser, web_server):
    page = open_ui(browser, web_server)
    pick_preset(page, "fizzbuzz", "fizzbuzz.py")
    page.locator("#agent input").click()
    page.get_by_role("option", name="qwen-code", exact=True).click()
    page.locator("#run").click()
    page.wait_for_selector("#reward h2", timeout=180_000)
    assert page.locator("#reward").inner_text().strip() == "Reward: 1.0 (synthetic: oracle)"
    page.get_by_role("tab", name="Raw JSON").click()
    raw = page.locator("#raw-json").inner_text()
    assert '"agent": "qwen-code"' in raw, raw[:2000]
    page.close()


def test_cancel_stops_the_rollout_and_the_limit_holds_across_web_and_mcp(browser, web_server, tmp_path):
    first = open_ui(browser, web_server)
    pick_preset(first, "slow", "wait")
    first.locator("#run").click()
    (pid, uid), = wait_for(lambda: sandbox_processes("sleep 1234"), 60, "the slow rollout's agent to run")
    wait_for(lambda: "agent …" in phase_log(first), 10, "the live log to show the agent phase")

    # The one slot is taken: a second browser and an MCP client are both refused as busy.
    second = open_ui(browser, web_server)
    pick_preset(second, "fizzbuzz", "fizzbuzz.py")
    second.locator("#run").click()
    second.wait_for_selector("#status :text('busy')", timeout=30_000)
    assert "MAX_CONCURRENT_ENVS=1" in second.locator("#status").inner_text()
    with pytest.raises(ServerBusy):
        PiEnv(web_server.url).run_rollout(FIZZBUZZ)

    first.locator("#cancel").click()
    first.wait_for_selector("#status :text('Cancelled')", timeout=10_000)
    wait_for(lambda: not processes_of_uid(uid), 20, "the cancelled sandbox's processes to be killed")
    wait_for(lambda: not any(web_server.sandbox_root.iterdir()), 20, "the cancelled sandbox to be deleted")
    first.screenshot(path=str(tmp_path / "cancelled.png"), full_page=True)

    # The slot is free again.
    second.locator("#run").click()
    second.wait_for_selector("#reward h2", timeout=120_000)
    assert "Reward: 1.0" in second.locator("#reward").inner_text()
    first.close()
    second.close()
