"""Anthropic Messages on the gateway (proxy/dialects/messages.py), the dialect Claude Code speaks:
the official anthropic SDK as the client, the real gateway, the scripted server (or the scripted
token engine, or the test as the trainer) as the model. Streamed (`stream=True`, and the SDK's
`messages.stream()` helper) and not, in black_box, transparent_proxy, token-in and
interception_gate."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from pathlib import Path

import aiohttp
import anthropic
import httpx2
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from pi_env.proxy import Upstream
from pi_env.proxy.dialects.base import AnswerStream, Route
from pi_env.proxy.dialects.messages import SYNTHETIC_SIGNATURE, MessagesDialect
from pi_env.proxy.gate import GateCompletion
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.scripted import Fault, ScriptedToolCall, ScriptedTurn

KEY = "sk-real-upstream-key-messages"
FIXTURE = Path(__file__).parent / "fixtures/dialects/claude_code_request.json"
BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"],
    },
}
WRITE = {
    "name": "Write",
    "description": "Write a file",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["file_path", "content"],
    },
}
USER = {"role": "user", "content": "Write hello.txt, then list the files."}
# What a translated call may carry upstream: standard Chat Completions fields only.
CHAT_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
}  # the last three: transparent_proxy's own
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
GATEWAY_MODES = ["black_box", "transparent_proxy"]
# The three ways the SDK is used: create(stream=True), the stream() helper, create() whole.
HOW = ["create_stream", "stream_helper", "whole"]


def open_session(gateway, server, turns, mode="black_box", **kwargs):
    if mode == "transparent_proxy":  # the engine's ids and logprobs, captured
        kwargs.setdefault("capture", CaptureOptions(model="scripted-model", return_token_ids=True, top_logprobs=2))
    upstream = Upstream(server.base_url, server.add_script(turns, api_key=KEY), "scripted-model")
    return gateway.open_session(upstream, mode=mode, **kwargs)


def client(gateway, session, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{gateway.tcp_port}", api_key=session.token, max_retries=0, **kwargs
    )


def ask(gateway, session, how: str, messages=(USER,), *, tools=(BASH, WRITE), **extra) -> tuple[Message, list]:
    """One call through the SDK, the way `how` says: its final Message, and its raw events (streamed)."""
    sdk = client(gateway, session)
    kwargs = {"model": "claude-sonnet-4-5", "max_tokens": 512, "messages": list(messages), **extra}
    if tools:
        kwargs["tools"] = list(tools)
    if how == "whole":
        return sdk.messages.create(**kwargs), []
    if how == "stream_helper":
        with sdk.messages.stream(**kwargs) as stream:
            events = list(stream)
            return stream.get_final_message(), [e for e in events if e.type in RAW_TYPES]
    events = list(sdk.messages.create(stream=True, **kwargs))
    return accumulate(events), events


RAW_TYPES = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


def accumulate(events) -> Message:
    """A Message from raw events, as the SDK's own helper builds it."""
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot, buffers = None, {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    return snapshot


def sent(server) -> list[dict]:
    return [r.body for r in server.requests if r.path == "/v1/chat/completions"]


def assert_chat_only(body: dict):
    assert set(body) <= CHAT_FIELDS, set(body) - CHAT_FIELDS
    assert "cache_control" not in json.dumps(body)


def raw_call(gateway, token, body, headers=None) -> tuple[int, dict, bytes]:
    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"http://127.0.0.1:{gateway.tcp_port}/v1/messages?beta=true",
                json=body,
                headers={"x-api-key": token, "anthropic-version": "2023-06-01", **(headers or {})},
            ) as r:
                return r.status, dict(r.headers), await r.read()

    return asyncio.run(go())


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event, checked: every event named, its data its type."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        events.append((lines["event"], data))
    return events


# ------------------------------------------------------------------------------ text, usage


@pytest.mark.parametrize("mode", GATEWAY_MODES)
@pytest.mark.parametrize("how", HOW)
def test_text_answer_with_usage_in_each_sdk_path(gateway, server, mode, how):
    session = open_session(
        gateway, server, [ScriptedTurn(text="Hello from the engine, in pieces.", chunk_chars=3)], mode=mode
    )
    try:
        message, events = ask(gateway, session, how, system="You are a coding agent.", tools=())
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello from the engine, in pieces.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.model == "claude-sonnet-4-5" and message.role == "assistant" and message.id.startswith("msg_")
    (body,) = sent(server)
    usage = message.usage  # the engine's counts (the synthetic tokenizer's 4-character tokens, plus the end)
    assert usage.input_tokens > 0 and usage.output_tokens > 8
    assert usage.input_tokens + usage.output_tokens == session.turns[0].total_tokens
    assert message.usage.cache_read_input_tokens == 0 and message.usage.cache_creation_input_tokens == 0
    assert_chat_only(body)
    assert body["model"] == "scripted-model" and body["max_tokens"] == 512
    assert body["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": USER["content"]},
    ]
    assert body["stream"] is (how != "whole")
    if how != "whole":
        assert body["stream_options"] == {"include_usage": True}
        types = [e.type for e in events]
        assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
        assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
        assert set(types[2:-3]) == {"content_block_delta"}  # as many as the writes carried (merged per write)
        assert "".join(e.delta.text for e in events[2:-3]) == "Hello from the engine, in pieces."
    (turn,) = session.turns
    assert turn.dialect == "messages" and any(n.startswith("anthropic-version: ") for n in turn.dialect_notes)
    assert turn.upstream_status == 200
    if mode == "transparent_proxy":  # the engine's ids, captured as for any call
        assert len(turn.capture.completion_token_ids) == usage.output_tokens and turn.capture.prompt_token_ids


def test_every_event_on_the_wire_is_what_the_sdk_types_say(gateway, server):
    """The raw bytes: each SSE event named, its data validated (strictly, not `construct`ed)
    against the SDK's RawMessageStreamEvent; the whole answer against Message."""
    turn = ScriptedTurn(
        reasoning="Think first.",
        text="Then say.",
        tool_calls=[ScriptedToolCall(name="Bash", arguments={"command": "ls"})],
        chunk_chars=4,
    )
    session = open_session(gateway, server, [turn, turn])
    body = {"model": "claude-x", "max_tokens": 64, "stream": True, "messages": [USER], "tools": [BASH]}
    status, headers, raw = raw_call(gateway, session.token, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    for name, data in events:
        assert data == {"type": "ping"} if name == "ping" else EVENTS.validate_python(data, strict=True)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [data["delta"]["type"] for name, data in events if name == "content_block_delta"]
    assert deltas.index("signature_delta") == len([d for d in deltas if d == "thinking_delta"])  # ends the thinking
    assert [data["index"] for name, data in events if name == "content_block_stop"] == [0, 1, 2]
    status, headers, raw = raw_call(gateway, session.token, {**body, "stream": False})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    whole = Message.model_validate_json(raw, strict=True)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"] and whole.stop_reason == "tool_use"
    gateway.close_session(session)


# --------------------------------------------------------------- tool use, thinking, history


@pytest.mark.parametrize("how", HOW)
def test_tool_use_and_thinking_then_tool_results_round_trip(gateway, server, how):
    turns = [
        ScriptedTurn(
            reasoning="The file first, then a listing.",
            text="Writing it.",
            chunk_chars=5,
            tool_calls=[
                ScriptedToolCall(name="Write", arguments={"file_path": "/w/hello.txt", "content": "Hello, wörld!\n"}),
                ScriptedToolCall(name="Bash", arguments={"command": "ls -la", "timeout": 5}),
            ],
        ),
        ScriptedTurn(text="Done: hello.txt is there."),
    ]
    session = open_session(gateway, server, turns)
    try:
        first, _ = ask(gateway, session, how)
        thinking, text, write, bash = first.content
        assert thinking.type == "thinking" and thinking.thinking == "The file first, then a listing."
        assert thinking.signature == SYNTHETIC_SIGNATURE
        assert text.type == "text" and text.text == "Writing it."
        assert (write.type, write.name, write.input) == (
            "tool_use",
            "Write",
            {"file_path": "/w/hello.txt", "content": "Hello, wörld!\n"},
        )
        assert (bash.name, bash.input) == ("Bash", {"command": "ls -la", "timeout": 5})
        assert write.id != bash.id and first.stop_reason == "tool_use"
        results = {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": write.id, "content": "File created"},
                {
                    "type": "tool_result",
                    "tool_use_id": bash.id,
                    "is_error": True,
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "hello.txt"}],
                },
                {"type": "text", "text": "<system-reminder>keep going</system-reminder>"},
            ],
        }
        second, _ = ask(gateway, session, how, [USER, first.to_param(), results])
        assert [b.text for b in second.content] == ["Done: hello.txt is there."] and second.stop_reason == "end_turn"
    finally:
        gateway.close_session(session)
    history = sent(server)[1]["messages"]
    assert history == [
        {"role": "user", "content": USER["content"]},
        {
            "role": "assistant",
            "content": "Writing it.",
            "reasoning_content": "The file first, then a listing.",
            "tool_calls": [
                {
                    "id": write.id,
                    "type": "function",
                    "function": {
                        "name": "Write",
                        "arguments": '{"file_path":"/w/hello.txt","content":"Hello, wörld!\\n"}',
                    },
                },
                {
                    "id": bash.id,
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command":"ls -la","timeout":5}'},
                },
            ],
        },
        # the results first, in order, then the turn's text
        {"role": "tool", "tool_call_id": write.id, "content": "File created"},
        {"role": "tool", "tool_call_id": bash.id, "content": "a\nhello.txt"},
        {"role": "user", "content": "<system-reminder>keep going</system-reminder>"},
    ]
    assert "tool_result.is_error" in session.turns[1].dialect_notes


def test_a_history_translates_the_same_however_its_blocks_are_cut():
    """Claude Code moves cache_control along the conversation and sends a string or a block list:
    the chat messages must not change (token-in bridges only an unchanged history)."""
    dialect = MessagesDialect()

    def translated(messages):
        return dialect.to_chat({"model": "m", "max_tokens": 8, "messages": messages}, Route()).chat["messages"]

    plain = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "go"},
    ]
    blocks = [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
        {"role": "user", "content": [{"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}}]},
    ]
    assert translated(plain) == translated(blocks)
    call = dialect.to_chat(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": SYNTHETIC_SIGNATURE},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"z": 1, "a": [1, {"b": "é"}]}},
                    ],
                }
            ],
        },
        Route(),
    )
    assert call.chat["messages"] == [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hm",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": '{"z":1,"a":[1,{"b":"é"}]}'}}
            ],
        }
    ]
    assert "redacted_thinking (dropped)" in call.notes


# ------------------------------------------------------------------------- stop reasons


@pytest.mark.parametrize("how", HOW)
def test_a_length_cut_is_max_tokens(gateway, server, how):
    session = open_session(gateway, server, [ScriptedTurn(text="cut he", finish_reason="length")])
    message, _ = ask(gateway, session, how, tools=(), max_tokens=2)
    gateway.close_session(session)
    assert message.stop_reason == "max_tokens" and message.content[0].text == "cut he"
    assert sent(server)[0]["max_tokens"] == 2


def test_tool_choice_stop_sequences_and_sampling_reach_the_engine_as_chat_fields(gateway, server):
    session = open_session(gateway, server, [ScriptedTurn(text="ok")])
    ask(
        gateway,
        session,
        "whole",
        tool_choice={"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
        stop_sequences=["END", "###"],
        extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 40},  # Claude Code's older API; not in this SDK
    )
    gateway.close_session(session)
    (body,) = sent(server)
    assert_chat_only(body)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
    assert body["parallel_tool_calls"] is False and body["stop"] == ["END", "###"]
    assert body["temperature"] == 0.3 and body["top_p"] == 0.9 and "top_k" not in body
    assert "top_k: 40 (not a Chat Completions field)" in session.turns[0].dialect_notes
    for choice, chat in (({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")):
        request = {"model": "m", "max_tokens": 8, "messages": [USER], "tools": [BASH], "tool_choice": choice}
        assert MessagesDialect().to_chat(request, Route()).chat["tool_choice"] == chat


def test_a_matched_stop_sequence_is_stop_sequence_streamed_and_whole():
    """vLLM names the stop string that ended the answer (`stop_reason`); the scripted server
    does not, so the translator is fed what vLLM sends."""
    dialect = MessagesDialect()
    request = {"model": "m", "max_tokens": 8, "messages": [USER], "stop_sequences": ["END"], "stream": True}
    call = dialect.to_chat(request, Route())
    chunks = [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]},
    ]
    stream = AnswerStream(dialect, call, 200, "text/event-stream")
    raw = stream.feed(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)) + stream.finish()
    delta = [data for name, data in sse_events(raw) if name == "message_delta"][0]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    call.streamed = False
    whole = {
        "id": "c",
        "choices": [{"index": 0, "message": {"content": "a"}, "finish_reason": "stop", "stop_reason": "END"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    answer = json.loads(AnswerStream(dialect, call, 200, "application/json").finish(json.dumps(whole).encode()))
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", "END")


# ------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "status, exception, kind",
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
        (503, anthropic.InternalServerError, "overloaded_error"),
        (529, anthropic.OverloadedError, "overloaded_error"),
    ],
)
def test_an_upstream_error_is_the_sdks_typed_exception(gateway, server, stream, status, exception, kind):
    error = {"error": {"message": f"engine says {status}", "type": "whatever"}}
    session = open_session(gateway, server, [ScriptedTurn(fault=Fault(http_status=status, body=error))])
    with pytest.raises(exception) as raised:
        ask(gateway, session, "create_stream" if stream else "whole", tools=())
    gateway.close_session(session)
    assert raised.value.status_code == status
    assert raised.value.body == {"type": "error", "error": {"type": kind, "message": f"engine says {status}"}}
    assert session.turns[0].upstream_status == status


@pytest.mark.parametrize(
    "request_change, named",
    [
        ({"tools": [BASH, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, "'web_search'"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "'bash_20250124'"),
        ({"tools": [{"type": "code_execution_20250825", "name": "code_execution"}]}, "code_execution"),
        ({"mcp_servers": [{"type": "url", "url": "https://example.invalid/mcp", "name": "x"}]}, "mcp_servers"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            }
                        ],
                    }
                ]
            },
            "image blocks",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "text", "data": "x", "media_type": "text/plain"}}
                        ],
                    }
                ]
            },
            "document blocks",
        ),
        ({"max_tokens": None}, "`max_tokens` is required"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_anthropics_shape_and_never_sent(gateway, server, request_change, named):
    session = open_session(gateway, server, [ScriptedTurn(text="never")])
    body = {"model": "claude-x", "max_tokens": 64, "messages": [USER], **request_change}
    body = {k: v for k, v in body.items() if v is not None}
    status, headers, raw = raw_call(gateway, session.token, body)
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    error = json.loads(raw)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    if "max_tokens" in body:  # (the SDK insists on max_tokens itself: there the raw call is the test)
        known = {k: v for k, v in body.items() if k in ("model", "max_tokens", "messages", "tools")}
        with pytest.raises(anthropic.BadRequestError, match="invalid_request_error"):
            client(gateway, session).messages.create(**known, extra_body={k: body[k] for k in body.keys() - known})
    gateway.close_session(session)
    assert sent(server) == [] and session.turns == []


def test_an_error_inside_the_stream_is_an_error_event_the_sdk_raises():
    """An upstream that fails after its stream began (an `error` chunk): the SDK raises it."""
    dialect = MessagesDialect()
    call = dialect.to_chat({"model": "m", "max_tokens": 8, "messages": [USER], "stream": True}, Route())
    translation = AnswerStream(dialect, call, 200, "text/event-stream")
    raw = translation.feed(
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"par"}}]}\n\n'
        b'data: {"error":{"message":"engine fell over","type":"overloaded_error"}}\n\n'
    )
    raw += translation.finish()
    names = [name for name, _ in sse_events(raw)]
    assert names[-1] == "error" and "message_stop" not in names
    transport = httpx2.MockTransport(
        lambda request: httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)
    )
    sdk = anthropic.Anthropic(
        api_key="x", base_url="http://127.0.0.1:9", http_client=httpx2.Client(transport=transport), max_retries=0
    )
    with pytest.raises(anthropic.APIStatusError, match="engine fell over") as raised:
        list(sdk.messages.create(model="m", max_tokens=8, messages=[USER], stream=True))
    assert raised.value.body == {"type": "error", "error": {"type": "overloaded_error", "message": "engine fell over"}}


def test_a_cut_off_stream_still_ends_with_message_delta_and_message_stop():
    dialect = MessagesDialect()
    call = dialect.to_chat({"model": "m", "max_tokens": 8, "messages": [USER], "stream": True}, Route())
    translation = AnswerStream(dialect, call, 200, "text/event-stream")
    raw = translation.feed(
        b'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t",'
        b'"function":{"name":"Bash","arguments":"{\\"comm"}}]}}]}\n\ndata: {"id":"c","choi'
    )
    raw += translation.finish()  # no finish reason, no [DONE], half an event
    events = sse_events(raw)
    names = [name for name, _ in events]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2
    for name, data in events:
        assert data == {"type": "ping"} if name == "ping" else EVENTS.validate_python(data, strict=True)


# ------------------------------------------------------------------------- notes, budget


def test_fields_without_meaning_for_an_open_engine_are_noted_never_forwarded(gateway, server):
    session = open_session(gateway, server, [ScriptedTurn(text="ok")])
    body = {
        "model": "claude-x",
        "max_tokens": 64,
        "stream": True,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
        ],
        "system": [
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "tools": [{**BASH, "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "metadata": {"user_id": "u"},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
        "service_tier": "auto",
        "container": "c1",
        "mcp_servers": [],
        "brand_new_field": 1,
    }
    status, _, raw = raw_call(
        gateway, session.token, body, headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    )
    assert session.wait_idle(5)
    gateway.close_session(session)
    assert status == 200 and sse_events(raw)[-1][0] == "message_stop"
    (upstream,) = sent(server)
    assert_chat_only(upstream)
    assert upstream["messages"][0] == {"role": "system", "content": "You are Claude Code.\nBe brief."}
    assert upstream["tools"] == [
        {
            "type": "function",
            "function": {"name": "Bash", "description": BASH["description"], "parameters": BASH["input_schema"]},
        }
    ]
    assert session.turns[0].dialect_notes == [
        "cache_control",
        "thinking: enabled (budget_tokens 31999)",
        "metadata",
        "context_management",
        "output_config",
        "service_tier",
        "container",
        "brand_new_field (unknown field, not forwarded)",
        "anthropic-version: 2023-06-01",
        "anthropic-beta: claude-code-20250219,interleaved-thinking-2025-05-14",
    ]


@pytest.mark.parametrize("how", HOW)
def test_past_the_budget_the_agent_gets_an_empty_final_message(gateway, server, how):
    session = open_session(gateway, server, [ScriptedTurn(text="a"), ScriptedTurn(text="b")], max_turns=1)
    ask(gateway, session, how, tools=())
    message, _ = ask(
        gateway,
        session,
        how,
        [USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}],
        tools=(),
    )
    gateway.close_session(session)
    assert message.content == [] and message.stop_reason == "end_turn"
    assert len(sent(server)) == 1 and session.budget_exhausted


# ---------------------------------------------------------------------------- the gate


@pytest.mark.parametrize("how", HOW)
def test_interception_gate_hands_the_translated_call_to_the_trainer(gateway, how):
    session = gateway.open_session(
        Upstream("http://interception-gate.invalid/v1", None, "trainer-model"),
        mode="interception_gate",
        gate_timeout_s=30,
    )
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pending = pool.submit(ask, gateway, session, how, system="sys")
        request = session.strategy.next_request(5)
        assert request.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": USER["content"]}]
        assert [t["function"]["name"] for t in request.tools] == ["Bash", "Write"]
        assert_chat_only(request.body)
        session.strategy.deliver(
            request,
            GateCompletion(
                token_ids=[101, 102, 103],
                logprobs=[-0.5, None, -0.25],
                prompt_token_ids=[1, 2],
                message={
                    "reasoning_content": "Plan.",
                    "content": "Listing.",
                    "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}],
                },
            ),
        )
        message, _ = pending.result(10)
        assert session.wait_idle(5)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        gateway.close_session(session)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"command": "ls"} and message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (2, 3)
    (turn,) = session.turns
    assert turn.capture.completion_token_ids == [101, 102, 103] and turn.dialect == "messages"


# ---------------------------------------------------------------------------- token-in


@pytest.fixture(scope="module")
def token_in(tmp_path_factory):
    """(token engine server, renderer spec): the scripted token engine and chatml-hermes."""
    pytest.importorskip("renderers", reason="token-in needs pi-env[token-in] (the dev extra installs it)")
    transformers = pytest.importorskip("transformers")
    from test_token_in import TEMPLATE, corpus

    from pi_env.proxy.token_in import load_renderer
    from pi_env.scripted import ScriptedServer
    from pi_env.scripted.token_engine import TokenEngine
    from pi_env.testing.tiny_tokenizer import make_tokenizer_dir

    directory = make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"), corpus(), chat_template=TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    with ScriptedServer(token_engine=TokenEngine(tokenizer)) as engine:
        yield engine, load_renderer("chatml-hermes", str(directory))


@pytest.mark.parametrize("how", ["create_stream", "whole"])
def test_token_in_two_calls_of_one_conversation_are_one_sequence(gateway, token_in, how):
    from pi_env.proxy.rewrite import CaptureOptions
    from pi_env.training import build_training_trace
    from pi_env.turns import rollout_turn

    engine, spec = token_in
    turns = [
        ScriptedTurn(
            text="I will list the files.",
            tool_calls=[ScriptedToolCall(name="Bash", arguments={"command": "ls", "timeout": 5})],
        ),
        ScriptedTurn(text="Two files: a and b."),
    ]
    key = engine.add_script(turns)
    session = gateway.open_session(
        Upstream(engine.base_url, key, "scripted-model"),
        mode="transparent_proxy",
        capture=CaptureOptions(model="scripted-model", top_logprobs=2),
        token_in=spec,
    )
    try:
        first, _ = ask(gateway, session, how, system="You are Claude Code.", tools=(BASH,))
        text, tool_use = first.content
        assert text.text == "I will list the files." and tool_use.input == {"command": "ls", "timeout": 5}
        results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "a\nb"}]}
        second, _ = ask(
            gateway, session, how, [USER, first.to_param(), results], system="You are Claude Code.", tools=(BASH,)
        )
        assert second.content[0].text == "Two files: a and b."
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    records = [t.capture.token_in for t in session.turns]
    assert [r["outcome"] for r in records] == ["first", "bridged"], records[1].get("reason")
    assert [r["sequence"] for r in records] == [0, 0]
    trace = build_training_trace([rollout_turn(t) for t in session.turns])
    assert trace.append_only and len(trace.segments) == 1


# ------------------------------------------------------------------- Claude Code's own call


def test_claude_codes_own_request_translates_without_refusal():
    """Claude Code 2.1.332's first request, as it sent it (the claude-code agent's fixture)."""
    body = json.loads(FIXTURE.read_text())
    call = MessagesDialect().to_chat(body, Route())
    assert_chat_only(call.chat)
    assert call.model == body["model"] and call.streamed and call.chat["max_tokens"] == 32000
    roles = [m["role"] for m in call.chat["messages"]]
    assert roles == ["system", "user", "system"]  # its environment rides in a mid-conversation system turn
    system = call.chat["messages"][0]["content"]
    assert system.startswith("You are a Claude agent") and "x-anthropic-billing-header" not in system
    names = [t["function"]["name"] for t in call.chat["tools"]]
    assert {"Bash", "Write"} <= set(names) and "DeferredToolPlaceholder" not in names and len(names) == 11
    assert call.notes == [
        "system: x-anthropic-billing-header (dropped)",
        "cache_control",
        "tools[].defer_loading (1 deferred tools left out)",
        "thinking: adaptive",
        "metadata",
        "context_management",
        "output_config",
    ]


def test_an_upstream_dying_mid_stream_fails_the_agents_call_as_in_chat(gateway, server):
    """The gateway breaks the agent's connection (as for a Chat Completions agent), so the SDK
    raises a connection error the agent retries, never a stream that looks whole."""
    turns = [ScriptedTurn(text="x" * 50, chunk_chars=1, fault=Fault(disconnect_after_chunks=5))]
    session = open_session(gateway, server, turns)
    with pytest.raises(anthropic.APIConnectionError):
        ask(gateway, session, "create_stream", tools=())
    assert session.wait_idle(5)
    gateway.close_session(session)
    assert session.turns[0].upstream_error.startswith("upstream stream broken")


def test_whole_tool_arguments_that_are_not_a_json_object_reach_the_agent_as_text():
    dialect = MessagesDialect()
    call = dialect.to_chat({"model": "m", "max_tokens": 8, "messages": [USER]}, Route())
    answer = {
        "id": "c",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "content": None,
                    "tool_calls": [
                        {"index": 0, "id": "t1", "function": {"name": "Bash", "arguments": '{"command": "ls"'}},
                        {"index": 1, "id": "t2", "function": {"name": "Bash", "arguments": '{"command":"pwd"}'}},
                    ],
                },
            }
        ],
    }
    raw = AnswerStream(dialect, call, 200, "application/json").finish(json.dumps(answer).encode())
    message = Message.model_validate_json(raw, strict=True)
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == '{"command": "ls"' and message.content[1].input == {"command": "pwd"}
    assert message.stop_reason == "tool_use" and message.usage.input_tokens == 0


def test_the_sdks_beta_client_reaches_the_beta_route_with_its_betas_noted(gateway, server):
    """Claude Code's route: POST /v1/messages?beta=true with anthropic-beta values."""
    session = open_session(gateway, server, [ScriptedTurn(text="beta ok")])
    sdk = client(gateway, session)
    with sdk.beta.messages.stream(
        model="claude-x",
        max_tokens=32,
        messages=[USER],
        betas=["interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        message = stream.get_final_message()
    assert session.wait_idle(5)
    gateway.close_session(session)
    assert message.content[0].text == "beta ok" and message.stop_reason == "end_turn"
    assert server.requests[0].path == "/v1/chat/completions"
    notes = session.turns[0].dialect_notes
    assert "anthropic-beta: interleaved-thinking-2025-05-14,context-management-2025-06-27" in notes
    assert "thinking: enabled (budget_tokens 1024)" in notes


def test_every_answer_has_a_message_id_of_its_own_whatever_the_engine_repeats():
    """Claude Code folds consecutive assistant messages that share an id into one: an engine
    that repeats its chat ids must not make two turns one."""
    from pi_env.proxy.capture import MessageDelta
    from pi_env.proxy.dialects.base import ChatChunk, Choice, Route
    from pi_env.proxy.dialects.messages import MessagesDialect

    dialect = MessagesDialect()
    call = dialect.to_chat({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}, Route())
    answer = ChatChunk(id="chatcmpl-same", choices=[Choice(message=MessageDelta(content="ok"), finish_reason="stop")])
    ids = {json.loads(dialect.translator(call).whole(answer))["id"] for _ in range(3)}
    streamed = dialect.translator(call).events(
        [ChatChunk(id="chatcmpl-same", choices=[Choice(delta=MessageDelta(content="a"))])]
    )
    assert len(ids) == 3 and b"chatcmpl-same" not in streamed
