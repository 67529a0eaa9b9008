"""`pi-env serve` against a hostile caller (issue 18), outside a browser: who may call what
(the bearer token for the API, the cookie for the UI only, Origin checks, no CORS), no token in
logs, bad input answered with field-named errors before anything runs, and abandoned calls
(SIGKILLed clients at every stage, every door) giving their slot and sandbox back within
seconds. The browser's side is in test_web_ui_hostile.py."""

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import processes_of_uid
from pi_env import PiTask
from test_server import (FIZZBUZZ, ServerProcess, free_port, get, sandbox_processes, sandbox_uids_running,
                         scripted_port, server, sleeping_task, wait_for)

__all__ = ["scripted_port", "server"]  # the fixtures: scripted servers on the port the servers allow

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
TOKEN = "tok-3f9c2a7e-hostile"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
EVIL = "http://127.0.0.1:1"


def request(url: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None,
            timeout: float = 30) -> tuple[int, dict, str]:
    """(status, lower-cased headers, body text); redirects are not followed."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    req = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with opener.open(req, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read().decode()


def jsonrpc_call(arguments: dict, id_: int = 1) -> bytes:
    """OpenEnv's plain JSON-RPC tools/call of run_rollout (json.dumps escapes lone surrogates)."""
    return json.dumps({"jsonrpc": "2.0", "id": id_, "method": "tools/call",
                       "params": {"name": "run_rollout", "arguments": arguments}}).encode()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("guarded"), web=True, PI_ENV_AUTH_TOKEN=TOKEN,
                           MAX_CONCURRENT_ENVS="2", PI_ENV_MAX_QUEUE="2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, scripted_port):
    """No token (a laptop's default): the Origin checks are all that stands between a web page
    the user visits and the server."""
    server = ServerProcess(tmp_path_factory.mktemp("open"), MAX_CONCURRENT_ENVS="2", PI_ENV_MAX_QUEUE="8",
                           PI_ENV_ALLOWED_BASE_URLS=f"http://127.0.0.1:{scripted_port}/v1")
    yield server
    server.stop()


# -- 2. the cookie is the UI's only; Origin checks; no CORS ------------------------------------------

def test_the_cookie_opens_the_ui_only_and_comes_from_a_same_origin_sign_in(guarded):
    url = guarded.url
    status, _, page = request(url + "/web/")
    assert status == 401 and 'name="token"' in page  # the sign-in form, the token typed, never in a URL
    # Signing in: only from the server's own page (Origin), only with the right token.
    form = f"token={TOKEN}".encode()
    assert request(url + "/web/login", form, {"Origin": url})[0] == 303
    assert request(url + "/web/login", form)[0] == 403  # no Origin: not from the sign-in page
    assert request(url + "/web/login", form, {"Origin": EVIL})[0] == 403
    assert request(url + "/web/login", b"token=wrong", {"Origin": url})[0] == 401
    status, headers, _ = request(url + "/web/login", form, {"Origin": url})
    cookie = headers["set-cookie"]
    for attribute in ("HttpOnly", "SameSite=Strict", "Path=/web"):
        assert attribute in cookie, cookie
    jar = {"Cookie": cookie.split(";")[0]}
    assert request(url + "/web/", headers=jar)[0] == 200
    # The cookie is not a key to the API: /mcp, OpenEnv's routes, /endpoints, /docs want the bearer token.
    for path in ("/endpoints", "/docs", "/metadata", "/schema", "/state"):
        assert request(url + path, headers=jar)[0] == 401, path
        assert request(url + path, headers=BEARER)[0] == 200, path
    body = jsonrpc_call({"task": FIZZBUZZ})
    assert request(url + "/mcp", body, {**jar, "Content-Type": "application/json"})[0] == 401
    assert request(url + "/mcp", body, {**jar, "Content-Type": "text/plain", "Origin": url})[0] == 401
    # A cookie-authenticated change from another origin (another port of this host: same site) is refused.
    assert request(url + "/web/gradio_api/queue/join", b"{}", {**jar, "Origin": EVIL,
                                                                "Content-Type": "text/plain"})[0] == 403
    # ... and one without any Origin (a browser always sends it on a POST) too.
    assert request(url + "/web/gradio_api/queue/join", b"{}", {**jar, "Content-Type": "application/json"})[0] == 403
    # No CORS: the UI's answers carry no access-control-* header, whoever asks.
    for method in ("GET", "OPTIONS"):
        _, headers, _ = request(url + "/web/gradio_api/info", headers={**jar, "Origin": EVIL,
                                                                       "Access-Control-Request-Method": "POST"},
                                method=method)
        assert not [name for name in headers if name.startswith("access-control-")], (method, headers)


def test_websocket_handshakes_check_origin_and_need_the_token(guarded):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    ws = guarded.url.replace("http", "ws") + "/ws"
    for headers, origin in ((BEARER, EVIL), (BEARER, "http://evil.example"), ({}, None),
                            ({"Cookie": f"pi_env_token={TOKEN}"}, None), ({"Cookie": f"pi_env_token={TOKEN}"}, guarded.url)):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws, additional_headers=headers, origin=origin, open_timeout=10).close()
        assert refused.value.response.status_code == 403, (headers, origin)
    with connect(ws, additional_headers=BEARER, open_timeout=10) as socket_:  # the token, no browser: fine
        socket_.send(json.dumps({"type": "state"}))
        assert "episode_id" in socket_.recv(timeout=10)
    with connect(ws, additional_headers=BEARER, origin=guarded.url, open_timeout=10):
        pass  # the server's own page


def test_without_a_token_a_foreign_origin_still_cannot_start_a_rollout(open_server):
    """A `no-cors` text/plain POST (what a page on any site may send) to /mcp or /step, and a
    WebSocket handshake, from another origin: 403 before anything runs."""
    url = open_server.url
    body = jsonrpc_call({"task": sleeping_task(621, "csrf")})
    for origin in (EVIL, "http://evil.example", "null"):
        assert request(url + "/mcp", body, {"Origin": origin, "Content-Type": "text/plain"})[0] == 403
        assert request(url + "/step", json.dumps({"action": {"type": "call_tool", "tool_name": "run_rollout",
                                                             "arguments": {"task": sleeping_task(621)}}}).encode(),
                       {"Origin": origin, "Content-Type": "text/plain"})[0] == 403
    time.sleep(1)
    assert not sandbox_processes("sleep 621")
    assert json.loads(get(url + "/endpoints")[1])["rollouts"]["running"] == 0
    # An API client (no Origin) and the server's own origin still work.
    status, _, text = request(url + "/mcp", jsonrpc_call({"task": FIZZBUZZ}), {"Content-Type": "application/json"},
                              timeout=300)
    assert status == 200 and json.loads(text)["result"]["structured_content"]["reward"] == 1.0, text[:500]


def test_cors_only_for_the_origins_configured(tmp_path):
    trusted = "http://notebook.example:8888"
    server = ServerProcess(tmp_path, PI_ENV_CORS_ORIGINS=trusted, PI_ENV_AUTH_TOKEN=TOKEN)
    try:
        preflight = {"Origin": trusted, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        status, headers, _ = request(server.url + "/mcp", headers=preflight, method="OPTIONS")
        assert status == 200 and headers["access-control-allow-origin"] == trusted
        _, headers, _ = request(server.url + "/endpoints", headers={**BEARER, "Origin": trusted})
        assert headers["access-control-allow-origin"] == trusted
        _, headers, _ = request(server.url + "/endpoints", headers={**BEARER, "Origin": EVIL})
        assert "access-control-allow-origin" not in headers
        assert request(server.url + "/mcp", jsonrpc_call({"task": FIZZBUZZ}), {**BEARER, "Origin": EVIL})[0] == 403
    finally:
        server.stop()


# -- 10. no query strings in logs; the token only in a header or the cookie ----------------------------

def test_no_query_string_is_logged_and_a_query_token_opens_nothing(guarded):
    from websockets.sync.client import connect

    secret = "qs-secret-7d1e0c"
    assert request(guarded.url + f"/endpoints?token={TOKEN}")[0] == 401
    assert request(guarded.url + f"/web/?token={TOKEN}")[0] == 401
    assert request(guarded.url + f"/endpoints?note={secret}", headers=BEARER)[0] == 200
    with connect(guarded.url.replace("http", "ws") + f"/ws?token={secret}", additional_headers=BEARER,
                 open_timeout=10):
        pass
    time.sleep(0.5)
    log = guarded.log_path.read_text()
    assert "GET /endpoints?" in log and "/ws?" in log  # the requests are logged ...
    assert secret not in log and TOKEN not in log  # ... their query strings are not


# -- 7. bad input: field-named errors before anything runs ----------------------------------------------

BAD_ARGUMENTS = [
    ({"instruction": "x", "verify": ["true"], "files": {"a.txt": "ok \ud800 no"}}, "files['a.txt']", "surrogate"),
    ({"instruction": "x", "setup": ["echo \udfff"], "verify": ["true"]}, "setup[0]", "surrogate"),
    ({"instruction": "x", "verify": ["true"], "solution": [{"tool": "write", "path": "a", "content": "\ud83d"}]},
     "solution[0]", "surrogate"),
    ({"instruction": "x", "verify": ["true\x00; rm -rf /"]}, "verify[0]", "NUL"),
    ({"instruction": "x", "setup": ["a\x00b"], "verify": ["true"]}, "setup[0]", "NUL"),
    ({"instruction": "x", "verify": ["true"], "agent_timeout_s": 1e308}, "agent_timeout_s", "less than or equal"),
    ({"instruction": "x", "verify": ["true"], "files": {"n" * 300: "x"}}, "files", "path too long"),
    ({"instruction": "x", "verify": ["true"], "endpoint": "http://127.0.0.1:9/v1", "model": "m",
      "api_key": "line\r\nX-Injected: 1"}, "api_key", "control character"),
    ({"task": {"instruction": "x", "verify": ["true"], "timeouts": {"agent_s": 1e308}}}, "timeouts.agent_s",
     "less than or equal"),
]


@pytest.mark.parametrize("arguments,field,what", BAD_ARGUMENTS)
def test_bad_input_is_a_field_named_error_never_infra(open_server, arguments, field, what):
    arguments = with_solution(arguments)  # the oracle could run it: only the check stands in the way
    for mcp_sdk in (False, True):
        text = _tool_error(open_server.url, arguments, mcp_sdk)
        assert field in text and what in text, text
        assert "infra" not in text and "Traceback" not in text and "Error calling tool" not in text, text
    assert not any(open_server.sandbox_root.iterdir())  # nothing ran


def with_solution(arguments: dict) -> dict:
    solution = [{"tool": "bash", "command": "true"}]
    if "task" in arguments:
        return {**arguments, "task": {"solution": solution, **arguments["task"]}}
    return {"solution": solution, **arguments}


def _tool_error(url: str, arguments: dict, mcp_sdk: bool) -> str:
    if not mcp_sdk:  # OpenEnv's JSON-RPC POST
        status, _, text = request(url + "/mcp", jsonrpc_call(arguments), {"Content-Type": "application/json"})
        assert status == 200, (status, text)
        answer = json.loads(text)
        return json.dumps(answer.get("error") or answer["result"], ensure_ascii=False)
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    status, _, text = request(url + "/mcp/", jsonrpc_call(arguments), headers)  # MCP streamable HTTP, stateless
    assert status == 200, (status, text)
    data = next(line[5:] for line in text.splitlines() if line.startswith("data:"))
    result = json.loads(data)["result"]
    assert result["isError"], result
    return result["content"][0]["text"]


@pytest.mark.parametrize("body,what", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"x": "\xff\xfe"}}', "not UTF-8"),
    (b'{"a": ' * 150 + b"1" + b"}" * 150, "nested too deeply"),  # valid JSON, past the 100 levels
    (b"{" * 3000, "not valid JSON"),
])
def test_undecodable_or_deep_request_bodies_are_400_not_500(open_server, body, what):
    for path, accept in (("/mcp", "application/json"), ("/mcp/", "application/json, text/event-stream"),
                         ("/step", "application/json")):
        status, _, text = request(open_server.url + path, body, {"Content-Type": "application/json",
                                                                 "Accept": accept})
        assert status == 400 and what in text, (path, status, text[:300])
    assert get(open_server.url + "/health")[0] == 200


def test_a_body_past_the_limit_is_413(tmp_path):
    server = ServerProcess(tmp_path, PI_ENV_MAX_BODY_BYTES=str(1 << 20))
    try:
        status, _, text = request(server.url + "/mcp", b'{"x": "' + b"a" * (2 << 20) + b'"}',
                                  {"Content-Type": "application/json"})
        assert status == 413 and "PI_ENV_MAX_BODY_BYTES" in text
    finally:
        server.stop()


# -- 3. abandoned work gives its slot back, at every stage, through every door ------------------------

CLIENT = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
door, url, task = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if door == "mcp":
    from test_server import mcp_call
    asyncio.run(mcp_call(url, {{"task": task}}))
elif door == "ws":
    from openenv.core.mcp_client import MCPToolClient
    async def main():
        async with MCPToolClient(base_url=url, message_timeout_s=600) as env:
            await env.call_tool("run_rollout", task=task)
    asyncio.run(main())
elif door == "step":
    import urllib.request
    body = json.dumps({{"action": {{"type": "call_tool", "tool_name": "run_rollout", "arguments": {{"task": task}}}}}})
    urllib.request.urlopen(urllib.request.Request(url + "/step", body.encode(),
                                                  {{"Content-Type": "application/json"}}), timeout=600).read()
"""


def staged_task(stage: str, marker: int) -> dict:
    """A task that stays in `stage` (setup, agent or verify) running `sleep <marker>`."""
    sleep = f"sleep {marker}"
    task = {"task_id": f"{stage}-{marker}", "instruction": "wait", "verify": ["true"],
            "solution": [{"tool": "bash", "command": "true"}]}
    if stage == "setup":
        task["setup"] = [sleep]
    elif stage == "agent":
        task["solution"] = [{"tool": "bash", "command": sleep}]
    else:
        task["verify"] = [sleep]
    return task


def start_client(door: str, url: str, task: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT.format(tests=str(Path(__file__).parent)), door, url,
                             json.dumps(task)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def rollouts(server) -> dict:
    return json.loads(get(server.url + "/endpoints")[1])["rollouts"]


def assert_nothing_left(server, within_s: float = 20) -> None:
    wait_for(lambda: rollouts(server)["running"] == 0 and rollouts(server)["waiting"] == 0, within_s,
             f"every slot and queue place to be freed ({rollouts(server)})")
    wait_for(lambda: not any(server.sandbox_root.iterdir()), within_s, "every sandbox dir to be deleted")
    wait_for(lambda: not [uid for uid in sandbox_uids_running() if processes_of_uid(uid)
                          and any(str(server.sandbox_root) in cmd or "sleep 6" in cmd for _, cmd in
                                  processes_of_uid(uid))], within_s, "every sandbox process to end")


@pytest.mark.parametrize("door", ["mcp", "ws", "step"])
@pytest.mark.parametrize("stage", ["setup", "agent", "verify"])
def test_a_killed_client_frees_its_slot_within_seconds(open_server, door, stage):
    marker = 630 + ["setup", "agent", "verify"].index(stage) * 10 + ["mcp", "ws", "step"].index(door)
    client = start_client(door, open_server.url, staged_task(stage, marker))
    try:
        wait_for(lambda: sandbox_processes(f"sleep {marker}"), 90, f"the {stage} sleep to start")
        client.kill()
        client.wait(10)
        killed = time.monotonic()
        assert_nothing_left(open_server, within_s=15)
        print(f"{door}/{stage}: slot and sandbox freed {time.monotonic() - killed:.1f} s after SIGKILL")
    finally:
        if client.poll() is None:
            client.kill()


def test_killed_queued_clients_leave_the_queue(tmp_path):
    server = ServerProcess(tmp_path, MAX_CONCURRENT_ENVS="1", PI_ENV_MAX_QUEUE="4")
    clients = []
    try:
        clients.append(start_client("mcp", server.url, staged_task("agent", 661)))
        wait_for(lambda: sandbox_processes("sleep 661"), 90, "the first rollout to run")
        clients += [start_client(door, server.url, staged_task("agent", 662 + i))
                    for i, door in enumerate(["mcp", "mcp", "ws", "step"])]
        wait_for(lambda: rollouts(server)["waiting"] == 4, 60, "four callers to queue")
        for client in clients[1:]:
            client.kill()
        wait_for(lambda: rollouts(server)["waiting"] == 0, 10, "the killed callers to leave the queue")
        assert rollouts(server)["running"] == 1 and sandbox_processes("sleep 661")  # the live one runs on
        clients[0].kill()
        assert_nothing_left(server)
        assert not any(sandbox_processes(f"sleep {662 + i}") for i in range(4))  # never started
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
        server.stop()


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every live process below `pid` (children, theirs, ...); zombies
    (dead, not yet reaped) do not count."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = {}, list(children.get(pid, []))
    while stack:
        child = stack.pop()
        try:
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        stack += children.get(child, [])
    return found


@pytest.mark.timeout(600)  # bounded inside: a warm rollout, 240 s of load at most, 60 s of checks
def test_sixteen_calls_killed_at_random_stages_leave_nothing_behind(tmp_path):
    """Bounded load: 16 callers over MCP, /ws and /step (4 slots, queue 12), each running a
    task that lingers in setup, the agent or verify. Five are SIGKILLed at a random moment once
    callers queue (queued behind the four running, or starting); the others 2-8 s into their
    stage. Within 30 s of the last kill no slot or queue place, sandbox
    dir, sandbox process or process below the server is left (the server's own helpers, started
    by a first rollout, stay as they were)."""
    server = ServerProcess(tmp_path, MAX_CONCURRENT_ENVS="4", PI_ENV_MAX_QUEUE="12")
    rng = random.Random(18)
    clients = []
    try:
        start_client("mcp", server.url, FIZZBUZZ).wait(120)  # warm: a whole rollout
        assert_nothing_left(server)
        helpers_before = descendants(server.process.pid)
        early = set(rng.sample(range(16), 5))
        started = time.monotonic()
        for i in range(16):
            door, stage = ("mcp", "ws", "step")[i % 3], ("setup", "agent", "verify")[(i // 3) % 3]
            clients.append({"process": start_client(door, server.url, staged_task(stage, 700 + i)),
                            "marker": f"sleep {700 + i}", "what": f"{door}/{stage}",
                            "early": i in early, "kill_at": None})
        killed_in = []
        deadline = time.monotonic() + 240  # 12 waves of setup + Pi start at most, on a loaded machine
        while any(client["process"].poll() is None for client in clients):
            assert time.monotonic() < deadline, (f"never reached their stage (slots not freed by the killed?): "
                                                 f"{[c['what'] for c in clients if c['process'].poll() is None]}, "
                                                 f"{rollouts(server)}")
            waiting = rollouts(server)["waiting"]
            sandboxed = [cmd for uid in sandbox_uids_running() for _, cmd in processes_of_uid(uid)]
            for client in clients:
                if client["process"].poll() is not None:
                    continue
                in_stage = any(client["marker"] in cmd for cmd in sandboxed)
                if client["kill_at"] is None and in_stage:  # kept a while, so that others queue
                    client["kill_at"] = time.monotonic() + rng.uniform(2, 8)
                elif client["kill_at"] is None and client["early"] and waiting > 0:
                    client["kill_at"] = time.monotonic() + rng.uniform(0, 1)
                if client["kill_at"] is not None and time.monotonic() >= client["kill_at"]:
                    client["process"].kill()
                    client["process"].wait(10)
                    killed_in.append((client["what"], "in its stage" if in_stage else "queued or starting", waiting))
            time.sleep(0.2)
        killed = time.monotonic()
        assert_nothing_left(server, within_s=30)
        wait_for(lambda: descendants(server.process.pid).keys() <= helpers_before.keys(), 30,
                 "every process the load started below the server to end")
        print(f"16 callers killed ({killed_in}): everything freed {time.monotonic() - killed:.1f} s after the "
              f"last kill, {killed - started:.0f} s after the first call")
        assert sum(where == "in its stage" for _, where, _ in killed_in) >= 11, killed_in
        assert sum(where == "queued or starting" and waiting > 0 for _, where, waiting in killed_in) >= 2, killed_in
        assert not any(sandbox_processes(f"sleep {700 + i}") for i in range(16))
        assert rollouts(server) == {"running": 0, "waiting": 0, "max_running": 4, "max_waiting": 12}
        assert get(server.url + "/health")[0] == 200  # and it still serves
    finally:
        for client in clients:
            if client["process"].poll() is None:
                client["process"].kill()
        server.stop()


# -- 6. keys that look like JSON or field names, or need escaping, work and corrupt nothing -------------

@pytest.mark.parametrize("key", ["stop", "pass", "true", "null", 'sk-"q"\\b\tk', "sk-ключ-ü-🔑"])
def test_any_api_key_works_and_never_rewrites_the_result(open_server, server, key):
    from pi_env.server.client import PiEnv
    from pi_env.scripted import ScriptedToolCall, ScriptedTurn

    server.add_script([ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={
        "command": "echo pass_rate stop_reason true null > out.txt"})]), ScriptedTurn(text="stop: done, pass")],
        api_key=key)
    with PiEnv(open_server.url) as env:
        result = env.run_rollout(instruction="x", verify=["grep -q stop_reason out.txt"], endpoint=server.base_url,
                                 model="scripted-model", api_key=key)
    assert result.reward == 1.0 and result.reward_source == "pass_rate" and result.stop_reason == "stop", result.error
    assert result.files["out.txt"] == "pass_rate stop_reason true null\n"
    assert "***" not in result.model_dump_json()
    assert server.requests[-1].api_key == key  # it reached the upstream intact


# -- 41.7: a caller's task is data only; its URLs are rebuilt and allowlisted; errors are short -------

class Upstream:
    """A plain HTTP server on 127.0.0.1 (a host service a caller must not reach, or an allowed
    endpoint answering errors): every request is recorded and answered `status` + `body`."""

    def __init__(self, status: int = 200, body: bytes = b"", content_type: str = "application/json"):
        import http.server
        import threading

        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self._answer()

            def _answer(self):
                outer.requests.append(f"{self.command} {self.path}")
                self.send_response(outer.status)
                self.send_header("content-type", outer.content_type)
                self.send_header("content-length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args):
                pass

        self.status, self.body, self.content_type = status, body, content_type
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


SECRET_LINE = "root:$6$hostile-secret-line-4e1f:19000:0:99999:7:::"


def harbor_task(environment: dict) -> dict:
    """A caller's task carrying Harbor facts whose environment is `environment`."""
    return {"instruction": "x", "verify": ["true"], "solution": [{"tool": "bash", "command": "true"}],
            "metadata": {"harbor": {"source": "/srv/tasks/t", "path_map": {},
                                    "environment": {"needs_build": True, **environment}}}}


@pytest.mark.parametrize("environment", ["dockerfile", "context", "both", "no_build"])
def test_a_callers_task_cannot_name_host_files(open_server, tmp_path, environment):
    """A Harbor environment naming a host file as its Dockerfile or a host dir as its build
    context (what the building backends read on the host): refused, whatever the path, on both
    /mcp doors, before anything runs; the file's lines never come back."""
    secret = tmp_path / "shadow"
    secret.write_text(SECRET_LINE + "\nFROM scratch\n")
    given = {"dockerfile": {"dockerfile": str(secret)}, "context": {"context": str(tmp_path)},
             "both": {"dockerfile": str(secret), "context": "/"},
             "no_build": {"dockerfile": str(secret), "needs_build": False}}[environment]
    for mcp_sdk in (False, True):
        text = _tool_error(open_server.url, {"task": harbor_task(given)}, mcp_sdk)
        assert "metadata.harbor.environment." in text and "cannot name host files" in text, text
        assert "files: {path: text}" in text, text  # what to send instead
        assert "hostile-secret-line" not in text and "infra" not in text, text
    assert not any(open_server.sandbox_root.iterdir())  # nothing ran


def test_a_callers_task_with_only_an_image_is_not_a_host_path(open_server):
    """The rule is about host paths, not about Harbor: an image name is data (the local backend
    then says it cannot run images, as it does for any task)."""
    arguments = {"task": harbor_task({"image": "ubuntu:24.04"})}
    status, _, text = request(open_server.url + "/mcp", jsonrpc_call(arguments), {"Content-Type": "application/json"},
                              timeout=300)
    assert status == 200 and "cannot name host files" not in text, text[:500]


BENT_URLS = [
    ("{internal}/internal#", "fragment"),
    ("{internal}/internal?x=", "query string"),
    ("http://user:pw@127.0.0.1:{port}/v1", "user info"),
    ("{internal}/v1/../internal", "'..' segments"),
    ("{internal}/v1/%2e%2e/internal", "escapes"),
    ("file:///etc/passwd", "not an http(s) URL"),
    ("{internal}/v1", "not on this server's allowlist"),
    ("{internal}", "not on this server's allowlist"),
    ("http://127.0.0.1:{scripted}/v1@127.0.0.1:{port}/x", "user info"),
]


@pytest.mark.parametrize("url,what", BENT_URLS)
@pytest.mark.parametrize("argument", ["endpoint", "base_url"])
def test_a_callers_base_url_is_rebuilt_and_allowlisted(open_server, scripted_port, url, what, argument):
    """A base URL ending in `#` dropped the API path, so the server POSTed to any URL it could
    reach and returned the body. Now a caller's URL is parsed and rebuilt, and must be on the
    operator's allowlist; the host service is never reached."""
    internal = Upstream(200, b'{"secret": "internal-service-body-77c2"}')
    try:
        port = internal.httpd.server_address[1]
        url = url.format(internal=internal.url, port=port, scripted=scripted_port)
        if argument == "endpoint":
            arguments = {"endpoint": url, "model": "m", "api_key": "sk-caller-4242"}
        else:
            arguments = {"endpoint": "vllm", "base_url": url, "model": "m", "api_key": "sk-caller-4242"}
        arguments = with_solution({"instruction": "x", "verify": ["true"], **arguments})
        for mcp_sdk in (False, True):
            text = _tool_error(open_server.url, arguments, mcp_sdk)
            assert f"{argument}:" in text and what in text, text
            assert "internal-service-body" not in text and "sk-caller-4242" not in text, text
            if "allowlist" in what:
                assert "--allow-base-url" in text and "PI_ENV_ALLOWED_BASE_URLS" in text, text
        assert internal.requests == []  # never reached
        assert not any(open_server.sandbox_root.iterdir())
    finally:
        internal.close()


def test_the_allowlist_flag_and_variable_let_an_endpoint_through(tmp_path):
    """`--allow-base-url` (repeatable) and PI_ENV_ALLOWED_BASE_URLS add endpoints; the caller's
    URL is used as rebuilt (a trailing slash, a default port: the same endpoint); a catalog
    endpoint sent elsewhere does not carry the server's key."""
    by_flag = Upstream(401, b'{"error": {"message": "bad key"}}')
    by_env = Upstream(401, b'{"error": {"message": "bad key"}}')
    server = ServerProcess(tmp_path, PI_ENV_ALLOWED_BASE_URLS=by_env.url + "/v1", OPENAI_API_KEY="sk-server-owned-9090",
                           extra_args=["--allow-base-url", by_flag.url, "--allow-base-url", "http://10.9.9.9/v1"])
    try:
        for upstream in (by_flag, by_env):
            status, _, text = request(server.url + "/mcp", jsonrpc_call({
                "instruction": "x", "verify": ["true"], "endpoint": upstream.url + "/v1/", "model": "m",
                "api_key": "sk-caller-1", "max_turns": 1}), {"Content-Type": "application/json"}, timeout=300)
            assert status == 200 and "allowlist" not in text, text[:500]
            assert upstream.requests and all(line == "POST /v1/chat/completions" for line in upstream.requests
                                             if line.startswith("POST")), upstream.requests
        text = _tool_error(server.url, {"instruction": "x", "verify": ["true"], "endpoint": "openai",
                                        "base_url": by_env.url + "/v1", "model": "m"}, mcp_sdk=True)
        assert "base_url:" in text and "give your own api_key" in text, text
        text = _tool_error(server.url, {"instruction": "x", "verify": ["true"], "endpoint": "http://10.9.9.8/v1",
                                        "model": "m", "api_key": "k"}, mcp_sdk=True)
        assert "not on this server's allowlist" in text, text
    finally:
        server.stop()
        by_flag.close()
        by_env.close()


@pytest.mark.parametrize("body,content_type,shown,hidden", [
    (b"internal-page-6d0e\r\nSet-Cookie: session=abc123\x1b[31m" + b"x" * 5000, "text/html",
     "upstream error body not shown", ["internal-page-6d0e", "abc123", "\x1b", "xxxxxxxxxx"]),
    (json.dumps({"error": {"message": "model not found\n\x1b[2J Authorization: Bearer sk-echoed-77 "
                           + "y" * 5000}}).encode(), "application/json",
     "HTTP 404: model not found", ["sk-echoed-77", "\x1b", "\n", "y" * 400]),
])
def test_upstream_error_bodies_reach_the_caller_short_and_clean(tmp_path, body, content_type, shown,
                                                                hidden):
    upstream = Upstream(404, body, content_type)
    try:
        server = ServerProcess(tmp_path, PI_ENV_ALLOWED_BASE_URLS=upstream.url)
        try:
            status, _, text = request(server.url + "/mcp", jsonrpc_call({
                "instruction": "x", "verify": ["true"], "endpoint": upstream.url + "/v1", "model": "m",
                "api_key": "sk-caller-2", "max_turns": 1}), {"Content-Type": "application/json"}, timeout=300)
        finally:
            server.stop()
        assert status == 200, text[:500]
        result = json.loads(text)["result"]["structured_content"]
        errors = [turn["upstream_error"] for turn in result["proxy_turns"] if turn["upstream_error"]]
        assert errors and all(shown in error and len(error) <= 320 for error in errors), errors
        for error in errors:
            for secret in hidden:
                assert secret not in error, (secret, error)
        assert hidden[0] not in text  # nor anywhere else: the error, the logs, the agent's messages
    finally:
        upstream.close()


def test_a_callers_task_limits_only_lower_the_caps(open_server):
    """A task's own agent time limit (600 s) no longer replaces the cap (the call's 3 s): the
    agent's 40 s sleep is stopped at the cap."""
    task = {"instruction": "wait", "verify": ["true"], "timeouts": {"agent_s": 600},
            "solution": [{"tool": "bash", "command": "sleep 40"}]}
    status, _, text = request(open_server.url + "/mcp", jsonrpc_call({"task": task, "agent_timeout_s": 3}),
                              {"Content-Type": "application/json"}, timeout=300)
    assert status == 200, text[:300]
    result = json.loads(text)["result"]["structured_content"]
    assert result["stop_reason"] == "timeout" and result["wall_s"] < 20, (result["stop_reason"], result["wall_s"])


def test_task_memory_and_disk_only_lower_the_config_caps():
    from types import SimpleNamespace

    from pi_env import PiConfig
    from pi_env.agent import get_agent
    from pi_env.specs import sandbox_spec

    runtime = SimpleNamespace(root="/nonexistent", archive_dir=None, supports=lambda flag: True)
    config = PiConfig(limits={"max_total_memory_bytes": 1 << 30, "max_disk_bytes": 2 << 30})
    for limits, memory, disk in (({"memory_mb": 1 << 20, "storage_mb": 1 << 20}, 1 << 30, 2 << 30),
                                 ({"memory_mb": 512, "storage_mb": 256}, 512 << 20, 256 << 20),
                                 ({}, 1 << 30, 2 << 30)):
        task = PiTask.coerce({"instruction": "x", "limits": limits}) if limits else PiTask.coerce("x")
        spec = sandbox_spec(config, task, "local", get_agent(config), runtime, "/nonexistent.sock")
        assert (spec.limits.max_total_memory_bytes, spec.limits.max_disk_bytes) == (memory, disk), limits


def test_idle_sessions_are_closed_on_every_route(tmp_path):
    """PI_ENV_IDLE_TIMEOUT_S (here 2 s): an idle /ws socket is closed, an idle OpenEnv HTTP MCP
    session is reaped; a socket whose rollout runs longer than that is not idle."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server = ServerProcess(tmp_path, PI_ENV_IDLE_TIMEOUT_S="2")
    ws = server.url.replace("http", "ws") + "/ws"
    try:
        with connect(ws, open_timeout=10) as socket_:
            socket_.send(json.dumps({"type": "state"}))
            assert "episode_id" in socket_.recv(timeout=10)
            started = time.monotonic()
            with pytest.raises(ConnectionClosed):
                socket_.recv(timeout=30)
            assert time.monotonic() - started < 10
        with connect(ws, open_timeout=10) as socket_:  # busy for 6 s: not idle
            started = time.monotonic()
            socket_.send(json.dumps({"type": "step", "data": {"type": "call_tool", "tool_name": "run_rollout",
                                                              "arguments": {"task": sleeping_task(6)}}}))
            answer = json.loads(socket_.recv(timeout=120))  # the rollout's answer, not a close
            assert answer["type"] == "observation" and time.monotonic() - started > 5, str(answer)[:500]
        status, _, text = request(server.url + "/mcp", json.dumps({"jsonrpc": "2.0", "id": 1,
                                                                   "method": "openenv/session/create"}).encode(),
                                  {"Content-Type": "application/json"})
        session_id = json.loads(text)["result"]["session_id"]
        time.sleep(9)  # OpenEnv's reaper looks every 5 s at least
        with connect(ws + f"?session_id={session_id}", open_timeout=10) as socket_:
            assert "Unknown session_id" in socket_.recv(timeout=10)
    finally:
        server.stop()
