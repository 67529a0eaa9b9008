"""The model gateway over real sockets (Unix and TCP), against the scripted server; the Node
forwarder; the background event loop."""

import asyncio
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from helpers import free_port, wait_for

import pi_env.proxy
from pi_env._aio import background_loop, run_sync
from pi_env.proxy import Upstream
from pi_env.proxy.policy import MAX_REQUEST_BYTES, RESTRICTED_FIELDS, SessionLimits
from pi_env.scripted import Fault, ScriptedTurn

FORWARDER = Path(pi_env.proxy.__file__).with_name("forward.mjs")
REAL_KEY = "sk-real-upstream-key-0123456789"
BODY = {
    "model": "m",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "hi"}],
}


def upstream(server, turns, **kwargs):
    return Upstream(server.base_url, server.add_script(turns, api_key=REAL_KEY), **kwargs)


async def _call(url, token, body=BODY, *, unix=None, method="POST", read=True, raw: bytes | None = None):
    connector = aiohttp.UnixConnector(path=unix) if unix else aiohttp.TCPConnector()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    content = {"data": raw, "headers": {**headers, "Content-Type": "application/json"}} if raw is not None \
        else {"json": body, "headers": headers}
    async with aiohttp.ClientSession(connector=connector) as client:
        async with client.request(method, url, **content) as r:
            return r.status, r.headers, await r.read()


def call(gateway, session_or_token, path="/chat/completions", *, unix=False, **kwargs):
    token = getattr(session_or_token, "token", session_or_token)
    if unix:
        return asyncio.run(_call("http://gateway/v1" + path, token, unix=gateway.socket_path, **kwargs))
    return asyncio.run(_call(gateway.tcp_base_url + path, token, **kwargs))


def data_events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


# --------------------------------------------------------------------------------- relaying


@pytest.mark.parametrize("unix", [True, False], ids=["unix", "tcp"])
def test_relays_stream_with_the_real_key(gateway, server, unix):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="hello there", chunk_chars=3)]))
    try:
        status, headers, raw = call(gateway, session, unix=unix)
    finally:
        gateway.close_session(session)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["x-pi-env-synthetic"] == "1"  # upstream headers reach the agent
    events = data_events(raw)
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e)["choices"])
    assert text == "hello there"

    (received,) = server.requests
    assert received.headers["authorization"] == f"Bearer {REAL_KEY}"
    assert all(session.token not in value for value in received.headers.values())
    assert received.body == BODY

    (turn,) = session.turns
    assert turn.turn == 0 and turn.upstream_status == 200 and turn.upstream_error is None
    assert turn.request_bytes == len(json.dumps(BODY)) and turn.response_bytes == len(raw)
    assert 0 < turn.ttfb_s <= turn.latency_s and not turn.client_disconnected
    assert abs(turn.started_at - time.time()) < 60


def test_only_model_routes_are_relayed_and_listing_is_not_a_turn(gateway, server):
    session = gateway.open_session(upstream(server, []))
    status, _, raw = call(gateway, session, "/models", method="GET", body=None)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "scripted"
    assert server.requests[0].path == "/v1/models"
    assert session.turns == []
    for method, path in (("GET", "/files"), ("POST", "/files"), ("DELETE", "/models/scripted"), ("POST", "/embeddings")):
        status, _, raw = call(gateway, session, path, method=method, body=None if method != "POST" else {})
        assert status == 403 and json.loads(raw)["error"]["type"] == "route_not_allowed"
    assert len(server.requests) == 1  # only the models listing reached the upstream
    gateway.close_session(session)


def test_no_key_means_no_authorization_header(gateway, server):
    server.set_default([ScriptedTurn(text="open")])
    session = gateway.open_session(Upstream(server.base_url, None))
    status, _, _ = call(gateway, session)
    assert status == 200 and "authorization" not in server.requests[0].headers
    gateway.close_session(session)


@pytest.mark.parametrize("token", [None, "not-a-session-token"])
def test_unknown_token_is_refused_without_contacting_upstream(gateway, server, token):
    server.set_default([ScriptedTurn(text="should not be served")])
    status, _, raw = call(gateway, token)
    assert status == 401 and json.loads(raw)["error"]["type"] == "invalid_session_token"
    assert server.requests == []


def test_closed_session_token_is_revoked(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="x")]))
    gateway.close_session(session)
    assert call(gateway, session)[0] == 401 and server.requests == []


def test_upstream_error_status_and_body_reach_the_agent(gateway, server):
    error = {"error": {"message": "model overloaded", "type": "server_error"}}
    session = gateway.open_session(upstream(server, [ScriptedTurn(fault=Fault(http_status=500, body=error))]))
    status, headers, raw = call(gateway, session)
    assert status == 500 and json.loads(raw) == error
    assert headers["Content-Type"].startswith("application/json")
    (turn,) = session.turns
    assert turn.upstream_status == 500 and json.loads(turn.upstream_error) == error
    gateway.close_session(session)


def test_upstream_error_body_is_truncated_in_the_record(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(fault=Fault(http_status=400, body="e" * 10_000))]))
    status, _, raw = call(gateway, session)
    assert status == 400 and len(raw) == 10_000  # the agent gets all of it
    assert session.turns[0].upstream_error == "e" * 4096
    gateway.close_session(session)


def test_unreachable_upstream_is_a_502(gateway):
    port = free_port()  # closed again: nothing listens there
    session = gateway.open_session(Upstream(f"http://127.0.0.1:{port}/v1", REAL_KEY))
    status, _, raw = call(gateway, session)
    error = json.loads(raw)["error"]
    assert status == 502 and error["type"] == "upstream_unreachable"
    assert error["message"].startswith(f"pi-env gateway: upstream 127.0.0.1:{port} unreachable: ")
    assert REAL_KEY not in raw.decode()
    (turn,) = session.turns
    assert turn.upstream_status is None and "unreachable" in turn.upstream_error
    gateway.close_session(session)


def test_upstream_silent_past_the_read_timeout_is_a_502(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="late", fault=Fault(hang_s=5))]))
    started = time.monotonic()
    status, _, raw = call(gateway, session)
    assert status == 502 and json.loads(raw)["error"]["type"] == "upstream_unreachable"
    assert time.monotonic() - started < 4  # the gateway's read timeout (2 s), not the hang
    gateway.close_session(session)


def test_a_sessions_own_read_timeout_wins(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="late", fault=Fault(hang_s=5))],
                                            read_timeout_s=0.5))
    started = time.monotonic()
    status, _, _ = call(gateway, session)
    assert status == 502 and time.monotonic() - started < 1.8  # 0.5 s (+ load), not the gateway's 2 s
    gateway.close_session(session)


def test_upstream_dying_mid_stream_fails_the_agent_call(gateway, server):
    turns = [ScriptedTurn(text="x" * 50, chunk_chars=1, fault=Fault(disconnect_after_chunks=5))]
    session = gateway.open_session(upstream(server, turns))
    with pytest.raises(aiohttp.ClientPayloadError):
        call(gateway, session, unix=True)
    (turn,) = session.turns
    assert turn.upstream_status == 200 and turn.upstream_error.startswith("upstream stream broken")
    assert turn.response_bytes > 0 and not turn.client_disconnected and turn.upstream_broke
    gateway.close_session(session)


def test_agent_hanging_up_cancels_upstream_and_is_recorded(gateway, server):
    # 40 chunks 0.1 s apart: 4 s if the gateway kept reading after the agent left.
    turns = [ScriptedTurn(text="x" * 40, chunk_chars=1, fault=Fault(delay_s=0.1))]
    session = gateway.open_session(upstream(server, turns))

    async def read_one_chunk_then_leave():
        headers = {"Authorization": f"Bearer {session.token}"}
        async with aiohttp.ClientSession() as client:
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=BODY, headers=headers) as r:
                assert await r.content.readany()

    started = time.monotonic()
    asyncio.run(read_one_chunk_then_leave())
    wait_for(lambda: session.turns)
    assert time.monotonic() - started < 2
    (turn,) = session.turns
    assert turn.client_disconnected and turn.upstream_status == 200 and turn.upstream_error is None
    assert not turn.upstream_broke  # the agent's doing: never an endpoint failure
    gateway.close_session(session)


def test_agent_hanging_up_before_headers_cancels_upstream(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="late", fault=Fault(hang_s=1.5))]))
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(_call(gateway.tcp_base_url + "/chat/completions", session.token), 0.2))
    time.sleep(0.8)  # well before upstream would answer (1.5 s) or time out (2 s)
    (turn,) = session.turns
    assert turn.client_disconnected and turn.upstream_status is None
    gateway.close_session(session)


def test_stream_is_relayed_as_it_arrives(gateway, server):
    turns = [ScriptedTurn(text="abc", chunk_chars=1, fault=Fault(delay_s=0.3))]
    session = gateway.open_session(upstream(server, turns))

    async def first_and_last():
        headers = {"Authorization": f"Bearer {session.token}"}
        connector = aiohttp.UnixConnector(path=gateway.socket_path)
        async with aiohttp.ClientSession(connector=connector) as client:
            started = time.monotonic()
            async with client.post("http://gateway/v1/chat/completions", json=BODY, headers=headers) as r:
                first = await r.content.readany()
                first_at = time.monotonic() - started
                await r.read()
                return first, first_at, time.monotonic() - started

    first, first_at, total = asyncio.run(first_and_last())
    assert b'"role": "assistant"' in first and b"[DONE]" not in first
    assert first_at < 0.25 and total >= 0.3 * 6  # 7 events, 0.3 s apart
    assert session.turns[0].ttfb_s < 0.25
    gateway.close_session(session)



@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
def test_a_relay_that_falls_behind_still_sends_every_byte(gateway, server, mode, monkeypatch):
    """A relay slower than its upstream reads from a buffer the upstream has filled to its end:
    the answer must reach the agent whole, never cleanly cut where the upstream's end was seen
    while bytes were still buffered."""
    from pi_env.proxy.wire import RelayedResponse

    write = RelayedResponse.write

    async def slow_write(self, data):
        await write(self, data)
        await asyncio.sleep(0.002)  # the upstream runs ahead of the agent

    monkeypatch.setattr(RelayedResponse, "write", slow_write)
    turns = [ScriptedTurn(text="abcd" * 4000, chunk_chars=4)] * 6
    session = gateway.open_session(upstream(server, turns), mode=mode)
    for _ in turns:
        status, _, raw = call(gateway, session)
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_json(raw) if e["choices"]) \
            == "abcd" * 4000
    assert session.wait_idle() and {t.response_bytes for t in session.turns} == {len(raw)}
    gateway.close_session(session)



@pytest.fixture
def engine_process(tmp_path):
    """A scripted server in a process of its own, streaming like an engine (not sharing the
    gateway's event loop): its base URL. Answers by key: "fast" (3,000 pieces as fast as it can
    write them), "paced" (400 events ~3 ms apart, like an engine) and "slow" (8 events 20 ms
    apart)."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"scripts": {
        "fast": [{"text": "abcd" * 3000, "chunk_chars": 4}],
        "paced": [{"text": "abcd" * 400, "chunk_chars": 4, "fault": {"delay_s": 0.003}}],
        "slow": [{"text": "abcdef", "chunk_chars": 1, "fault": {"delay_s": 0.02}}]}}))
    proc = subprocess.Popen([sys.executable, "-m", "pi_env.scripted", "--port", "0", "--script", str(script)],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc.stdout.readline().strip().rsplit(" ", 1)[1]
    finally:
        proc.terminate()
        proc.wait(10)


def relayed_writes(gateway, base_url, key, monkeypatch) -> tuple[int, bytes]:
    """How many sends the gateway made to relay one answer (black_box), and what the agent got."""
    from pi_env.proxy.wire import RelayedResponse

    writes, write = [], RelayedResponse.write

    async def counted(self, data):
        writes.append(len(data))
        await write(self, data)

    monkeypatch.setattr(RelayedResponse, "write", counted)
    session = gateway.open_session(Upstream(base_url, key))
    status, _, raw = call(gateway, session)
    gateway.close_session(session)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    return len(writes), raw


def test_a_fast_stream_is_relayed_in_batches_and_a_slow_one_as_it_arrives(gateway, engine_process, monkeypatch):
    sends, raw = relayed_writes(gateway, engine_process, "fast", monkeypatch)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_json(raw) if e["choices"])
    assert content == "abcd" * 3000
    assert sends < 100, f"{sends} sends to relay 3,000 pieces that came as fast as they could"
    sends, _ = relayed_writes(gateway, engine_process, "slow", monkeypatch)
    assert sends >= 6, f"{sends} sends for 8 events 20 ms apart: a slow stream must not wait"


def test_a_paced_stream_is_gathered_more_the_longer_it_streams(gateway, engine_process, monkeypatch):
    """An engine's pace (a token every few ms) is slower than the base window, yet waking once a
    token is what costs the gateway most: the window grows with the answer's age (relay_window),
    so a paced answer goes out in far fewer sends, none held back long."""
    from pi_env.proxy.wire import RELAY_BATCH_MAX_S, RELAY_BATCH_S, relay_window

    assert relay_window(0.0) == RELAY_BATCH_S and relay_window(3600.0) == RELAY_BATCH_MAX_S
    assert RELAY_BATCH_S < relay_window(0.5) < RELAY_BATCH_MAX_S
    sends, raw = relayed_writes(gateway, engine_process, "paced", monkeypatch)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_json(raw) if e["choices"])
    assert content == "abcd" * 400
    # One send a window: ~150 here. The read right after a pause used to catch one more piece and
    # send it alone (~215): a wake-up a window for one token.
    assert sends < 185, f"{sends} sends to relay 400 pieces ~3 ms apart"

# --------------------------------------------------------------------------- budget, traces


def sse_json(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def test_max_turns_ends_the_turn_cleanly_past_the_budget(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="a"), ScriptedTurn(text="b")]), max_turns=2)
    assert call(gateway, session)[0] == 200
    assert call(gateway, session)[0] == 200
    assert not session.budget_exhausted
    status, headers, raw = call(gateway, session)
    assert status == 200 and headers["x-pi-env-budget"] == "max_turns"
    chunks = sse_json(raw)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and raw.endswith(b"data: [DONE]\n\n")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    assert session.budget_exhausted == "max_turns" and len(server.requests) == 2 and len(session.turns) == 2
    status, _, raw = call(gateway, session, body={**BODY, "stream": False})
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "stop"
    gateway.close_session(session)


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
def test_token_budget_counts_usage_and_stops_further_calls(gateway, server, mode):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="x" * 40)] * 5), mode=mode,
                                   max_total_tokens=1)
    assert call(gateway, session)[0] == 200
    assert session.wait_idle(5)  # capturing modes record just after the agent has its answer
    assert session.tokens_used == session.turns[0].total_tokens > 1
    status, headers, _ = call(gateway, session)
    assert headers["x-pi-env-budget"] == "max_total_tokens" and session.budget_exhausted == "max_total_tokens"
    assert len(server.requests) == 1
    gateway.close_session(session)


def test_trace_file_gets_one_flushed_line_per_turn(gateway, server, tmp_path):
    trace = tmp_path / "deep" / "trace.jsonl"
    turns = [ScriptedTurn(text="a"), ScriptedTurn(fault=Fault(http_status=500))]
    session = gateway.open_session(upstream(server, turns), trace_path=str(trace))
    call(gateway, session)
    lines = trace.read_text().splitlines()  # readable while the session is still open
    assert len(lines) == 1 and json.loads(lines[0])["upstream_status"] == 200
    server.set_default(None)
    body = {**BODY, "messages": BODY["messages"] + [{"role": "assistant", "content": "a"}]}
    call(gateway, session, body=body)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["turn"] for r in records] == [0, 1] and records[1]["upstream_status"] == 500
    assert set(records[0]) == {"turn", "started_at", "latency_s", "ttfb_s", "upstream_status", "upstream_error",
                               "request_bytes", "response_bytes", "client_disconnected", "upstream_broke", "streamed", "total_tokens",
                               "reserved_tokens", "policy_version", "policy_version_source", "replica",
                               "failed_over", "dialect", "dialect_notes", "capture"}
    gateway.close_session(session)


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
def test_turns_keep_the_agents_order_when_a_slow_first_answer_finishes_last(gateway, server, mode):
    """Call 0 is slow, call 1 (sent while 0 is still streaming) ends first: its record finishes
    first, yet `turns` and the training view list them in the order the agent made them."""
    turns = [ScriptedTurn(text="slow first answer", chunk_chars=2, fault=Fault(delay_s=0.05)), ScriptedTurn(text="b")]
    session = gateway.open_session(upstream(server, turns), mode=mode)
    second = {**BODY, "messages": BODY["messages"] + [{"role": "assistant", "content": "slow first answer"},
                                                      {"role": "user", "content": "go on"}]}
    finished = []
    session.on_record = lambda record: finished.append(record.turn)

    async def both():
        first = asyncio.ensure_future(_call(gateway.tcp_base_url + "/chat/completions", session.token))
        while not session.turns and session._calls_started < 1:  # call 0 claimed its index first
            await asyncio.sleep(0.005)
        await _call(gateway.tcp_base_url + "/chat/completions", session.token, body=second)
        await first

    try:
        asyncio.run(both())
        assert session.wait_idle()
    finally:
        gateway.close_session(session)
    assert finished == [1, 0]  # the slow answer's record really finished last
    assert [t.turn for t in session.turns] == [0, 1]
    if mode == "transparent_proxy":
        from pi_env.turns import rollout_turn
        from pi_env.training import build_training_trace

        turns = [rollout_turn(record) for record in reversed(session.turns)]  # handed over in finish order
        assert [t.turn for t in build_training_trace(turns).turns] == [0, 1]


def test_unknown_mode_is_rejected(gateway, server):
    with pytest.raises(ValueError, match="unknown gateway mode"):
        gateway.open_session(Upstream(server.base_url, REAL_KEY), mode="no_such_mode")


def test_key_never_in_repr_or_logs(gateway, server, caplog):
    caplog.set_level(logging.DEBUG)
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="x"), ScriptedTurn(fault=Fault(http_status=500))]),
                                   mode="black_box")
    call(gateway, session)
    call(gateway, session, body={**BODY, "messages": BODY["messages"] + [{"role": "assistant", "content": "x"}]})
    dead = gateway.open_session(Upstream(f"http://127.0.0.1:{free_port()}/v1", REAL_KEY, headers={"X-Secret": REAL_KEY}))
    assert call(gateway, dead)[0] == 502
    shown = " ".join([repr(session), repr(session.upstream), repr(dead), repr(dead.upstream), repr(gateway),
                      repr(session.turns), repr(dead.turns), caplog.text])
    assert REAL_KEY not in shown and session.token not in shown
    gateway.close_session(session)
    gateway.close_session(dead)


def test_socket_is_reachable_by_other_uids(gateway):
    assert os.stat(gateway.socket_path).st_mode & 0o777 == 0o666
    assert os.stat(os.path.dirname(gateway.socket_path)).st_mode & 0o777 == 0o711


def test_health(gateway):
    status, _, raw = asyncio.run(_call(gateway.tcp_base_url.removesuffix("/v1") + "/health", None, None, method="GET"))
    assert status == 200 and json.loads(raw) == {"ok": True}


# ------------------------------------------------------------------------- the Node forwarder

NODE = shutil.which("node")
FETCH_JS = """
const r = await fetch("http://127.0.0.1:%d/v1/chat/completions", {
  method: "POST",
  headers: {"content-type": "application/json", authorization: "Bearer %s"},
  body: JSON.stringify(%s),
});
console.log(JSON.stringify({status: r.status, body: await r.text()}));
"""


def run_node(script: str, env: dict, timeout=20) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([NODE, "--import", str(FORWARDER), "--input-type=module", "-e", script],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_forwarder_pipes_tcp_to_the_gateway_socket_and_lets_node_exit(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="via node")]))
    port = free_port()
    env = {"PI_ENV_GATEWAY_SOCKET": gateway.socket_path, "PI_ENV_GATEWAY_PORT": str(port)}
    proc, elapsed = run_node(FETCH_JS % (port, session.token, json.dumps(BODY)), env)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    events = data_events(answer["body"].encode())
    assert answer["status"] == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "via node"
    assert elapsed < 5  # exits by itself: nothing the forwarder made keeps node alive
    assert server.requests[0].headers["authorization"] == f"Bearer {REAL_KEY}"
    assert session.turns[0].upstream_status == 200
    gateway.close_session(session)


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_forwarder_ignores_a_taken_port(gateway):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = {"PI_ENV_GATEWAY_SOCKET": gateway.socket_path, "PI_ENV_GATEWAY_PORT": str(port)}
        proc, elapsed = run_node("console.log('cli ran')", env)
    assert proc.returncode == 0 and proc.stdout == "cli ran\n" and proc.stderr == ""
    assert elapsed < 5


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_forwarder_answers_502_when_the_gateway_socket_is_missing(tmp_path):
    port = free_port()
    missing = str(tmp_path / "absent.sock")
    env = {"PI_ENV_GATEWAY_SOCKET": missing, "PI_ENV_GATEWAY_PORT": str(port)}
    proc, elapsed = run_node(FETCH_JS % (port, "t", json.dumps(BODY)), env)
    answer = json.loads(proc.stdout)
    assert answer["status"] == 502 and elapsed < 5
    error = json.loads(answer["body"])["error"]
    assert error["type"] == "gateway_unreachable" and missing in error["message"]


# ---------------------------------------------------------------------- the background loop


def test_background_loop_is_one_shared_loop():
    loops = []
    threads = [threading.Thread(target=lambda: loops.append(background_loop())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(loop) for loop in loops}) == 1 and loops[0].is_running()


def test_run_sync_returns_raises_and_times_out():
    async def value():
        return threading.current_thread().name

    async def boom():
        raise KeyError("x")

    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    assert run_sync(value()) == "pi-env-event-loop"
    with pytest.raises(KeyError):
        run_sync(boom())
    with pytest.raises(TimeoutError):
        run_sync(slow(), timeout=0.05)
    assert cancelled.wait(2)


def test_run_sync_on_the_loop_thread_refuses_instead_of_deadlocking():
    async def nested():
        inner = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="event loop thread"):
            run_sync(inner)

    run_sync(nested())


def test_get_gateway_is_one_per_process():
    from pi_env.proxy import get_gateway

    gateway = get_gateway()
    assert get_gateway() is gateway and os.path.exists(gateway.socket_path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child must not reuse the parent's (unserved) gateway
        child = get_gateway()
        os.write(write, b"own" if child is not gateway and child.socket_path != gateway.socket_path else b"same")
        child.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 10) == b"own"
    assert asyncio.run(_call(gateway.tcp_base_url.removesuffix("/v1") + "/health", None, None, method="GET"))[0] == 200


# ------------------------------------------------------------------ what the agent cannot do


def raw_http(port: int, target: str, token: str, body: bytes = b"{}", method: str = "POST") -> tuple[int, bytes]:
    """One request with exactly this request target (clients normalise theirs)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {token}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


@pytest.mark.parametrize("target", [
    "http://evil.example/v1/chat/completions",  # absolute form: another host, with the real key
    "/v1/chat%2Fcompletions", "/v1/chat/completions%3Fx", "/v1/x/../chat/completions", "/v1/./chat/completions",
    "/v1//chat/completions", "/v1/chat/completions/", "/v1/chat/completions?api-version=1",
    "/v1/chat/completions#frag", "/v1/models/../files",
])
def test_only_the_exact_routes_reach_the_upstream(gateway, server, target):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")] * 2))
    body = json.dumps(BODY).encode()
    status, _ = raw_http(gateway.tcp_port, target, session.token, body)
    assert status in (403, 404) and server.requests == []
    status, _ = raw_http(gateway.tcp_port, "/v1/chat/completions", session.token, body)
    assert status == 200 and [r.path for r in server.requests] == ["/v1/chat/completions"]
    gateway.close_session(session)


@pytest.mark.parametrize(("sent", "cap", "forwarded"), [
    ({"n": 64, "best_of": 8, "max_tokens": 1000000.0}, 100, {"n": 1, "best_of": 1, "max_tokens": 100}),
    ({"n": 64, "max_tokens": 1000000.0}, None, {"n": 1, "max_tokens": 1000000}),
    ({"max_tokens": "5000", "max_completion_tokens": True}, 100, {"max_tokens": 100, "max_completion_tokens": 100}),
    ({"max_tokens": "12.7"}, None, {"max_tokens": 12}),
    ({"max_tokens": "lots"}, None, {}),
    ({"n": 1, "max_tokens": 50}, 100, {"n": 1, "max_tokens": 50}),
])
def test_one_choice_and_integer_token_limits_within_the_cap(gateway, server, sent, cap, forwarded):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]), max_tokens_cap=cap)
    assert call(gateway, session, body={**BODY, **sent})[0] == 200
    (received,) = server.requests
    got = {k: received.body[k] for k in ("n", "best_of", "max_tokens", "max_completion_tokens") if k in received.body}
    assert got == forwarded and all(type(v) is int for v in got.values())
    gateway.close_session(session)


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
def test_token_budget_counts_streams_that_did_not_ask_for_usage(gateway, server, mode):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="x" * 80)] * 8), mode=mode,
                                   max_total_tokens=60)
    body = {k: v for k, v in BODY.items() if k != "stream_options"}
    for i in range(8):
        messages = body["messages"] + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}] * i
        call(gateway, session, body={**body, "messages": messages})
    session.wait_idle(5)
    assert all(turn.total_tokens for turn in session.turns)
    assert session.tokens_used >= 60 and session.budget_exhausted == "max_total_tokens"
    assert len(server.requests) <= 3  # each answer costs 20 tokens plus its prompt
    assert all(r.body["max_tokens"] <= 60 for r in server.requests)
    gateway.close_session(session)


def test_concurrent_calls_cannot_overrun_the_token_budget(gateway, server):
    server.set_default([ScriptedTurn(text="y" * 40, fault=Fault(delay_s=0.05))])
    session = gateway.open_session(Upstream(server.base_url, None), max_total_tokens=50)

    async def burst():
        return await asyncio.gather(*(_call(gateway.tcp_base_url + "/chat/completions", session.token)
                                      for _ in range(8)))

    answers = asyncio.run(burst())
    assert [status for status, _, _ in answers] == [200] * 8
    assert len(server.requests) == 1 and server.requests[0].body["max_tokens"] == 50  # all it may use
    assert sum("x-pi-env-budget" in headers for _, headers, _ in answers) == 7
    gateway.close_session(session)


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
@pytest.mark.parametrize("stream", [True, False])
def test_upstream_key_is_masked_in_relayed_and_recorded_errors(gateway, server, mode, stream):
    echo = {"error": {"message": f"bad request; headers were Authorization: Bearer {REAL_KEY}, "
                                 f"X-Org: org-secret-value-42", "type": "invalid_request_error"}}
    session = gateway.open_session(upstream(server, [ScriptedTurn(fault=Fault(http_status=400, body=echo))],
                                            headers={"X-Org": "org-secret-value-42"}), mode=mode)
    status, _, raw = call(gateway, session, body={**BODY, "stream": stream})
    assert status == 400 and b"headers were Authorization: Bearer ***, X-Org: ***" in raw
    session.wait_idle(5)
    for text in (raw.decode(), session.turns[0].upstream_error, json.dumps(session.turns[0].to_json())):
        assert REAL_KEY not in text and "org-secret-value-42" not in text
    gateway.close_session(session)


def test_a_key_echoed_json_escaped_or_url_encoded_is_masked_too(gateway, server):
    """A key with a quote, a backslash and non-ASCII comes back from an upstream's JSON error
    escaped (and in a URL URL-encoded): every form is masked before the agent or a record sees it."""
    from urllib.parse import quote

    key = 'sk-"odd"\\key-ключ-0123'
    echo = {"error": {"message": f"invalid key {key}", "url": f"/v1/check?key={quote(key, safe='')}"}}
    session = gateway.open_session(Upstream(server.base_url, server.add_script(
        [ScriptedTurn(fault=Fault(http_status=401, body=echo))], api_key=key)))
    status, _, raw = call(gateway, session)
    session.wait_idle(5)
    forms = {key, json.dumps(key)[1:-1], json.dumps(key, ensure_ascii=False)[1:-1], quote(key, safe="")}
    assert status == 401 and raw.count(b"***") == 2, raw
    for text in (raw.decode(), session.turns[0].upstream_error):
        assert not [form for form in forms if form in text], text
    gateway.close_session(session)


def test_the_trace_file_is_private_and_holds_no_key_an_upstream_echoed(gateway, server, tmp_path):
    """Issue 18 item 4: an upstream error echoing the key (raw and JSON-escaped) is scrubbed
    before the turn is written to the trace, which is 0600 in a 0700 directory."""
    import stat

    key = 'sk-trace-"echo"-0123456789'
    echo = {"error": {"message": f"bad key {key}", "raw": key}}
    trace = tmp_path / "traces" / "t.jsonl"
    session = gateway.open_session(Upstream(server.base_url, server.add_script(
        [ScriptedTurn(fault=Fault(http_status=401, body=echo))], api_key=key)), mode="transparent_proxy",
        trace_path=str(trace))
    status, _, _ = call(gateway, session)
    session.wait_idle(5)
    gateway.close_session(session)
    text = trace.read_text()
    assert status == 401 and json.loads(text)["upstream_status"] == 401 and "bad key ***" in text, text
    assert key not in text and json.dumps(key)[1:-1] not in text and "echo" not in text, text
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600 and stat.S_IMODE(trace.parent.stat().st_mode) == 0o700


def test_a_lone_surrogate_escape_is_still_relayed(gateway, server):
    """node's JSON.stringify writes "\\ud83d" for a string cut inside a surrogate pair: valid JSON
    that the fast parser refuses; the gateway still relays it (and still applies its rules)."""
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]), max_tokens_cap=10)
    body = json.dumps({**BODY, "n": 3, "messages": [{"role": "user", "content": "cut \ud83d"}]}).encode()
    status, _ = raw_http(gateway.tcp_port, "/v1/chat/completions", session.token, body)
    assert status != 400  # relayed: what the upstream makes of it is the upstream's answer
    (received,) = server.requests
    assert received.body["n"] == 1 and received.body["messages"][0]["content"] == "cut \ud83d"
    gateway.close_session(session)


# ------------------------------------------------------- a gateway bounded per session (issue 25)

def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def send_body(port: int, token: str, *, send: int, announce: int | None, answers: list, hold: threading.Event,
              deadline: float, pause_s: float = 0.0, piece: bytes = b"x" * (1 << 20)) -> None:
    """One connection: headers (Content-Length `announce`, or chunked when None), then up to `send`
    bytes in `piece`s, stopping as soon as the gateway answers; appends the answer's (status,
    body), or the error that ended the connection, to `answers`, then holds it until `hold`."""
    framing = "Transfer-Encoding: chunked" if announce is None else f"Content-Length: {announce}"
    data = piece if announce is not None else b"%x\r\n%s\r\n" % (len(piece), piece)
    status = None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {token}\r\n"
                         f"Content-Type: application/json\r\n{framing}\r\n\r\n".encode())
            sent = 0
            while sent < send and time.monotonic() < deadline:
                if select.select([sock], [], [], pause_s)[0]:  # answered before the body was all sent
                    break
                sock.sendall(data)
                sent += len(piece)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            head = sock.recv(4096)
            status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else f"no answer after {sent} bytes"
            answers.append((status, head.partition(b"\r\n\r\n")[2]))
            hold.wait(30)
    except OSError as error:
        answers.append((status or type(error).__name__, b""))


def flood(port: int, token: str, *, connections: int, send: int, announce: int | None, timeout_s: float = 30,
          **kwargs) -> tuple[list, float]:
    """`connections` bodies of one session at once, held open; the answers, and the growth in MiB
    of this process's RSS (the gateway's: it runs in this process) while every connection is held.
    The senders share one 1 MiB piece, made before the measurement starts."""
    answers, hold, piece = [], threading.Event(), b"x" * (1 << 20)
    before = rss_mib()
    deadline = time.monotonic() + timeout_s
    threads = [threading.Thread(target=send_body, args=(port, token), daemon=True,
                                kwargs=dict(send=send, announce=announce, answers=answers, hold=hold,
                                            deadline=deadline, piece=piece, **kwargs)) for _ in range(connections)]
    for thread in threads:
        thread.start()
    grown = 0.0
    while len(answers) < connections and time.monotonic() < deadline + 5:
        grown = max(grown, rss_mib() - before)
        time.sleep(0.05)
    grown = max(grown, rss_mib() - before)
    hold.set()
    for thread in threads:
        thread.join(10)
    return answers, grown


@pytest.mark.parametrize("announce", [250 << 20, None], ids=["announced-250MiB", "chunked"])
def test_a_body_flood_from_one_session_leaves_host_memory_bounded(gateway, server, announce):
    """Six connections of one session each send 32 MiB of a body (announced as 250 MiB, or chunked
    with no length) and hold the connection: the gateway refuses each body once it passes what the
    session's budget (16 MiB, shared by its calls in flight) allows, so the host holds at most the
    budget, not 6 x 32 MiB (it used to read every body whole, up to 256 MiB each)."""
    session = gateway.open_session(upstream(server, []))
    try:
        answers, grown = flood(gateway.tcp_port, session.token, connections=6, send=32 << 20, announce=announce)
        wait_for(lambda: session.calls_open == 0, what="every refused call to end")
        assert session.body_bytes_held == 0
    finally:
        gateway.close_session(session)
    statuses = sorted(status for status, _ in answers)
    assert grown < (MAX_REQUEST_BYTES >> 20) + 24, f"the gateway grew by {grown:.0f} MiB; answers {statuses}"
    if announce is not None:  # refused on its Content-Length, before any of it is read
        assert statuses == [413] * 6
        error = json.loads(answers[0][1])["error"]
        assert error["type"] == "request_too_large" and f"announces {250 << 20} bytes" in error["message"]
    else:  # refused as it arrives: alone past the budget (413), or past what the others leave (429)
        assert set(statuses) <= {413, 429} and len(statuses) == 6, statuses
    assert server.requests == [] and session.turns == []


def test_the_body_budget_is_shared_by_a_sessions_calls_in_flight(gateway, server):
    """A body that fits the budget alone waits for none: it is refused with a 429 while the
    session's other calls hold the rest, and relayed once they have ended; larger than the whole
    budget, it is a 413."""
    server.set_default([ScriptedTurn(text="slow", fault=Fault(hang_s=1.0))])
    session = gateway.open_session(Upstream(server.base_url, None), limits=SessionLimits(max_request_bytes=64 << 10))
    body = {**BODY, "messages": [{"role": "user", "content": "x" * (40 << 10)}]}

    async def two_at_once():
        first = asyncio.ensure_future(_call(gateway.tcp_base_url + "/chat/completions", session.token, body))
        while session.body_bytes_held == 0:
            await asyncio.sleep(0.005)
        second = await _call(gateway.tcp_base_url + "/chat/completions", session.token, body)
        return await first, second

    try:
        first, second = asyncio.run(two_at_once())
        assert first[0] == 200 and second[0] == 429, (first[0], second[2])
        error = json.loads(second[2])["error"]
        assert error["type"] == "request_budget_in_use" and second[1]["Retry-After"] == "1"
        assert call(gateway, session, body=body)[0] == 200  # the first has ended: room again
        huge = {**BODY, "messages": [{"role": "user", "content": "x" * (70 << 10)}]}
        status, _, raw = call(gateway, session, body=huge)
        assert status == 413 and json.loads(raw)["error"]["type"] == "request_too_large"
        assert len(server.requests) == 2 and session.body_bytes_held == 0 and session.calls_open == 0
    finally:
        gateway.close_session(session)


def test_a_compressed_body_is_counted_as_it_unpacks(gateway, server):
    """A small gzip body that unpacks past the budget (aiohttp decodes Content-Encoding) is
    refused as it grows, and the Content-Encoding header never reaches the upstream."""
    import gzip

    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]))
    bomb = gzip.compress(json.dumps(BODY).encode()[:-1] + b" " * (MAX_REQUEST_BYTES + 1) + b"}")
    small = gzip.compress(json.dumps(BODY).encode())

    async def send(data):
        headers = {"Authorization": f"Bearer {session.token}", "Content-Encoding": "gzip",
                   "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as client:
            async with client.post(gateway.tcp_base_url + "/chat/completions", data=data, headers=headers) as r:
                return r.status, await r.read()

    try:
        assert len(bomb) < 64 << 10
        status, raw = asyncio.run(send(bomb))
        assert status == 413 and json.loads(raw)["error"]["type"] == "request_too_large" and server.requests == []
        status, _ = asyncio.run(send(small))
        assert status == 200 and server.requests[0].body == BODY
        assert "content-encoding" not in server.requests[0].headers
    finally:
        gateway.close_session(session)


def test_a_body_that_trickles_in_is_refused_at_the_body_time_limit(gateway, server):
    """A byte every 0.2 s of an announced 1000-byte body: a 408 once the session's body time
    limit has passed, and the call's slot and bytes are free again."""
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]), limits=SessionLimits(body_timeout_s=0.5))
    answers, hold = [], threading.Event()
    hold.set()
    started = time.monotonic()
    try:
        send_body(gateway.tcp_port, session.token, send=1000, announce=1000, answers=answers, hold=hold,
                  deadline=started + 5, pause_s=0.2, piece=b"{")
        elapsed = time.monotonic() - started
        (status, raw), = answers
        assert status == 408 and 0.5 <= elapsed < 2.5, (status, elapsed)
        error = json.loads(raw)["error"]
        assert error["type"] == "request_body_timeout" and "within 0.5 s" in error["message"]
        wait_for(lambda: session.calls_open == 0 and session.body_bytes_held == 0)
        assert server.requests == [] and session.turns == []
        assert call(gateway, session)[0] == 200  # the session itself is fine
    finally:
        gateway.close_session(session)


def test_calls_past_the_concurrency_cap_get_a_429_at_once(gateway, server):
    """Two calls in flight (the upstream is slow) fill a session capped at two: a third call, to
    either route, is answered 429 at once (never held), and once they end calls go through."""
    server.set_default([ScriptedTurn(text="slow", fault=Fault(hang_s=1.0))])
    session = gateway.open_session(Upstream(server.base_url, None), limits=SessionLimits(max_concurrent_calls=2))

    async def three():
        url = gateway.tcp_base_url + "/chat/completions"
        held = [asyncio.ensure_future(_call(url, session.token)) for _ in range(2)]
        while session.calls_open < 2:
            await asyncio.sleep(0.005)
        started = time.monotonic()
        third = await _call(url, session.token)
        listing = await _call(gateway.tcp_base_url + "/models", session.token, None, method="GET")
        return third, listing, time.monotonic() - started, await asyncio.gather(*held)

    try:
        (status, headers, raw), listing, elapsed, held = asyncio.run(three())
        assert status == 429 and listing[0] == 429 and elapsed < 0.5
        error = json.loads(raw)["error"]
        assert error["type"] == "too_many_concurrent_calls" and "2 calls open" in error["message"]
        assert headers["Retry-After"] == "1" and [s for s, _, _ in held] == [200, 200]
        assert len(server.requests) == 2 and len(session.turns) == 2  # refused calls are not turns
        assert call(gateway, session)[0] == 200
    finally:
        gateway.close_session(session)


# What reaches the upstream of the agent's headers: Pi's own (the OpenAI JS SDK over node's fetch).
PI_HEADERS = {"Accept": "application/json", "User-Agent": "pi/1.6.0", "Accept-Language": "*", "Sec-Fetch-Mode": "cors",
              "X-Stainless-Lang": "js", "X-Stainless-Package-Version": "7.59.0", "X-Stainless-OS": "Linux",
              "X-Stainless-Arch": "x64", "X-Stainless-Runtime": "node", "X-Stainless-Runtime-Version": "v20.20.2",
              "X-Stainless-Retry-Count": "0"}
FORBIDDEN_HEADERS = {"OpenAI-Organization": "org-agent", "OpenAI-Project": "proj-agent", "X-Forwarded-For": "1.2.3.4",
                     "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https", "Forwarded": "for=1.2.3.4",
                     "X-Real-IP": "1.2.3.4", "Via": "1.1 agent", "api-key": "sk-agent-azure", "X-Api-Key": "sk-agent",
                     "Cookie": "session=agent", "Proxy-Authorization": "Basic YWdlbnQ6eA==",
                     "X-Session-Affinity": "replica-3", "OpenAI-Beta": "assistants=v2", "Idempotency-Key": "k",
                     "X-Request-Id": "agent-chosen", "Referer": "http://agent"}


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
def test_only_allowed_agent_headers_reach_the_upstream(gateway, server, mode):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")] * 2), mode=mode)

    async def with_headers(path, method, body):
        headers = {"Authorization": f"Bearer {session.token}", **PI_HEADERS, **FORBIDDEN_HEADERS}
        async with aiohttp.ClientSession(skip_auto_headers=("User-Agent",)) as client:
            async with client.request(method, gateway.tcp_base_url + path, json=body, headers=headers) as r:
                return r.status

    try:
        assert asyncio.run(with_headers("/chat/completions", "POST", BODY)) == 200
        assert asyncio.run(with_headers("/models", "GET", None)) == 200
    finally:
        gateway.close_session(session)
    for received in server.requests:
        assert not {name.lower() for name in FORBIDDEN_HEADERS} & set(received.headers), received.headers
        assert {k.lower(): v for k, v in PI_HEADERS.items()}.items() <= received.headers.items()
        assert received.headers["authorization"] == f"Bearer {REAL_KEY}"
        assert set(received.headers) - {k.lower() for k in PI_HEADERS} <= {
            "host", "content-length", "content-type", "accept-encoding", "authorization",
            "x-session-id"}  # the gateway's own: the session's id (test_policy_version.py)
        assert received.headers["x-session-id"] == session.id


MODES = ["black_box", "transparent_proxy", "interception_gate"]


def open_in_mode(gateway, server, mode):
    """A session in `mode` whose upstream serves "served-model"; in interception_gate nobody plays
    the trainer, so a call the gate wrongly held ends after 1 s (a stop answer), never hangs."""
    return gateway.open_session(upstream(server, [ScriptedTurn(text="ok")], model="served-model"), mode=mode,
                                gate_timeout_s=1.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", ["true", 1, 0, "false", {"on": True}])
def test_stream_must_be_a_json_boolean(gateway, server, mode, stream):
    """A `stream` the upstream may read as a stream but the gateway would record as no answer
    is refused with a 400 that says what to fix, in every mode; the call is a turn, never sent."""
    session = open_in_mode(gateway, server, mode)
    try:
        status, _, raw = call(gateway, session, body={**BODY, "stream": stream})
        error = json.loads(raw)["error"]
        assert status == 400 and error["type"] == "invalid_request", raw
        assert "`stream` must be a JSON boolean (true or false), not " + json.dumps(stream) in error["message"]
        assert server.requests == [] and len(session.turns) == 1 and session.turns[0].upstream_status is None
    finally:
        gateway.close_session(session)


@pytest.mark.parametrize("mode", MODES)
def test_a_request_nested_past_any_parser_is_a_400_never_a_crash(gateway, server, mode):
    """JSON nested 5,000 deep raised RecursionError in the request rules (a 500 from the gateway)."""
    session = open_in_mode(gateway, server, mode)
    try:
        nested = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": ' + \
            b"[" * 5000 + b"]" * 5000 + b"}]}"
        status, _, raw = call(gateway, session, raw=nested)
        assert status == 400 and "nests deeper" in json.loads(raw)["error"]["message"], raw
        assert server.requests == [] and len(session.turns) == 1 and session.turns[0].upstream_status is None
        assert call(gateway, session)[0] == 200  # the gateway and the session go on
    finally:
        gateway.close_session(session)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 4000}, {"prompt_logprobs": 20},
                                   {"logit_bias": {"42": 100}}, {"chat_template": "{{ 'pwned' }}"},
                                   {"lora_path": "/adapters/other"}, {"priority": -100}], ids=lambda extra: next(iter(extra)))
def test_engine_extras_are_refused_unless_the_session_allows_them(gateway, server, mode, extra):
    session = open_in_mode(gateway, server, mode)
    try:
        status, _, raw = call(gateway, session, body={**BODY, **extra})
        error = json.loads(raw)["error"]
        (name,) = extra
        assert status == 400 and error["type"] == "field_not_allowed", raw
        assert f"`{name}` ({RESTRICTED_FIELDS[name]})" in error["message"] and "gateway.allow_fields" in error["message"]
        assert server.requests == []
    finally:
        gateway.close_session(session)


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
def test_an_allowed_engine_extra_is_relayed(gateway, server, mode):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]), mode=mode,
                                   allow_fields=["ignore_eos", "min_tokens"])
    try:
        assert call(gateway, session, body={**BODY, "ignore_eos": True, "min_tokens": 5})[0] == 200
        assert server.requests[0].body["ignore_eos"] is True and server.requests[0].body["min_tokens"] == 5
        with pytest.raises(ValueError, match="not restricted fields"):
            gateway.open_session(upstream(server, []), allow_fields=["temperature"])
    finally:
        gateway.close_session(session)


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
@pytest.mark.parametrize("named", ["gpt-4o", "served-model-but-not", None, 7])
def test_the_model_is_the_sessions_whatever_the_agent_names(gateway, server, mode, named):
    """The config fixes the model: a call naming another (or none) reaches the upstream with the
    session's, so the real key never pays for another model and an unknown name never fails
    like a broken endpoint; the record says what was asked."""
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")], model="served-model"), mode=mode)
    body = {**BODY, "model": named} if named is not None else {k: v for k, v in BODY.items() if k != "model"}
    try:
        assert call(gateway, session, body=body)[0] == 200
        session.wait_idle(5)
    finally:
        gateway.close_session(session)
    (received,) = server.requests
    assert received.body["model"] == "served-model"
    assert session.turns[0].capture.request["model"] == "served-model"


def test_a_well_formed_black_box_call_is_relayed_byte_for_byte(gateway, server):
    """Pi's call (the session's model, one choice, no extras, a boolean stream) is relayed as the
    agent's exact bytes: none of the rules above rewrites it."""
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")], model="m"), max_tokens_cap=100)
    sent = b'{"model":"m","messages":[{"role":"user","content":"hi \\u00e9"}],"stream":true,"max_tokens":50,' \
           b'"stream_options":{"include_usage":true},"store":false,"tools":[]}'
    try:
        status, _ = raw_http(gateway.tcp_port, "/v1/chat/completions", session.token, sent)
        session.wait_idle(5)
    finally:
        gateway.close_session(session)
    (received,) = server.requests
    assert status == 200 and received.body == json.loads(sent)
    assert int(received.headers["content-length"]) == session.turns[0].request_bytes == len(sent)  # "\u00e9" kept


def test_read_buffered_takes_what_is_buffered_in_one_piece_and_keeps_the_connection_reusable():
    """The relay reads an answer through read_buffered(): an engine's one HTTP chunk per token
    must come out as one piece per read (readany() pops them one by one, at ~2-3 us a token),
    byte for byte what readany() gives, with the connection pooled and reusable after it. The
    fast path must hold on the aiohttp installed: losing it loses that much loop CPU."""
    from pi_env.proxy import wire

    assert wire._DRAINABLE, "aiohttp's StreamReader internals changed: read_buffered() fell back to readany()"
    events = [b"data: {\"n\": %d, \"pad\": \"%s\"}\n\n" % (i, b"x" * (i % 7)) for i in range(600)]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        while await reader.readuntil(b"\r\n\r\n"):  # a GET per request; the answer in three writes
            for part in (answer[:100], answer[100 : len(answer) // 2], answer[len(answer) // 2 :]):
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.01)

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        async with aiohttp.ClientSession() as client:
            reads = []
            for read in (wire.read_buffered, lambda content: content.readany()) * 2:
                async with client.get(url) as r:
                    pieces, protocol = [], r.connection.protocol
                    resumes = protocol.resume_reading
                    calls = []  # the per-pop flow control readany() runs
                    protocol.resume_reading = lambda *a, **k: calls.append(1) or resumes(*a, **k)
                    while piece := await read(r.content):
                        pieces.append(piece)
                    assert r.content.at_eof() and r.content._size == 0
                    del protocol.resume_reading
                reads.append((b"".join(pieces), len(calls)))
        server.close()
        return reads

    (fast, fast_calls), (plain, plain_calls), (again, _), _ = asyncio.run(main())
    assert fast == plain == again == b"".join(events)
    assert fast_calls <= 6 and plain_calls >= len(events), (fast_calls, plain_calls)  # per read, not per chunk
    assert len(connections) == 1  # every answer read to its end on one pooled connection
