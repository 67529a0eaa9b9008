"""The dialect layer's shared parts (proxy/dialects/base.py): the routes each dialect claims, the
session token in each SDK's key header, and how a Chat Completions stream reaches a translator
(split at any byte, text runs merged, a cut stream still closed)."""

import msgspec
import pytest

from pi_env.proxy.capture import MessageDelta
from pi_env.proxy.dialects import match_route
from pi_env.proxy.dialects.base import AnswerStream, AnswerTranslator, ChatChunk, Choice, DialectCall, coalesce


@pytest.mark.parametrize("method, target, expected", [
    ("POST", "/v1/responses", ("responses", None, "sse")),
    ("POST", "/v1/messages", ("messages", None, "sse")),
    ("POST", "/v1/messages?beta=true", ("messages", None, "sse")),
    ("POST", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", ("gemini", True, "sse")),
    ("POST", "/v1beta/models/m:streamGenerateContent", ("gemini", True, "json_array")),
    ("POST", "/v1beta/models/m:generateContent", ("gemini", False, "sse")),
    ("GET", "/v1/responses", None),
    ("POST", "/v1/responses?x=1", None),
    ("POST", "/v1/messages/count_tokens", None),
    ("POST", "/v1beta/models/m:generateContent?alt=sse", None),
    ("POST", "/v1beta/models/..:generateContent", None),
    ("POST", "/v1beta/models/a%2Fb:generateContent", None),
    ("POST", "/v1beta/models/a/b:generateContent", None),
    ("POST", "/v1beta/models/m:countTokens", None),
])  # fmt: skip
def test_each_dialect_claims_its_exact_routes_only(method, target, expected):
    found = match_route(method, target)
    if expected is None:
        assert found is None
    else:
        dialect, route = found
        assert (dialect.name, route.streamed, route.framing) == expected


class Recorder(AnswerTranslator):
    """Records what it is fed, as text: what a translator receives from AnswerStream."""

    def __init__(self, call):
        super().__init__(call)
        self.fed: list[ChatChunk] = []
        self.closed = 0

    def events(self, chunks):
        self.fed += chunks
        return b"".join(msgspec.json.encode(c) + b"\n" for c in chunks)

    def close(self):
        self.closed += 1
        return b"END"

    def whole(self, answer):
        return b"WHOLE"


class RecordingDialect:
    name = "recording"
    stream_content_type = "text/event-stream"

    def translator(self, call):
        self.recorder = Recorder(call)
        return self.recorder

    def error_body(self, status, message, kind):
        return msgspec.json.encode({"status": status, "message": message, "kind": kind})


def chunk_line(**delta) -> bytes:
    body = {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                    "logprobs": {"content": [{"token": "x", "logprob": -1.0, "top_logprobs": []}]}}]}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


FINISH = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}\n\n'


def feed(stream: AnswerStream, data: bytes, piece: int) -> bytes:
    out = b""
    for start in range(0, len(data), piece):
        out += stream.feed(data[start : start + piece])
    return out + stream.finish()


@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_a_stream_split_anywhere_reaches_the_translator_whole_with_text_runs_merged(piece):
    body = (chunk_line(role="assistant", content="") + chunk_line(content="Hel") + chunk_line(content="lo")
            + chunk_line(reasoning_content="think") + chunk_line(content=' é"') + FINISH + USAGE
            + b"data: [DONE]\n\n")  # fmt: skip
    dialect = RecordingDialect()
    stream = AnswerStream(dialect, DialectCall("recording", {}, True, "m"), 200, "text/event-stream")
    feed(stream, body, piece)
    recorder = dialect.recorder
    text = "".join(c.choices[0].delta.content or "" for c in recorder.fed if c.choices)
    assert text == 'Hello é"'
    assert "".join(c.choices[0].delta.reasoning_content or "" for c in recorder.fed if c.choices) == "think"
    assert [c.choices[0].finish_reason for c in recorder.fed if c.choices] [-1] == "stop"
    assert recorder.fed[-1].usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert recorder.closed == 1
    if piece > len(body):  # one write: "Hel" + "lo" became one chunk, the reasoning stayed apart
        assert [c.choices[0].delta.content for c in recorder.fed[:4]] == ["", "Hello", None, ' é"']


def test_coalesce_merges_only_runs_of_one_kind_of_text():
    def c(**delta):
        return ChatChunk(choices=[Choice(delta=MessageDelta(**delta))])

    merged = coalesce([c(content="a"), c(content="b"), c(reasoning_content="r"), c(reasoning_content="s"),
                       c(content="c"), ChatChunk(choices=[Choice(delta=MessageDelta(), finish_reason="stop")])])
    assert [(m.choices[0].delta.content, m.choices[0].delta.reasoning_content) for m in merged] == [
        ("ab", None), (None, "rs"), ("c", None), (None, None)]
    assert merged[-1].choices[0].finish_reason == "stop"


def test_a_cut_stream_is_still_closed_and_an_error_body_is_the_dialects():
    dialect = RecordingDialect()
    stream = AnswerStream(dialect, DialectCall("recording", {}, True, "m"), 200, "text/event-stream")
    assert stream.feed(chunk_line(content="par")[:-3]) == b""  # no whole line yet
    assert stream.finish().endswith(b"END") and dialect.recorder.closed == 1
    error = AnswerStream(dialect, DialectCall("recording", {}, True, "m"), 429, "application/json")
    error.feed(b'{"error": {"message": "slow down", "type": "rate_limit"}}')
    assert msgspec.json.decode(error.finish()) == {"status": 429, "message": "slow down", "kind": "rate_limit"}


# -- the gateway's own refusals reach an agent in its dialect's error shape

ERROR_SHAPES = {  # dialect route -> how its SDK reads an error body: (message, status) out of it
    "/v1/responses": lambda b: (b["error"]["message"], None),
    "/v1/messages?beta=true": lambda b: (b["error"]["message"], b["type"]),
    "/v1beta/models/m:streamGenerateContent?alt=sse": lambda b: (b["error"]["message"], b["error"]["code"]),
}


def post(gateway, target: str, headers: dict, data: bytes) -> tuple[int, dict]:
    import asyncio

    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as client:
            url = f"http://127.0.0.1:{gateway.tcp_port}{target}"
            async with client.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as r:
                return r.status, msgspec.json.decode(await r.read())

    return asyncio.run(go())


@pytest.mark.parametrize("target", sorted(ERROR_SHAPES))
def test_the_gateways_own_refusals_are_in_the_agents_dialect(gateway, server, target):
    from pi_env.proxy import Upstream
    from pi_env.proxy.policy import SessionLimits

    status, body = post(gateway, target, {"x-api-key": "not-a-session"}, b"{}")
    message, extra = ERROR_SHAPES[target](body)
    assert status == 401 and "session token" in message and extra in (None, "error", 401)
    session = gateway.open_session(Upstream(server.base_url, "k", "m"), limits=SessionLimits(max_request_bytes=64))
    try:
        status, body = post(gateway, target, {"x-goog-api-key": session.token}, b"{" + b" " * 100 + b"}")
    finally:
        gateway.close_session(session)
    message, extra = ERROR_SHAPES[target](body)
    assert status == 413 and "bytes" in message and extra in (None, "error", 413)
    assert server.requests == []  # nothing refused ever went upstream


# -- one decode serves the translation and the capture: the record is the one Chat Completions gets

DIALECT_CALLS = {  # a streamed call of each dialect, asking the same as CHAT
    "/v1/responses": {"model": "m", "stream": True, "input": "hi"},
    "/v1/messages": {"model": "m", "stream": True, "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}]},
    "/v1beta/models/m:streamGenerateContent?alt=sse": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
}
CHAT = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4096,
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip


def captured(turn) -> dict:
    capture = turn.capture
    (choice,) = capture.choices
    return {"prompt_token_ids": capture.prompt_token_ids, "usage": capture.usage, "source": capture.token_ids_source,
            "missing": capture.token_ids_missing_reason, "malformed": capture.malformed_chunks,
            "message": choice.message(), "finish": choice.finish_reason, "ids": choice.token_ids,
            "logprobs": choice.logprobs, "tokens": choice.tokens, "tops": choice.decoded_top_logprobs(),
            "total_tokens": turn.total_tokens}  # fmt: skip


@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
@pytest.mark.parametrize("size", ["small", "large"])  # large: past assembly.OFFLOAD_MIN_BYTES (chat: the worker)
def test_a_dialects_capture_is_exactly_chat_completions_capture(gateway, server, mode, size):
    from pi_env.proxy import Upstream
    from pi_env.proxy.rewrite import CaptureOptions
    from pi_env.scripted import ScriptedToolCall, ScriptedTurn

    text = "Hello, world. " * (400 if size == "large" else 3)
    turn = ScriptedTurn(text=text, reasoning="Let me think.", chunk_chars=3, null_logprob_every=7,
                        tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls -la"})])  # fmt: skip
    records = {}
    for target, body in [("/v1/chat/completions", CHAT), *DIALECT_CALLS.items()]:
        session = gateway.open_session(Upstream(server.base_url, server.add_script([turn], api_key="k"), "m"),
                                       mode=mode, capture=CaptureOptions(model="m", top_logprobs=2, return_token_ids=True))  # fmt: skip
        try:
            status, _ = post_raw(gateway, target, session.token, body)
            assert status == 200
            assert session.wait_idle(10)
            (records[target],) = session.turns
        finally:
            gateway.close_session(session)
    chat = captured(records.pop("/v1/chat/completions"))
    if mode == "transparent_proxy":
        assert chat["source"] == "token_ids" and len(chat["ids"]) > 5 and None in chat["logprobs"]
    assert chat["message"]["tool_calls"] and chat["message"]["reasoning_content"] == "Let me think."
    for target, record in records.items():
        assert record.dialect and captured(record) == chat, target


def post_raw(gateway, target: str, token: str, body: dict) -> tuple[int, bytes]:
    import asyncio

    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as client:
            url = f"http://127.0.0.1:{gateway.tcp_port}{target}"
            async with client.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as r:
                return r.status, await r.read()

    return asyncio.run(go())
