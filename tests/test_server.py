"""The OpenEnv server as users run it: `pi-env serve` in a subprocess on 127.0.0.1 (stopped by
its PID), driven by the official `mcp` SDK's streamable-HTTP client, by `PiEnv`, by OpenEnv's
own MCPToolClient and by plain HTTP. Rollouts are real (Pi in bubblewrap) against the oracle
endpoint or the scripted server."""

import asyncio
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers import processes_of_uid, wait_for
from pi_env import PiTask, RolloutResult
from pi_env.server.client import PiEnv, PiEnvError
from pi_env.server.limiter import ServerBusy
from pi_env.scripted import ScriptedServer, ScriptedToolCall, ScriptedTurn

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
FIZZBUZZ = json.loads((ROOT / "examples" / "fizzbuzz.json").read_text())
SANDBOX_UIDS = range(200000, 260000)


def sleeping_task(seconds: int, task_id: str = "sleeper") -> dict:
    """An oracle task whose agent runs `sleep <seconds>` (a marker to find its process by)."""
    return {"task_id": task_id, "instruction": "wait", "verify": ["true"],
            "solution": [{"tool": "bash", "command": f"sleep {seconds}"}]}


class ServerProcess:
    """`pi-env serve` on a free 127.0.0.1 port with its own sandbox root; stopped by its PID."""

    def __init__(self, tmp: Path, web: bool = False, extra_args: list[str] | None = None, **env: str):
        # Sandbox uids need o+x on every parent of the root; pytest's tmp dirs are private.
        self.sandbox_root = Path(tempfile.mkdtemp(prefix="pi-env-served-"))
        self.sandbox_root.chmod(0o711)
        self.log_path = tmp / "server.log"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        environment = {**os.environ, "PI_ENV_SANDBOX_ROOT": str(self.sandbox_root),
                       "ENABLE_WEB_INTERFACE": "true" if web else "false", **env}
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen([sys.executable, "-m", "pi_env.cli", "serve", "--port", str(self.port),
                                         *(extra_args or [])],
                                        env=environment, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if get(self.url + "/health", timeout=1)[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not answer /health within 120 s")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        shutil.rmtree(self.sandbox_root, ignore_errors=True)


def get(url: str, headers: dict | None = None, timeout: float = 10) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def sandbox_processes(marker: str) -> list[tuple[int, int]]:
    """(pid, uid) of sandbox processes whose command line contains `marker`."""
    return [(pid, uid) for uid in sandbox_uids_running() for pid, cmd in processes_of_uid(uid) if marker in cmd]


def sandbox_uids_running() -> set[int]:
    uids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except FileNotFoundError:
                continue
            if uid in SANDBOX_UIDS:
                uids.add(uid)
    return uids


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def scripted_port():
    """The port every scripted server of the module listens on: the pi-env servers allow it
    (PI_ENV_ALLOWED_BASE_URLS), as an operator allows its own model endpoint."""
    return free_port()


@pytest.fixture
def server(scripted_port):
    """A fresh scripted server (the conftest's), on the module's allowed port."""
    with ScriptedServer(port=scripted_port) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def served(tmp_path_factory, scripted_port):
    server = ServerProcess(tmp_path_factory.mktemp("served"), MAX_CONCURRENT_ENVS="2",
                           OPENAI_API_KEY="sk-server-side-secret-0123",
                           PI_ENV_ALLOWED_BASE_URLS=f"http://127.0.0.1:{scripted_port}")
    yield server
    server.stop()


async def mcp_call(url: str, arguments: dict, progress: list | None = None, headers: dict | None = None):
    """The official MCP SDK, streamable HTTP: initialize, list the tools, call run_rollout."""
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def on_progress(done, total, message):
        if progress is not None:
            progress.append(message)

    async with httpx.AsyncClient(headers=headers or {}, timeout=httpx.Timeout(30, read=600)) as http, \
            streamable_http_client(url + "/mcp", http_client=http) as (read, write, _), \
            ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        answer = await session.call_tool("run_rollout", arguments, progress_callback=on_progress)
        return tools, answer


def test_mcp_sdk_lists_the_tool_and_runs_an_oracle_rollout(served):
    progress = []
    tools, answer = asyncio.run(mcp_call(served.url, {"task": FIZZBUZZ}, progress))
    tool = next(t for t in tools.tools if t.name == "run_rollout")
    properties = tool.inputSchema["properties"]
    for name in ("endpoint", "base_url", "api_key", "model", "instruction", "setup", "verify", "task_id", "mode",
                 "disable_thinking", "max_tokens_cap", "top_logprobs", "agent_timeout_s", "files", "verify_files",
                 "solution", "max_turns", "task", "agent"):
        assert name in properties, name
    assert not answer.isError, answer.content
    result = RolloutResult.model_validate(answer.structuredContent)
    assert result.reward == 1.0 and result.error_kind is None and result.synthetic
    assert result.task_id == "fizzbuzz" and "fizzbuzz.py" in result.files
    assert json.loads(answer.content[0].text)["reward"] == 1.0  # the same JSON as text, for any MCP client
    # Progress notifications: each phase and each model call, as they happened.
    assert "verify started" in progress and progress[-1] == "done: reward 1.0"
    assert sum(message.startswith("model call") for message in progress) == len(result.proxy_turns) == 3


def test_piEnv_sync_context_manager_and_await(served):
    with PiEnv(served.url) as env:
        result = env.run_rollout(FIZZBUZZ)
        assert isinstance(result, RolloutResult) and result.reward == 1.0
        assert [t["name"] for t in env.list_tools()] == ["run_rollout"]

    async def run_async():
        async with PiEnv(served.url, timeout_s=300) as env:
            return await env.arun_rollout(PiTask.coerce(FIZZBUZZ), mode="transparent_proxy")

    result = asyncio.run(run_async())
    assert result.reward == 1.0 and result.mode == "transparent_proxy"
    assert all(len(turn.per_token_logps) == len(turn.completion_token_ids) > 0 for turn in result.proxy_turns)


def test_run_rollout_switches_the_agent_with_one_argument(served):
    with PiEnv(served.url) as env:
        result = env.run_rollout(FIZZBUZZ, agent="qwen-code")
    assert (result.agent, result.reward, result.error_kind) == ("qwen-code", 1.0, None)
    assert result.messages and len(result.proxy_turns) >= 2  # the gateway recorded every call
    with pytest.raises(Exception, match="agent: 'nope' is not one of"), PiEnv(served.url) as env:
        env.run_rollout(FIZZBUZZ, agent="nope")


def test_openenv_mcp_tool_client_reaches_the_same_tool(served):
    from openenv.core.mcp_client import MCPToolClient

    async def run():
        async with MCPToolClient(base_url=served.url, message_timeout_s=300) as env:
            names = [tool.name for tool in await env.list_tools()]
            return names, await env.call_tool("run_rollout", task=FIZZBUZZ)

    names, data = asyncio.run(run())
    assert names == ["run_rollout"]
    assert data["reward"] == 1.0 and data["task_id"] == "fizzbuzz"


def test_openenv_validate_url_passes(served):
    """What the README claims: OpenEnv's own validator, run against the live server."""
    openenv = Path(sys.executable).with_name("openenv")
    done = subprocess.run([str(openenv), "validate", "--url", served.url], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_health_docs_and_the_endpoint_catalog(served):
    assert get(served.url + "/health") == (200, '{"status":"healthy"}')
    status, docs = get(served.url + "/docs")
    assert status == 200 and "swagger" in docs.lower()
    status, schema = get(served.url + "/openapi.json")
    paths = json.loads(schema)["paths"]
    assert {"/health", "/metadata", "/endpoints", "/reset", "/step", "/state", "/schema", "/mcp"} <= set(paths)
    status, body = get(served.url + "/endpoints")
    catalog = {row["name"]: row for row in json.loads(body)["endpoints"]}
    assert set(catalog) == {"oracle", "vllm", "openai", "hf_router", "local"}
    assert catalog["oracle"]["configured"] and catalog["openai"]["configured"] and catalog["openai"]["key_set"]
    assert not catalog["local"]["configured"] and not catalog["hf_router"]["configured"]
    assert "sk-server-side-secret" not in body
    assert json.loads(body)["rollouts"]["max_running"] == 2


@pytest.mark.parametrize("arguments, expected", [
    ({"task": FIZZBUZZ, "instruction": "also this"}, "either `task` or the task fields"),
    ({"verify": ["true"]}, "instruction: required"),
    ({"instruction": ""}, "instruction: String should have at least 1 character"),
    ({"instruction": "x", "mode": "interception_gate"}, "mode: Input should be 'black_box' or 'transparent_proxy'"),
    ({"instruction": "x", "max_tokens_cap": "lots"}, "max_tokens_cap: Input should be a valid integer"),
    ({"instruction": "x", "top_logprobs": 50}, "top_logprobs: Input should be less than or equal to 20"),
    ({"instruction": "x", "files": {"../up": "x"}}, "files: files['../up']: '../up' contains '..'"),
    ({"instruction": "x"}, "endpoint: task 'task-"),  # the oracle needs a solution
    ({"instruction": "x", "endpoint": "hf_router"}, "endpoint: no model given for endpoint 'hf_router'"),
    ({"instruction": "x", "endpoint": "nowhere"}, "endpoint: unknown endpoint 'nowhere'"),
    ({"instruction": "x", "endpoint": "local"}, "endpoint: 'local' is not configured"),
    ({"instruction": "x", "max_turns": 0}, "max_turns: Input should be greater than 0"),
])
def test_bad_arguments_are_an_mcp_error_naming_the_field(served, arguments, expected):
    arguments = {**arguments, "api_key": "sk-caller-key-never-echoed"} if "endpoint" in arguments else arguments
    _, answer = asyncio.run(mcp_call(served.url, arguments))
    text = answer.content[0].text
    assert answer.isError and expected in text, text
    assert "Traceback" not in text and "sk-caller-key" not in text
    assert get(served.url + "/health")[0] == 200
    assert "sk-caller-key" not in served.log_path.read_text()


def test_a_request_api_key_is_never_logged_or_returned(served, server):
    """The caller's key reaches the upstream (the scripted server sees it) and nothing else:
    not the result (even when the agent goes looking for it), not the server's log."""
    key = server.add_script([ScriptedTurn(tool_calls=[ScriptedToolCall(
        name="bash", arguments={"command": "env; cat ~/.pi/agent/models.json; echo done > out.txt"})]),
        ScriptedTurn(text="finished")], api_key="sk-upstream-key-4242-abcdef")
    with PiEnv(served.url) as env:
        result = env.run_rollout(instruction="look around", verify=["test -f out.txt"], endpoint=server.base_url,
                                 model="scripted-model", api_key=key, mode="transparent_proxy")
    assert result.reward == 1.0 and len(result.proxy_turns) == 2
    assert server.requests[0].api_key == key  # the gateway sent it upstream
    # What the agent saw, read where no scrubbing can reach: its tool output, as sent upstream in
    # the next request. It read models.json (so it was looking) and found only the session token.
    seen = json.dumps([m for m in server.requests[1].body["messages"] if m["role"] == "tool"])
    assert '\\"apiKey\\"' in seen and "sk-upstream-key" not in seen
    assert "***" not in result.model_dump_json()  # the server had nothing to scrub
    assert key not in result.model_dump_json()
    assert key not in served.log_path.read_text()


def test_health_answers_in_milliseconds_while_rollouts_run(served):
    """MAX_CONCURRENT_ENVS (2 here) rollouts busy in worker threads; /health stays fast."""
    results = []
    callers = [threading.Thread(target=lambda i=i: results.append(
        PiEnv(served.url).run_rollout(sleeping_task(8, f"busy-{i}")))) for i in range(2)]
    for caller in callers:
        caller.start()
    wait_for(lambda: len(sandbox_processes("sleep 8")) >= 2, 60, "both rollouts' agents to run")
    latencies = []
    for _ in range(30):
        started = time.perf_counter()
        assert get(served.url + "/health", timeout=5)[0] == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.05)
    for caller in callers:
        caller.join(120)
    print(f"/health while 2 rollouts run: median {statistics.median(latencies) * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms")
    assert [r.reward for r in results] == [1.0, 1.0]
    assert statistics.median(latencies) < 0.1 and max(latencies) < 1.0  # generous: a shared 2-core machine


def test_busy_with_one_slot_and_four_simultaneous_calls(tmp_path):
    """MAX_CONCURRENT_ENVS=1, PI_ENV_MAX_QUEUE=2: one runs, two wait their turn, the fourth is
    told "busy" at once. Those that ran did so one after another."""
    served = ServerProcess(tmp_path, MAX_CONCURRENT_ENVS="1", PI_ENV_MAX_QUEUE="2")
    try:
        outcomes = []

        async def call(i):
            started = time.monotonic()
            try:
                result = await PiEnv(served.url).arun_rollout(sleeping_task(2, f"queued-{i}"))
                outcomes.append(("ok", result, time.monotonic() - started))
            except ServerBusy as error:
                outcomes.append(("busy", str(error), time.monotonic() - started))

        async def all_four():
            await asyncio.gather(*(call(i) for i in range(4)))

        asyncio.run(all_four())
        busy = [o for o in outcomes if o[0] == "busy"]
        done = sorted((o[1] for o in outcomes if o[0] == "ok"), key=lambda r: r.proxy_turns[0].timestamp)
        assert len(busy) == 1 and len(done) == 3, outcomes
        assert "MAX_CONCURRENT_ENVS=1" in busy[0][1] and busy[0][2] < 5  # refused at once, not after a wait
        assert all(result.reward == 1.0 for result in done)
        for earlier, later in zip(done, done[1:]):  # never two agents at once
            assert later.proxy_turns[0].timestamp >= earlier.proxy_turns[-1].timestamp
    finally:
        served.stop()


def test_client_disconnect_mid_rollout_leaves_no_sandbox(served):
    """An MCP client killed (SIGKILL, no goodbye) while its rollout runs: the server notices
    the dropped connection, kills the agent and deletes the sandbox."""
    client = subprocess.Popen([sys.executable, "-c", f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_server import mcp_call, sleeping_task
asyncio.run(mcp_call({served.url!r}, {{"task": sleeping_task(611)}}))
"""], cwd=ROOT)
    try:
        (pid, uid), = wait_for(lambda: sandbox_processes("sleep 611"), 60, "the agent's sleep to start")
        assert any(served.sandbox_root.iterdir())
        client.kill()
        client.wait(10)
        wait_for(lambda: not processes_of_uid(uid), 20, "the sandbox's processes to be killed")
        wait_for(lambda: not any(served.sandbox_root.iterdir()), 20, "the sandbox dir to be deleted")
        wait_for(lambda: json.loads(get(served.url + "/endpoints")[1])["rollouts"]["running"] == 0, 10,
                 "the slot to be released")
    finally:
        if client.poll() is None:
            client.kill()


def test_auth_token_guards_every_route_but_health(tmp_path):
    served = ServerProcess(tmp_path, web=True, PI_ENV_AUTH_TOKEN="s3cret-token")
    try:
        assert get(served.url + "/health")[0] == 200
        for path in ("/docs", "/endpoints", "/metadata", "/web/", "/openapi.json"):
            assert get(served.url + path)[0] == 401, path
            assert get(served.url + path, {"Authorization": "Bearer wrong"})[0] == 401, path
        assert get(served.url + "/endpoints", {"Authorization": "Bearer s3cret-token"})[0] == 200
        assert get(served.url + "/web/", {"Authorization": "Bearer s3cret-token"})[0] == 200
        with pytest.raises(PiEnvError, match="401"):
            PiEnv(served.url).run_rollout(FIZZBUZZ)
        with pytest.raises(PiEnvError, match="401"):
            PiEnv(served.url, token="wrong").run_rollout(FIZZBUZZ)
        assert PiEnv(served.url, token="s3cret-token").run_rollout(FIZZBUZZ).reward == 1.0
        # A browser signs in with the form at /web (never a token in a URL): the cookie opens the
        # UI, not the API; page scripts cannot read it (HttpOnly), other sites' requests do not
        # carry it (SameSite), the API never sees it (Path=/web). test_server_hostile.py tests
        # the cookie and the Origin checks in depth.
        first_hop = http.client.HTTPConnection(*urllib.parse.urlsplit(served.url).netloc.split(":"), timeout=10)
        first_hop.request("POST", "/web/login", "token=s3cret-token", {"Origin": served.url})
        cookie = first_hop.getresponse().getheader("set-cookie") or ""
        first_hop.close()
        assert {"HttpOnly", "SameSite=Strict", "Path=/web"} <= {part.strip() for part in cookie.split(";")}, cookie
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        sign_in = urllib.request.Request(served.url + "/web/login", b"token=s3cret-token", {"Origin": served.url})
        with opener.open(sign_in, timeout=10) as response:
            assert response.status == 200 and response.url.endswith("/web/")
        with pytest.raises(urllib.error.HTTPError, match="401"):
            opener.open(served.url + "/endpoints", timeout=10)
    finally:
        served.stop()
    assert "s3cret-token" not in served.log_path.read_text()


def test_load_sixteen_concurrent_calls_with_four_slots(tmp_path):
    """Bounded load: 16 simultaneous run_rollout calls (oracle), MAX_CONCURRENT_ENVS=4, the
    default queue (16): every call completes (none needs the busy answer); memory before/after
    reported; no sandbox or agent process left."""
    served = ServerProcess(tmp_path, MAX_CONCURRENT_ENVS="4")
    try:
        PiEnv(served.url).run_rollout(FIZZBUZZ)  # warm: runtime checks, first imports
        before = served.rss_mb()

        async def sixteen():
            env = PiEnv(served.url, timeout_s=600)
            return await asyncio.gather(*(env.arun_rollout({**FIZZBUZZ, "task_id": f"load-{i}"}) for i in range(16)),
                                        return_exceptions=True)

        started = time.monotonic()
        outcomes = asyncio.run(sixteen())
        elapsed = time.monotonic() - started
        after = served.rss_mb()
        print(f"16 rollouts, 4 slots: {elapsed:.1f} s; server RSS {before:.0f} MB before, {after:.0f} MB after")
        assert all(isinstance(o, RolloutResult) and o.reward == 1.0 for o in outcomes), outcomes
        assert sorted(o.task_id for o in outcomes) == sorted(f"load-{i}" for i in range(16))
        assert json.loads(get(served.url + "/endpoints")[1])["rollouts"] == {
            "running": 0, "waiting": 0, "max_running": 4, "max_waiting": 16}
        wait_for(lambda: not any(served.sandbox_root.iterdir()), 20, "every sandbox dir to be deleted")
        assert after - before < 300, (before, after)
    finally:
        served.stop()


def test_stopping_the_server_mid_rollout_leaves_no_sandbox(tmp_path):
    served = ServerProcess(tmp_path)
    raised = []  # the caller's outcome, asserted on this thread (a failure in a thread is only a warning)

    def call():
        try:
            PiEnv(served.url).run_rollout(sleeping_task(612))
            raised.append(None)
        except Exception as error:  # noqa: BLE001 - asserted below
            raised.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    try:
        (pid, uid), = wait_for(lambda: sandbox_processes("sleep 612"), 60, "the agent's sleep to start")
        served.process.send_signal(signal.SIGINT)
        served.process.wait(40)
        assert not processes_of_uid(uid)
        assert not any(served.sandbox_root.iterdir())
    finally:
        served.stop()
    # The MCP SDK alone would wait out the call's whole timeout (python-sdk#1577); PiEnv's
    # watchdog ends it with a clear error soon after the server's stream closed.
    caller.join(60)
    assert raised and isinstance(raised[0], PiEnvError), raised
    assert "without an answer" in str(raised[0]) or "ConnectError" in str(raised[0]), raised
