"""transparent_proxy over real sockets: a real gateway in front of the scripted server in its
engine-like modes. What the upstream receives, what the agent receives, and what is captured.

Capturing turns are recorded just after the agent has the answer's last byte, so every test
calls `session.wait_idle()` before reading `session.turns`."""

import asyncio
import json
import os
import time
from types import SimpleNamespace

import aiohttp
import msgspec
import pytest
from helpers import USER, chat, free_port, wait_for
from test_gateway import REAL_KEY, _call, call, sse_json

from pi_env.proxy import Upstream
from pi_env.proxy.capture import Assembler, TurnCapture
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.scripted.script import Fault, ScriptedToolCall, ScriptedTurn, synthetic_token_id
from pi_env.scripted.server import GROQ_LOGPROBS_ERROR, LLAMA_CPP_LOGPROBS_ERROR, EngineQuirks, answer_deltas
from pi_env.training import build_training_trace

UPSTREAM_MODEL = "upstream/exact-model-id"
CAPTURE = CaptureOptions(model=UPSTREAM_MODEL, return_token_ids=True, top_logprobs=2)
THINK_AND_CALL = ScriptedTurn(
    reasoning="I should look first.", text="Looking.", chunk_chars=5, null_logprob_every=4,
    tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls -la"}),
                ScriptedToolCall(name="read", arguments={"path": "a.py"}, id="call_read")],
)


@pytest.fixture
def open_session(gateway, server):
    """open_session(turns, key=REAL_KEY, capture=CAPTURE, **gateway options): a transparent_proxy
    session whose upstream (with the real key) serves `turns`; closed after the test."""
    opened = []

    def open_(turns, *, key=REAL_KEY, capture=CAPTURE, **kwargs):
        server.add_script(turns, api_key=key)
        session = gateway.open_session(Upstream(server.base_url, key, UPSTREAM_MODEL), mode="transparent_proxy",
                                       capture=capture, **kwargs)
        opened.append(session)
        return session

    yield open_
    for session in opened:
        gateway.close_session(session)


def direct(server, body, key=REAL_KEY) -> bytes:
    """The scripted server's answer to `body`, fetched without the gateway."""
    status, _, raw = asyncio.run(_call(server.base_url + "/chat/completions", key, body))
    assert status == 200
    return raw


def engine_tokens(raw: bytes, streamed=True) -> dict:
    """What the engine sent, read straight off the wire (independently of the Assembler)."""
    if streamed:
        chunks = sse_json(raw)
        choices = [c for chunk in chunks for c in chunk["choices"]]
        prompt = next((c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c), [])
    else:
        body = json.loads(raw)
        choices, prompt = body["choices"], body.get("prompt_token_ids", [])
    entries = [e for c in choices for e in ((c.get("logprobs") or {}).get("content") or [])]
    return {
        "prompt_token_ids": prompt,
        "token_ids": [i for c in choices for i in c.get("token_ids") or []],
        "logprobs": [e["logprob"] for e in entries],
        "tokens": [e["token"] for e in entries],
        "top_logprobs": [[{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]] for e in entries],
    }


def script_ids(turn: ScriptedTurn, index: int) -> list[int]:
    """The ids the scripted server generates for `turn` (its synthetic tokenizer)."""
    return [synthetic_token_id(t) for d in answer_deltas(turn, index) for t in d.tokens]


def assembled(raw: bytes) -> TurnCapture:
    return Assembler(TurnCapture(request={})).stream(raw)


def only_turns(session, n=1):
    assert session.wait_idle(5)
    assert len(session.turns) == n
    return session.turns if n > 1 else session.turns[0]


# ------------------------------------------------------------------------ the forwarded request


def test_forwarded_request_has_every_rewrite_the_real_key_and_forced_sampling(gateway, server, open_session):
    options = CaptureOptions(model=UPSTREAM_MODEL, top_logprobs=3, return_token_ids=True,
                             disable_thinking=True, sampling={"temperature": 1.0, "top_p": 1.0, "seed": 7})
    session = open_session([ScriptedTurn(text="one"), ScriptedTurn(text="two")], capture=options, max_tokens_cap=50)
    agent_body = chat(tools=True, temperature=0.2, seed=1, max_tokens=10_000, logprobs=False,
                      chat_template_kwargs={"custom": "kept", "enable_thinking": True})
    assert call(gateway, session, body=agent_body)[0] == 200
    received = server.requests[-1]
    assert received.body == {
        **agent_body, "model": UPSTREAM_MODEL, "logprobs": True, "top_logprobs": 3, "return_token_ids": True,
        "max_tokens": 50, "chat_template_kwargs": {"custom": "kept", "enable_thinking": False},
        "temperature": 1.0, "top_p": 1.0, "seed": 7,
    }
    assert received.headers["authorization"] == f"Bearer {REAL_KEY}"
    assert all(session.token not in value for value in received.headers.values())
    assert only_turns(session).capture.request == received.body

    # The agent cannot override forced sampling, whatever it sends next turn.
    history = [USER, {"role": "assistant", "content": "one"}, {"role": "user", "content": "again"}]
    assert call(gateway, session, body=chat(history, temperature=2.0, top_p=0.1, seed=99))[0] == 200
    forced = server.requests[-1].body
    assert (forced["temperature"], forced["top_p"], forced["seed"]) == (1.0, 1.0, 7)


def test_max_tokens_moves_for_models_that_refuse_it(gateway, server, open_session):
    session = open_session([ScriptedTurn(text="x")], capture=CaptureOptions(model="gpt-5-mini"), max_tokens_cap=64)
    call(gateway, session, body=chat(max_tokens=1000))
    received = server.requests[-1].body
    assert received["model"] == "gpt-5-mini" and received["max_completion_tokens"] == 64
    assert "max_tokens" not in received


def test_a_body_that_is_not_json_is_refused_without_contacting_upstream(gateway, server, open_session):
    session = open_session([ScriptedTurn(text="x")])

    async def send():
        async with aiohttp.ClientSession() as client:
            async with client.post(gateway.tcp_base_url + "/chat/completions", data=b"{nope",
                                   headers={"Authorization": f"Bearer {session.token}"}) as r:
                return r.status, await r.json()

    status, body = asyncio.run(send())
    assert status == 400 and body["error"]["type"] == "invalid_request"
    assert server.requests == [] and only_turns(session).upstream_status is None


# ------------------------------------------------------------------- capture equals the engine


ENGINE_MODES = {
    # name: (server quirks, capture options, where completion ids come from)
    "return_token_ids": (EngineQuirks(), CAPTURE, "token_ids"),
    "tokens_as_token_ids": (EngineQuirks(tokens_as_token_ids=True),
                            CaptureOptions(model=UPSTREAM_MODEL, return_token_ids=False), "logprob_tokens"),
    "ids_without_logprobs": (EngineQuirks(ignore_logprobs=True), CAPTURE, "token_ids"),
    "logprobs_without_ids": (EngineQuirks(ignore_return_token_ids=True), CAPTURE, None),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_captured_ids_and_logprobs_are_exactly_what_the_engine_sent(gateway, server, open_session, mode, stream):
    quirks, options, source = ENGINE_MODES[mode]
    server.quirks = quirks
    session = open_session([THINK_AND_CALL], capture=options)
    status, _, raw = call(gateway, session, body=chat(stream=stream, tools=True))
    assert status == 200
    capture = only_turns(session).capture
    sent = engine_tokens(direct(server, server.requests[-1].body), streamed=stream)
    first = capture.to_json()["choices"][0]

    assert capture.token_ids_source == source
    assert first["tokens"] == sent["tokens"] or not sent["tokens"]
    if source == "token_ids":
        assert capture.prompt_token_ids == sent["prompt_token_ids"] != []
        assert capture.completion_token_ids == sent["token_ids"] == script_ids(THINK_AND_CALL, 0)
        assert capture.token_ids_missing_reason is None
    elif source == "logprob_tokens":  # "token_id:N" tokens, no prompt ids: said, not invented
        assert capture.completion_token_ids == [int(t.removeprefix("token_id:")) for t in sent["tokens"]]
        assert capture.completion_token_ids == script_ids(THINK_AND_CALL, 0)
        assert capture.prompt_token_ids == [] and "prompt_token_ids" in capture.token_ids_missing_reason
    else:  # logprobs with text tokens only: no ids invented
        assert capture.completion_token_ids == [] and "no token ids" in capture.token_ids_missing_reason
    if mode == "ids_without_logprobs":
        assert sent["logprobs"] == [] and capture.per_token_logps == [None] * len(sent["token_ids"])
    else:
        assert capture.per_token_logps == sent["logprobs"]
        assert None in sent["logprobs"]  # the engine's nulls, kept in place
        assert capture.choices[0].decoded_top_logprobs() == sent["top_logprobs"]
        # The trace keeps each token's alternatives exactly as the engine sent them.
        traced = json.loads(msgspec.json.encode(first["top_logprobs"]))
        assert [[{"token": t["token"], "logprob": t["logprob"]} for t in tops] for tops in traced] == sent["top_logprobs"]


def test_reasoning_and_parallel_tool_calls_are_assembled(gateway, server, open_session):
    session = open_session([THINK_AND_CALL])
    raw = call(gateway, session, body=chat(tools=True))[2]
    choice = only_turns(session).capture.choices[0]
    expected = {
        "role": "assistant", "content": "Looking.", "reasoning_content": "I should look first.",
        "tool_calls": [
            {"id": "call_0_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}},
            {"id": "call_read", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
        ],
    }
    assert choice.message() == expected and choice.finish_reason == "tool_calls"
    deltas = [tc for c in sse_json(raw) for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
    assert {d["index"] for d in deltas} == {0, 1}  # what the agent saw carries the indices


# ------------------------------------------------------------------------- what the agent sees


def test_stream_reaches_the_agent_byte_identical_to_a_direct_fetch(gateway, server, open_session):
    server.quirks = EngineQuirks(deterministic_ids=True)
    session = open_session([THINK_AND_CALL])
    status, headers, through = call(gateway, session, body=chat(tools=True))
    assert status == 200 and headers["x-pi-env-synthetic"] == "1"
    assert through == direct(server, server.requests[-1].body)
    assert only_turns(session).response_bytes == len(through)


def test_stream_is_relayed_as_it_arrives_while_capturing(gateway, server, open_session):
    session = open_session([ScriptedTurn(text="abc", chunk_chars=1, fault=Fault(delay_s=0.2))])

    async def first_and_total():
        headers = {"Authorization": f"Bearer {session.token}"}
        async with aiohttp.ClientSession() as client:
            started = time.monotonic()
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=chat(), headers=headers) as r:
                first = await r.content.readany()
                first_at = time.monotonic() - started
                await r.read()
                return first, first_at, time.monotonic() - started

    first, first_at, total = asyncio.run(first_and_total())
    assert b"[DONE]" not in first and first_at < 0.15 and total >= 0.2 * 6  # 7 events, 0.2 s apart
    turn = only_turns(session)
    assert turn.ttfb_s < 0.15 and turn.capture.choices[0].content == "abc"


# --------------------------------------------------------------------------- upstream trouble


def test_upstream_error_reaches_the_agent_and_is_recorded(gateway, server, open_session):
    error = {"error": {"message": "model overloaded", "type": "server_error"}}
    session = open_session([ScriptedTurn(fault=Fault(http_status=503, body=error))])
    status, headers, raw = call(gateway, session, body=chat(tools=True))
    assert status == 503 and json.loads(raw) == error and headers["Content-Type"].startswith("application/json")
    turn = only_turns(session)
    assert turn.upstream_status == 503 and json.loads(turn.upstream_error) == error
    assert turn.capture.request["logprobs"] is True and turn.capture.fallback is None
    assert len(server.requests) == 1  # not a capture refusal: no fallback attempted


def test_unreachable_upstream_is_a_502_with_a_record(gateway):
    session = gateway.open_session(Upstream(f"http://127.0.0.1:{free_port()}/v1", REAL_KEY), mode="transparent_proxy")
    try:
        status, _, raw = call(gateway, session, body=chat())
        assert status == 502 and json.loads(raw)["error"]["type"] == "upstream_unreachable"
        turn = only_turns(session)
        assert turn.upstream_status is None and "unreachable" in turn.upstream_error
        assert turn.capture.request["messages"] == [USER]
    finally:
        gateway.close_session(session)


def test_client_disconnect_mid_stream_is_recorded(gateway, server, open_session):
    session = open_session([ScriptedTurn(text="x" * 40, chunk_chars=1, fault=Fault(delay_s=0.05))])

    async def read_one_chunk_then_leave():
        headers = {"Authorization": f"Bearer {session.token}"}
        async with aiohttp.ClientSession() as client:
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=chat(), headers=headers) as r:
                seen = b""
                while b'"content": "x"' not in seen and b'"content":"x"' not in seen:
                    seen += await r.content.readany()

    started = time.monotonic()
    asyncio.run(read_one_chunk_then_leave())
    wait_for(lambda: session.turns, 3)
    turn = only_turns(session)
    assert turn.client_disconnected and turn.upstream_status == 200
    assert time.monotonic() - started < 1.5  # the upstream stream was abandoned, not read to its end (2 s)
    # What had arrived before the agent left is kept in the capture.
    assert turn.capture.choices and turn.capture.choices[0].content.startswith("x")


def test_upstream_dying_mid_stream_is_recorded_with_what_arrived(gateway, server, open_session):
    session = open_session([ScriptedTurn(text="x" * 50, chunk_chars=1, fault=Fault(disconnect_after_chunks=5))])
    with pytest.raises(aiohttp.ClientPayloadError):
        call(gateway, session, body=chat())
    turn = only_turns(session)
    assert turn.upstream_status == 200 and turn.upstream_error.startswith("upstream stream broken")
    assert turn.upstream_broke
    assert not turn.client_disconnected
    choice = turn.capture.choices[0]
    assert choice.content == "xxxx" and choice.finish_reason is None  # role chunk + 4 content chunks
    assert turn.capture.completion_token_ids == [synthetic_token_id("x")] * 4


# ------------------------------------------------------------------------------- the fallbacks


def test_groq_like_upstream_falls_back_to_no_capture_with_the_reason(gateway, server, open_session):
    server.quirks = EngineQuirks(reject_logprobs="always")
    session = open_session([ScriptedTurn(text="first answer"), ScriptedTurn(text="second")])
    status, _, raw = call(gateway, session, body=chat(tools=True))
    assert status == 200 and assembled(raw).choices[0].content == "first answer"
    turn = only_turns(session)
    assert turn.upstream_status == 200 and turn.upstream_error is None
    capture = turn.capture
    assert capture.fallback.startswith("without_capture: upstream answered 400") and GROQ_LOGPROBS_ERROR in capture.fallback
    assert capture.completion_token_ids == [] and capture.token_ids_missing_reason
    assert capture.choices[0].content == "first answer"
    # Tried with capture (streamed, then not), then without the capture parameters.
    tried = [r.body for r in server.requests]
    assert [(b.get("stream"), "logprobs" in b) for b in tried] == [(True, True), (None, True), (True, False)]
    assert not {"logprobs", "top_logprobs", "return_token_ids"} & set(tried[-1])
    assert capture.request == tried[-1]  # the record holds what the upstream was sent

    # Sticky: the next turn goes straight to the fallback, and says so.
    history = [USER, {"role": "assistant", "content": "first answer"}, {"role": "user", "content": "more"}]
    status, _, raw = call(gateway, session, body=chat(history, tools=True))
    assert status == 200 and assembled(raw).choices[0].content == "second"
    assert len(server.requests) == 4 and "logprobs" not in server.requests[-1].body
    assert only_turns(session, 2)[1].capture.fallback.startswith("without_capture")


@pytest.mark.parametrize("status", [400, 500], ids=["llama.cpp", "older llama.cpp"])
def test_llama_cpp_like_upstream_falls_back_to_non_streaming_keeping_ids(gateway, server, open_session, status):
    server.quirks = EngineQuirks(reject_logprobs="tools_stream", reject_status=status)
    second = ScriptedTurn(text="and again", null_logprob_every=2)
    session = open_session([THINK_AND_CALL, second])
    code, headers, raw = call(gateway, session, body=chat(tools=True))
    assert code == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    agent_view = assembled(raw)
    turn = only_turns(session)
    assert agent_view.choices[0].message() == turn.capture.choices[0].message()
    assert turn.capture.choices[0].message()["tool_calls"][1]["id"] == "call_read"
    assert agent_view.usage == turn.capture.usage != None  # noqa: E711 - the agent asked for usage
    assert turn.capture.fallback.startswith("non_streaming:") and LLAMA_CPP_LOGPROBS_ERROR in turn.capture.fallback
    assert turn.upstream_status == 200 and turn.upstream_error is None and turn.ttfb_s is not None
    unstreamed = server.requests[-1].body
    assert "stream" not in unstreamed and "stream_options" not in unstreamed and unstreamed["logprobs"] is True
    assert turn.capture.request == unstreamed
    sent = engine_tokens(direct(server, unstreamed), streamed=False)
    assert turn.capture.completion_token_ids == sent["token_ids"] == script_ids(THINK_AND_CALL, 0)
    assert turn.capture.prompt_token_ids == sent["prompt_token_ids"]
    assert turn.capture.per_token_logps == sent["logprobs"]

    # Sticky: the next streamed turn goes unstreamed at once (one upstream request).
    before = len(server.requests)
    history = [USER, {"role": "assistant", "content": "Looking."}, {"role": "user", "content": "more"}]
    code, _, raw = call(gateway, session, body=chat(history, tools=True))
    assert code == 200 and assembled(raw).choices[0].content == "and again"
    assert len(server.requests) == before + 1 and "stream" not in server.requests[-1].body
    later = only_turns(session, 2)[1].capture
    assert later.fallback.startswith("non_streaming:") and later.completion_token_ids == script_ids(second, 1)
    assert later.per_token_logps[1] is None and later.per_token_logps[0] is not None


def test_non_streaming_fallback_answer_cut_short_is_a_502_with_a_record(gateway, server, open_session):
    server.quirks = EngineQuirks(reject_logprobs="tools_stream")
    session = open_session([ScriptedTurn(text="never whole", fault=Fault(truncate_body_at=40))])
    status, _, raw = call(gateway, session, body=chat(tools=True))
    assert status == 502 and json.loads(raw)["error"]["type"] == "upstream_error"
    turn = only_turns(session)
    assert turn.upstream_status == 200 and turn.upstream_error.startswith("upstream answer broken")
    assert turn.upstream_broke
    assert turn.capture.fallback.startswith("non_streaming:")


def test_a_failed_fallback_is_not_sticky(gateway, server, open_session):
    # An error that mentions logprobs whatever the request shape: no fallback helps, so none sticks.
    error = {"error": {"message": "top_logprobs must be at most 1", "type": "invalid_request_error"}}
    session = open_session([ScriptedTurn(fault=Fault(http_status=400, body=error)), ScriptedTurn(text="fine")])
    status, _, raw = call(gateway, session, body=chat(tools=True))
    assert status == 400 and json.loads(raw) == error
    history = [USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": "again"}]
    before = len(server.requests)
    assert call(gateway, session, body=chat(history))[0] == 200
    assert len(server.requests) == before + 1
    assert server.requests[-1].body["stream"] is True and server.requests[-1].body["logprobs"] is True
    later = only_turns(session, 2)[1].capture
    assert later.fallback is None and later.completion_token_ids == script_ids(ScriptedTurn(text="fine"), 1)


# --------------------------------------------------------------------------- budgets, traces


@pytest.mark.parametrize("budget", ["max_turns", "max_total_tokens"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
def test_budgets_end_the_turn_cleanly(gateway, server, open_session, budget, stream):
    limits = {"max_turns": 1} if budget == "max_turns" else {"max_total_tokens": 1}
    session = open_session([ScriptedTurn(text="x" * 40)] * 3, **limits)
    assert call(gateway, session, body=chat(stream=stream))[0] == 200
    assert session.wait_idle(5)
    status, headers, raw = call(gateway, session, body=chat(stream=stream))
    assert status == 200 and headers["x-pi-env-budget"] == budget == session.budget_exhausted
    if stream:
        assert raw.endswith(b"data: [DONE]\n\n")
        answer = assembled(raw).choices[0]
        assert (answer.content, answer.finish_reason, answer.tool_calls) == ("", "stop", [])
    else:
        choice = json.loads(raw)["choices"][0]
        assert choice["finish_reason"] == "stop" and not choice["message"]["content"]
    assert len(server.requests) == 1 and len(session.turns) == 1


def test_trace_file_gets_one_flushed_line_per_turn_with_capture_and_no_secrets(gateway, server, open_session, tmp_path):
    trace = tmp_path / "traces" / "session.jsonl"
    turns = [THINK_AND_CALL, ScriptedTurn(fault=Fault(http_status=500))]
    session = open_session(turns, trace_path=str(trace))
    call(gateway, session, body=chat(tools=True))
    assert session.wait_idle(5)
    lines = trace.read_text().splitlines()  # on disk while the session is still open
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["capture"]["completion_token_ids"] == script_ids(THINK_AND_CALL, 0)
    assert record["capture"]["prompt_token_ids"] == session.turns[0].capture.prompt_token_ids != []
    assert len(record["capture"]["per_token_logps"]) == len(record["capture"]["completion_token_ids"])
    assert record["capture"]["request"]["model"] == UPSTREAM_MODEL

    history = [USER, {"role": "assistant", "content": "Looking."}, {"role": "user", "content": "go"}]
    call(gateway, session, body=chat(history))
    assert session.wait_idle(5)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["turn"] for r in records] == [0, 1] and records[1]["upstream_status"] == 500
    text = trace.read_text()
    assert REAL_KEY not in text and session.token not in text


# ------------------------------------------------------------------------------- concurrency


def test_32_concurrent_sessions_keep_their_traces_apart(gateway, server, open_session):
    n = 32
    scripts = [[ScriptedTurn(text=f"session {i} says " + "ab" * i, chunk_chars=3, fault=Fault(delay_s=0.005)),
                ScriptedTurn(text=f"then {i}", fault=Fault(delay_s=0.005))] for i in range(n)]
    sessions = [open_session(script, key=f"sk-real-{i}") for i, script in enumerate(scripts)]

    async def converse(client, session, script):
        headers = {"Authorization": f"Bearer {session.token}"}
        messages = [USER]
        for turn in script:
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=chat(messages),
                                   headers=headers) as r:
                assert r.status == 200
                raw = await r.read()
            text = assembled(raw).choices[0].content
            assert text == turn.text
            messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "next"}]

    async def run_all():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            await asyncio.gather(*(converse(client, s, script) for s, script in zip(sessions, scripts)))

    started = time.monotonic()
    asyncio.run(run_all())
    elapsed = time.monotonic() - started
    for i, (session, script) in enumerate(zip(sessions, scripts)):
        turns = only_turns(session, 2)
        assert [t.capture.completion_token_ids for t in turns] == [script_ids(t, k) for k, t in enumerate(script)]
        assert turns[0].capture.request["messages"] == [USER]
        view = build_training_trace(SimpleNamespace(turn=t.turn, prompt_token_ids=t.capture.prompt_token_ids,
                                                    completion_token_ids=t.capture.completion_token_ids,
                                                    per_token_logps=t.capture.per_token_logps) for t in turns)
        assert view.append_only, f"session {i}"
    assert len(server.requests) == 2 * n
    assert elapsed < 5, f"32 concurrent sessions took {elapsed:.1f} s"


def test_a_large_answer_is_assembled_in_the_worker_process_exactly(gateway, server, open_session):
    """Answers past OFFLOAD_MIN_BYTES are parsed off the event loop, in a capture worker process (the
    pool counts it, the capture names no failure); the capture is the same as the inline path's."""
    from pi_env.proxy import assembly
    from pi_env.proxy.capture_worker import capture_pool

    pool = capture_pool()
    before = pool.assembled
    long_turn = ScriptedTurn(text="abcd" * 3000, chunk_chars=4)
    session = open_session([long_turn])
    status, _, raw = call(gateway, session, body=chat())
    assert status == 200 and len(raw) > assembly.OFFLOAD_MIN_BYTES
    capture = only_turns(session).capture
    assert capture.worker_error is None
    assert pool.assembled == before + 1, "the large answer was not parsed in a worker process"
    assert pool.pids and os.getpid() not in pool.pids and pool.cpu_s > 0
    assert capture.completion_token_ids == script_ids(long_turn, 0)
    assert capture.choices[0].content == long_turn.text and capture.request["logprobs"] is True
    inline = assembled(raw)
    assert capture.per_token_logps == inline.per_token_logps and capture.usage == inline.usage


def test_a_failing_worker_is_logged_and_recorded_and_the_answer_still_captured(gateway, server, open_session,
                                                                                 monkeypatch, caplog):
    """A worker that cannot run (here: its interpreter exits at once) costs the loop a parse, never
    the capture, and says so: a warning in the log and `worker_error` on the turn's capture."""
    from pi_env.proxy import capture_worker as module

    broken = module.CapturePool(1)
    monkeypatch.setattr(module, "_pool", broken)
    monkeypatch.setattr(module.sys, "executable", "/bin/false")
    long_turn = ScriptedTurn(text="abcd" * 3000, chunk_chars=4)
    session = open_session([long_turn])
    with caplog.at_level("WARNING", logger="pi_env.proxy.assembly"):
        status, _, raw = call(gateway, session, body=chat())
        capture = only_turns(session).capture
    assert status == 200
    assert capture.worker_error and "capture worker failed" in capture.worker_error
    assert broken.failures == 1 and broken.assembled == 0
    assert any("parsed on the event loop" in r.message for r in caplog.records)
    assert capture.completion_token_ids == script_ids(long_turn, 0)
    broken.close()
