"""The scripted OpenAI-compatible server, over real HTTP: stream shape, turn selection, faults,
synthetic logprobs/token ids, and its CLI."""

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest

from helpers import USER, chat

from pi_env.scripted import Fault, ScriptedToolCall, ScriptedTurn
from pi_env.scripted.script import SCRIPT_FINISHED_TEXT, synthetic_token_id



async def _post(url, key, body, timeout=10):
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        async with client.post(url + "/chat/completions", json=body, headers=headers) as r:
            return r.status, r.headers, await r.read()


def post(server, key, body, timeout=10):
    return asyncio.run(_post(server.base_url, key, body, timeout))


def sse_data(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE stream, in order (a plain reader, no SSE library)."""
    events = []
    for block in raw.decode().split("\n\n"):
        lines = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
        if lines:
            events.append("\n".join(lines))
    return events


def stream_chunks(raw: bytes) -> list[dict]:
    events = sse_data(raw)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def content_of(chunks, field="content"):
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


def test_text_stream_has_the_shape_pi_needs(server):
    key = server.add_script([ScriptedTurn(text="Hello, world!", chunk_chars=5)])
    status, headers, raw = post(server, key, chat())
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["x-pi-env-synthetic"] == "1"
    chunks = stream_chunks(raw)
    assert all(c["system_fingerprint"] == "pi-env-synthetic" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert pieces == ["Hello", ", wor", "ld!"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 2 + 2 + 1  # 4-char synthetic tokens within each piece
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 4


def test_usage_chunk_only_when_asked(server):
    key = server.add_script([ScriptedTurn(text="hi")])
    body = chat()
    del body["stream_options"]
    chunks = stream_chunks(post(server, key, body)[2])
    assert all(c["choices"] for c in chunks) and "usage" not in chunks[-1]


def test_tool_call_deltas_carry_index(server):
    calls = [
        ScriptedToolCall(name="bash", arguments={"command": "ls -la /root/workdir"}),
        ScriptedToolCall(name="write", arguments='{"path": "a.py", "content": "x"}', id="call_w"),
    ]
    key = server.add_script([ScriptedTurn(tool_calls=calls, chunk_chars=7)])
    chunks = stream_chunks(post(server, key, chat())[2])
    deltas = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert all("index" in d for d in deltas)
    headers = [d for d in deltas if "id" in d]
    assert [(h["index"], h["id"], h["type"], h["function"]) for h in headers] == [
        (0, "call_0_0", "function", {"name": "bash", "arguments": ""}),
        (1, "call_w", "function", {"name": "write", "arguments": ""}),
    ]
    for index, call in enumerate(calls):
        pieces = [d["function"]["arguments"] for d in deltas if d["index"] == index and "id" not in d]
        assert len(pieces) > 1 and all(len(p) <= 7 for p in pieces)
        assert "".join(pieces) == call.arguments_json()
    assert all(set(d) == {"index", "function"} for d in deltas if "id" not in d)
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_deltas(server, field):
    key = server.add_script([ScriptedTurn(reasoning="Think first.", text="Done.", reasoning_field=field)])
    chunks = stream_chunks(post(server, key, chat())[2])
    assert content_of(chunks, field) == "Think first."
    assert content_of(chunks) == "Done."
    first_content = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    last_reasoning = max(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get(field))
    assert last_reasoning < first_content


def test_turn_is_the_number_of_assistant_messages(server):
    key = server.add_script([ScriptedTurn(text="first"), ScriptedTurn(text="second")])
    history = [USER]
    assert content_of(stream_chunks(post(server, key, chat(history))[2])) == "first"
    assert content_of(stream_chunks(post(server, key, chat(history))[2])) == "first"  # a retry
    history += [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "content": "ok", "tool_call_id": "x"}]
    assert content_of(stream_chunks(post(server, key, chat(history))[2])) == "second"
    history += [{"role": "assistant", "content": "second"}, {"role": "user", "content": "more"}]
    assert content_of(stream_chunks(post(server, key, chat(history))[2])) == SCRIPT_FINISHED_TEXT


def test_scripts_are_selected_by_key(server):
    key_a = server.add_script([ScriptedTurn(text="A")])
    key_b = server.add_script([ScriptedTurn(text="B")], api_key="sk-chosen")
    assert key_b == "sk-chosen" and key_a != key_b
    assert content_of(stream_chunks(post(server, key_a, chat())[2])) == "A"
    assert content_of(stream_chunks(post(server, key_b, chat())[2])) == "B"
    status, _, raw = post(server, "sk-unknown", chat())
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    server.set_default([ScriptedTurn(text="D")])
    assert content_of(stream_chunks(post(server, "sk-unknown", chat())[2])) == "D"
    server.remove_script(key_a)
    assert content_of(stream_chunks(post(server, key_a, chat())[2])) == "D"


def test_requests_are_recorded(server):
    key = server.add_script([ScriptedTurn(text="x")])
    post(server, key, chat())
    (received,) = server.requests
    assert received.path == "/v1/chat/completions" and received.method == "POST"
    assert received.api_key == key and received.headers["authorization"] == f"Bearer {key}"
    assert received.body["messages"] == [USER]


def test_a_body_that_is_not_a_json_object_is_a_400(server):
    async def send(data):
        async with aiohttp.ClientSession() as client:
            async with client.post(server.base_url + "/chat/completions", data=data) as r:
                return r.status, await r.json()

    for data in (b"{not json", b"[1, 2]"):
        status, body = asyncio.run(send(data))
        assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_non_streaming_completion(server):
    turn = ScriptedTurn(text="Hi", reasoning="hmm", tool_calls=[ScriptedToolCall(name="read", arguments={"path": "a"})])
    key = server.add_script([turn])
    status, headers, raw = post(server, key, chat(stream=False, logprobs=True, return_token_ids=True))
    body = json.loads(raw)
    assert status == 200 and headers["x-pi-env-synthetic"] == "1"
    assert body["object"] == "chat.completion" and body["system_fingerprint"] == "pi-env-synthetic"
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Hi" and choice["message"]["reasoning_content"] == "hmm"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "read", "arguments": '{"path": "a"}'}
    assert choice["finish_reason"] == "tool_calls"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------ faults


def test_fault_http_status(server):
    key = server.add_script([
        ScriptedTurn(fault=Fault(http_status=503, body={"error": {"message": "overloaded"}})),
        ScriptedTurn(fault=Fault(http_status=400)),
    ])
    status, headers, raw = post(server, key, chat())
    assert status == 503 and json.loads(raw) == {"error": {"message": "overloaded"}}
    assert headers["x-pi-env-synthetic"] == "1"
    status, _, raw = post(server, key, chat([USER, {"role": "assistant", "content": "x"}]))
    assert status == 400 and json.loads(raw)["error"]["type"] == "scripted_fault"


def test_fault_hang(server):
    key = server.add_script([ScriptedTurn(text="late", fault=Fault(hang_s=0.5))])
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        post(server, key, chat(), timeout=0.2)
    status, _, raw = post(server, key, chat())
    assert status == 200 and content_of(stream_chunks(raw)) == "late"
    assert time.monotonic() - started >= 0.7


def test_fault_malformed_chunk(server):
    key = server.add_script([ScriptedTurn(text="abcdefgh", chunk_chars=1, fault=Fault(malformed_chunk=True))])
    events = sse_data(post(server, key, chat())[2])

    def is_json(event):
        try:
            json.loads(event)
        except ValueError:
            return False
        return True

    bad = [i for i, e in enumerate(events) if e != "[DONE]" and not is_json(e)]
    assert len(bad) == 1 and 0 < bad[0] < len(events) - 1
    good = [json.loads(e) for i, e in enumerate(events[:-1]) if i != bad[0]]
    assert content_of(good) == "abcdefgh" and events[-1] == "[DONE]"


def test_fault_disconnect_mid_stream(server):
    key = server.add_script([ScriptedTurn(text="x" * 100, chunk_chars=1, fault=Fault(disconnect_after_chunks=3))])
    received = []

    async def read():
        async with aiohttp.ClientSession() as client:
            headers = {"Authorization": f"Bearer {key}"}
            async with client.post(server.base_url + "/chat/completions", json=chat(), headers=headers) as r:
                async for chunk in r.content.iter_any():
                    received.append(chunk)

    with pytest.raises(aiohttp.ClientPayloadError):
        asyncio.run(read())
    assert len(sse_data(b"".join(received))) == 3


def test_fault_delay_between_chunks(server):
    key = server.add_script([ScriptedTurn(text="abcd", chunk_chars=1, fault=Fault(delay_s=0.05))])
    started = time.monotonic()
    raw = post(server, key, chat())[2]
    events = sse_data(raw)
    assert content_of(stream_chunks(raw)) == "abcd"
    assert time.monotonic() - started >= 0.05 * (len(events) - 1)


# ------------------------------------------------------------------- logprobs and token ids


def test_logprobs_and_token_ids_align(server):
    key = server.add_script([ScriptedTurn(reasoning="Let me see.", text="The answer is 42, clearly.", chunk_chars=6,
                                          tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "true"})])])
    body = chat(logprobs=True, top_logprobs=3, return_token_ids=True)
    chunks = stream_chunks(post(server, key, body)[2])
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "prompt_token_ids" in chunks[0] and all("prompt_token_ids" not in c for c in chunks[1:])
    assert len(chunks[0]["prompt_token_ids"]) == chunks[-1]["usage"]["prompt_tokens"]
    total = 0
    for choice in choices:
        entries = (choice["logprobs"] or {"content": []})["content"]
        assert len(entries) == len(choice["token_ids"])  # 1:1, chunk by chunk
        assert choice["token_ids"] == [synthetic_token_id(e["token"]) for e in entries]
        delta = choice["delta"]
        text = delta.get("content") or delta.get("reasoning_content") or "".join(
            tc["function"].get("arguments", "") for tc in delta.get("tool_calls", []))
        assert "".join(e["token"] for e in entries) == text
        for e in entries:
            assert e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
            assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        total += len(entries)
    assert total == chunks[-1]["usage"]["completion_tokens"] > 0
    # Deterministic: the same request gets the same synthetic values.
    again = stream_chunks(post(server, key, body)[2])
    strip = lambda cs: [(c.get("prompt_token_ids"), c["choices"]) for c in cs]  # noqa: E731
    assert strip(again) == strip(chunks)


def test_no_token_fields_unless_asked(server):
    key = server.add_script([ScriptedTurn(text="plain")])
    chunks = stream_chunks(post(server, key, chat())[2])
    assert all(c["choices"][0]["logprobs"] is None and "token_ids" not in c["choices"][0] for c in chunks[:-1])
    assert "prompt_token_ids" not in chunks[0]


def test_prompt_token_ids_extend_across_turns(server):
    key = server.add_script([ScriptedTurn(text="one"), ScriptedTurn(text="two")])
    first = [USER]
    second = first + [{"role": "assistant", "content": "one"}, {"role": "user", "content": "go on"}]
    ids = [stream_chunks(post(server, key, chat(m, return_token_ids=True))[2])[0]["prompt_token_ids"]
           for m in (first, second)]
    assert ids[1][: len(ids[0])] == ids[0] and len(ids[1]) > len(ids[0])


# ----------------------------------------------------------------------------------- the CLI


def test_cli_serves_a_script_file(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": [{"text": "from file"}], "scripts": {"sk-x": [{"text": "keyed"}]}}))
    proc = subprocess.Popen([sys.executable, "-m", "pi_env.scripted", "--port", "0", "--script", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        base_url = line.strip().rsplit(" ", 1)[1]
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        raw = asyncio.run(_post(base_url, "anything", chat()))[2]
        assert content_of(stream_chunks(raw)) == "from file"
        raw = asyncio.run(_post(base_url, "sk-x", chat()))[2]
        assert content_of(stream_chunks(raw)) == "keyed"
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    assert "Warning" not in proc.stderr.read()
