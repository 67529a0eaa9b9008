"""Gemini's generateContent dialect (proxy/dialects/gemini.py) through the real gateway, with the
official google-genai SDK as the client and the scripted server as the model: text, thoughts,
function calls and their results both ways, usage, finish reasons, errors in Gemini's shape,
the budget's answer, JSON-schema side calls, in black_box, transparent_proxy (ids captured),
token-in (one bridged sequence) and interception_gate; Gemini CLI's real request."""

import asyncio
import base64
import concurrent.futures
import json
from pathlib import Path

import aiohttp
import pytest

genai = pytest.importorskip("google.genai", reason="the official SDKs come with pi-env[test]")
from google.genai import errors, types  # noqa: E402

from pi_env.proxy import Upstream  # noqa: E402
from pi_env.proxy.dialects.base import AnswerStream, DialectError  # noqa: E402
from pi_env.proxy.dialects.gemini import GeminiDialect  # noqa: E402
from pi_env.proxy.rewrite import CaptureOptions  # noqa: E402
from pi_env.scripted import Fault, ScriptedToolCall, ScriptedTurn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-real-upstream-key-gemini"
MODEL = "gemini-2.5-pro"  # what the agent names: echoed as modelVersion, never sent upstream
BASH = types.FunctionDeclaration(
    name="bash", description="Run a command",
    parameters=types.Schema(type="OBJECT", properties={"command": types.Schema(type="STRING")}, required=["command"]),
)  # fmt: skip
BASH_CHAT = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
CONFIG = types.GenerateContentConfig(
    system_instruction="You are a coding agent.", tools=[types.Tool(function_declarations=[BASH])],
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
)  # fmt: skip
USER = types.Content(role="user", parts=[types.Part(text="List the files.")])
# What every chat request the gateway makes of a Gemini call may hold: Chat Completions fields only.
CHAT_FIELDS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
}  # the last three: transparent_proxy's capture
MODES = ["black_box", "transparent_proxy"]


def client(gateway, session) -> "genai.Client":
    root = gateway.tcp_base_url.removesuffix("/v1")
    return genai.Client(api_key=session.token, http_options=types.HttpOptions(base_url=root, api_version="v1beta"))


_clients: list = []


def keep(sdk):
    """A client held until the module ends (the SDK closes its HTTP client when the object goes)."""
    _clients.append(sdk)
    return sdk


def open_(gateway, server, turns, mode="black_box", **kwargs):
    options = (
        CaptureOptions(model="served-model", top_logprobs=1, return_token_ids=True)
        if mode == "transparent_proxy"
        else None
    )
    return gateway.open_session(Upstream(server.base_url, server.add_script(turns, api_key=KEY), "served-model"),
                                mode=mode, capture=options, **kwargs)  # fmt: skip


def ask(gateway, session, contents, streamed, config=CONFIG):
    """The SDK's answer: (the parts in order, the last response, how many responses)."""
    sdk = client(gateway, session)
    if not streamed:
        answer = sdk.models.generate_content(model=MODEL, contents=contents, config=config)
        return list(answer.candidates[0].content.parts or []), answer, 1
    parts, chunks = [], list(sdk.models.generate_content_stream(model=MODEL, contents=contents, config=config))
    for chunk in chunks:
        if chunk.candidates and chunk.candidates[0].content:
            parts += chunk.candidates[0].content.parts or []
    return parts, chunks[-1], len(chunks)


def text_of(parts, thought=False) -> str:
    return "".join(p.text for p in parts if p.text is not None and bool(p.thought) == thought)


def upstream_bodies(server):
    return [r.body for r in server.requests if r.path.endswith("/chat/completions")]


# ------------------------------------------------------------------------ the SDK as the agent


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_text_thoughts_usage_and_stop(gateway, server, mode, streamed):
    turn = ScriptedTurn(text="Two files: a and b.", reasoning="Let me think.", chunk_chars=3,
                        fault=Fault(delay_s=0.01))  # fmt: skip
    session = open_(gateway, server, [turn], mode)
    try:
        parts, last, count = ask(gateway, session, [USER], streamed)
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    assert text_of(parts) == "Two files: a and b." and text_of(parts, thought=True) == "Let me think."
    assert [p.thought for p in parts if p.thought] and not [p for p in parts if p.function_call]
    candidate = last.candidates[0]
    assert candidate.finish_reason == types.FinishReason.STOP and candidate.index == 0
    assert candidate.content is None or candidate.content.role == "model"
    assert last.model_version == MODEL and last.response_id.startswith("chatcmpl-")
    usage = last.usage_metadata
    assert usage.prompt_token_count > 0 and usage.candidates_token_count > 0
    assert usage.total_token_count == usage.prompt_token_count + usage.candidates_token_count
    if streamed:  # as the model writes: an event per delta the relay carried, not one at the end
        assert count > 3
    (body,) = upstream_bodies(server)
    assert set(body) <= CHAT_FIELDS and body["model"] == "served-model"  # no dialect field upstream
    assert body["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files."},
    ]
    assert body["tools"] == [BASH_CHAT] and body["stream"] is streamed
    (record,) = session.turns
    assert record.dialect == "gemini" and record.upstream_status == 200
    if mode == "transparent_proxy":  # the ids of what the agent read, captured as for any call
        capture = record.capture
        assert capture.completion_token_ids and len(capture.per_token_logps) == len(capture.completion_token_ids)
        assert capture.choices[0].message()["content"] == "Two files: a and b."


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_function_call_then_function_response_round_trip(gateway, server, mode, streamed):
    turns = [ScriptedTurn(text="I will look.", reasoning="Plan.", chunk_chars=4, tool_calls=[
                 ScriptedToolCall(name="bash", arguments={"command": "ls -la", "timeout": 5}),
                 ScriptedToolCall(name="bash", arguments={"command": "pwd"})]),
             ScriptedTurn(text="Done.")]  # fmt: skip
    session = open_(gateway, server, turns, mode)
    try:
        first, last, _ = ask(gateway, session, [USER], streamed)
        calls = [p.function_call for p in first if p.function_call]
        assert [(c.id, c.name, c.args) for c in calls] == [
            ("call_0_0", "bash", {"command": "ls -la", "timeout": 5}),
            ("call_0_1", "bash", {"command": "pwd"}),
        ]
        assert text_of(first) == "I will look." and last.candidates[0].finish_reason == types.FinishReason.STOP
        results = types.Content(role="user", parts=[
            types.Part(function_response=types.FunctionResponse(id=c.id, name=c.name, response={"output": out}))
            for c, out in zip(calls, ["a\nb", "/work"])])  # fmt: skip
        second, _, _ = ask(gateway, session, [USER, types.Content(role="model", parts=first), results], streamed)
        assert text_of(second) == "Done."
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    body = upstream_bodies(server)[1]
    assert set(body) <= CHAT_FIELDS
    assert body["messages"][2:] == [
        {"role": "assistant", "content": "I will look.", "reasoning_content": "Plan.", "tool_calls": [
            {"id": "call_0_0", "type": "function",
             "function": {"name": "bash", "arguments": '{"command":"ls -la","timeout":5}'}},
            {"id": "call_0_1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"pwd"}'}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": '{"output":"a\\nb"}'},
        {"role": "tool", "tool_call_id": "call_0_1", "content": '{"output":"/work"}'}]  # fmt: skip
    assert [t.dialect for t in session.turns] == ["gemini", "gemini"]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_max_tokens_finish_and_its_usage(gateway, server, streamed):
    session = open_(gateway, server, [ScriptedTurn(text="cut he", finish_reason="length")])
    try:
        config = CONFIG.model_copy(update={"max_output_tokens": 3, "stop_sequences": ["END"], "temperature": 0.5,
                                           "top_p": 0.9, "top_k": 20, "seed": 7})  # fmt: skip
        parts, last, _ = ask(gateway, session, [USER], streamed, config)
    finally:
        gateway.close_session(session)
    assert text_of(parts) == "cut he" and last.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    (body,) = upstream_bodies(server)
    assert (body["max_tokens"], body["stop"], body["temperature"], body["top_p"], body["seed"]) == (
        3,
        ["END"],
        0.5,
        0.9,
        7,
    )
    assert "top_k" not in body and "generationConfig.topK" in session.turns[0].dialect_notes


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("status, kind", [(400, errors.ClientError), (429, errors.ClientError),
                                          (500, errors.ServerError), (503, errors.ServerError)])  # fmt: skip
def test_an_upstream_error_reaches_the_sdk_as_its_api_error(gateway, server, streamed, status, kind):
    error = {"error": {"message": f"engine says no ({status})", "type": "server_error"}}
    session = open_(gateway, server, [ScriptedTurn(fault=Fault(http_status=status, body=error))])
    try:
        with pytest.raises(kind) as raised:
            ask(gateway, session, [USER], streamed)
    finally:
        gateway.close_session(session)
    assert raised.value.code == status and raised.value.message == f"engine says no ({status})"
    assert raised.value.status == {400: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                                   503: "UNAVAILABLE"}[status]  # fmt: skip
    assert session.turns[0].upstream_status == status


REFUSED = {
    "google_search": (types.GenerateContentConfig(tools=[types.Tool(google_search=types.GoogleSearch())]),
                      "hosted tool googleSearch"),
    "code_execution": (types.GenerateContentConfig(tools=[types.Tool(code_execution=types.ToolCodeExecution())]),
                       "hosted tool codeExecution"),
    "candidates": (types.GenerateContentConfig(candidate_count=2), "candidateCount must be 1"),
    "cached_content": (types.GenerateContentConfig(cached_content="cachedContents/abc"), "cachedContent"),
    "image_output": (types.GenerateContentConfig(response_modalities=["IMAGE"]), "TEXT only"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED) + ["image_input"])
def test_what_cannot_be_honoured_is_a_400_in_geminis_shape_never_sent(gateway, server, name):
    session = open_(gateway, server, [ScriptedTurn(text="never")])
    contents = [USER]
    config, says = REFUSED.get(name, (None, "inlineData of type image/png"))
    if name == "image_input":
        contents = [
            types.Content(
                role="user",
                parts=[types.Part(text="What is this?"), types.Part.from_bytes(data=b"\x89PNG", mime_type="image/png")],
            )
        ]
    try:
        with pytest.raises(errors.ClientError) as raised:
            keep(client(gateway, session)).models.generate_content(model=MODEL, contents=contents, config=config)
    finally:
        gateway.close_session(session)
    assert raised.value.code == 400 and raised.value.status == "INVALID_ARGUMENT"
    assert says in raised.value.message, raised.value.message
    assert server.requests == []


def test_text_inline_data_is_its_text(gateway, server):
    session = open_(gateway, server, [ScriptedTurn(text="ok")])
    part = types.Part.from_bytes(data="héllo file".encode(), mime_type="text/plain")
    try:
        keep(client(gateway, session)).models.generate_content(
            model=MODEL, contents=[types.Content(role="user", parts=[types.Part(text="Read:"), part])]
        )
    finally:
        gateway.close_session(session)
    assert upstream_bodies(server)[0]["messages"] == [{"role": "user", "content": "Read:\nhéllo file"}]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_the_budget_answer_is_an_empty_stop(gateway, server, streamed):
    session = open_(gateway, server, [ScriptedTurn(text="one")], max_turns=1)
    try:
        assert text_of(ask(gateway, session, [USER], streamed)[0]) == "one"
        parts, last, _ = ask(gateway, session, [USER], streamed)
    finally:
        gateway.close_session(session)
    assert text_of(parts) == "" and last.candidates[0].finish_reason == types.FinishReason.STOP
    assert last.model_version == MODEL and session.budget_exhausted == "max_turns" and len(server.requests) == 1


def test_a_json_schema_side_call(gateway, server):
    """Gemini CLI's side calls (next speaker, loop check) ask for JSON by schema: response_format."""
    schema = {"type": "object", "properties": {"next_speaker": {"type": "string", "enum": ["user", "model"]}},
              "required": ["next_speaker"]}  # fmt: skip
    session = open_(gateway, server, [ScriptedTurn(text='{"next_speaker": "user"}')] * 2)
    sdk = client(gateway, session)
    try:
        answer = sdk.models.generate_content(model="gemini-2.5-flash", contents=[USER], config=types.GenerateContentConfig(
            response_mime_type="application/json", response_json_schema=schema, temperature=0))  # fmt: skip
        openapi = sdk.models.generate_content(model="gemini-2.5-flash", contents=[USER], config=types.GenerateContentConfig(
            response_mime_type="application/json", response_schema=types.Schema(
                type="OBJECT", properties={"why": types.Schema(type="STRING", nullable=True),
                                           "n": types.Schema(type="INTEGER")})))  # fmt: skip
    finally:
        gateway.close_session(session)
    assert json.loads(answer.text) == {"next_speaker": "user"} and answer.model_version == "gemini-2.5-flash"
    assert openapi.parsed is not None or openapi.text
    first, second = upstream_bodies(server)
    assert first["response_format"] == {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    converted = second["response_format"]["json_schema"]["schema"]
    assert converted["type"] == "object" and converted["properties"] == {
        "why": {"type": ["string", "null"]},
        "n": {"type": "integer"},
    }


def test_notes_are_on_the_record_and_not_upstream(gateway, server):
    session = open_(gateway, server, [ScriptedTurn(text="ok")])
    config = types.GenerateContentConfig(
        top_k=3, thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=64),
        safety_settings=[types.SafetySetting(category="HARM_CATEGORY_HARASSMENT", threshold="BLOCK_NONE")],
        labels={"team": "x"}, response_logprobs=True,
    )  # fmt: skip
    history = [USER, types.Content(role="model", parts=[types.Part(text="Hi", thought_signature=b"sig")]),
               types.Content(role="user", parts=[types.Part(text="Go on.")])]  # fmt: skip
    try:
        keep(client(gateway, session)).models.generate_content(model=MODEL, contents=history, config=config)
    finally:
        gateway.close_session(session)
    (body,) = upstream_bodies(server)
    assert set(body) <= CHAT_FIELDS and "Hi" == body["messages"][1]["content"]
    assert set(session.turns[0].dialect_notes) == {"generationConfig.topK", "generationConfig.thinkingConfig",
                                                   "safetySettings", "labels", "generationConfig.responseLogprobs",
                                                   "thoughtSignature"}  # fmt: skip


async def _post(url, token, body):
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers={"x-goog-api-key": token}) as answer:
            return answer.status, answer.headers.get("Content-Type"), await answer.read()


def test_stream_without_alt_sse_is_one_json_array(gateway, server):
    turns = [ScriptedTurn(text="abcdef", chunk_chars=2, fault=Fault(delay_s=0.01),
                          tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})])]  # fmt: skip
    session = open_(gateway, server, turns)
    root = gateway.tcp_base_url.removesuffix("/v1")
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    try:
        status, content_type, raw = asyncio.run(_post(f"{root}/v1beta/models/{MODEL}:streamGenerateContent",
                                                      session.token, body))  # fmt: skip
    finally:
        gateway.close_session(session)
    assert status == 200 and content_type.startswith("application/json")
    events = json.loads(raw)
    assert isinstance(events, list) and len(events) > 2
    parts = [p for e in events for p in (e["candidates"][0].get("content") or {}).get("parts", [])]
    assert "".join(p.get("text", "") for p in parts) == "abcdef"
    assert [p["functionCall"] for p in parts if "functionCall" in p] == [
        {"id": "call_0_0", "name": "bash", "args": {"command": "ls"}}
    ]
    assert events[-1]["candidates"][0]["finishReason"] == "STOP" and events[-1]["usageMetadata"]["totalTokenCount"]
    assert [e for e in events[:-1] if "finishReason" in e["candidates"][0]] == []


def test_gemini_clis_real_request_translates_without_refusal(gateway, server):
    """The first request Gemini CLI made (saved by its agent's helper): 15 tools by
    parametersJsonSchema, thinking, topK; relayed, its tools and text intact."""
    request = json.loads((ROOT / "tests/fixtures/dialects/gemini_cli_request.json").read_text())
    session = open_(gateway, server, [ScriptedTurn(text="ok")])
    root = gateway.tcp_base_url.removesuffix("/v1")
    try:
        status, _, raw = asyncio.run(_post(f"{root}/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
                                           session.token, request))  # fmt: skip
    finally:
        gateway.close_session(session)
    assert status == 200, raw
    (body,) = upstream_bodies(server)
    declared = [d for tool in request["tools"] for d in tool["functionDeclarations"]]
    assert [t["function"]["name"] for t in body["tools"]] == [d["name"] for d in declared]
    assert [t["function"]["parameters"] for t in body["tools"]] == [d["parametersJsonSchema"] for d in declared]
    assert body["messages"][0] == {"role": "system", "content": request["systemInstruction"]["parts"][0]["text"]}
    assert body["messages"][1]["content"] == "\n".join(p["text"] for p in request["contents"][0]["parts"])
    assert set(body) <= CHAT_FIELDS


# ------------------------------------------------------------------------ translation, unit


def to_chat(request, path=f"/v1beta/models/{MODEL}:generateContent"):
    dialect = GeminiDialect()
    return dialect.to_chat(request, dialect.match("POST", path))


def test_history_translates_the_same_every_time_with_ids_from_position():
    """Without ids (Gemini's own calls carry none), a call's id comes from its position and a
    response finds its call by name and order: the same history gives the same chat messages."""
    contents = [
        {"role": "user", "parts": [{"text": "go"}]},
        {"role": "model", "parts": [{"text": "thinking", "thought": True, "thoughtSignature": "c2ln"},
                                    {"text": "Look"}, {"text": "ing."},
                                    {"functionCall": {"name": "read", "args": {"path": "a", "n": 1}}},
                                    {"functionCall": {"name": "bash", "args": {"command": "ls"}}},
                                    {"functionCall": {"name": "read", "args": {"path": "b"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "read", "response": {"output": "A"}}},
                                   {"functionResponse": {"name": "read", "response": {"output": "B"}}},
                                   {"text": "and also"},
                                   {"functionResponse": {"id": "zzz", "name": "bash", "response": {"error": "x"}}}]},
    ]  # fmt: skip
    first, again = to_chat({"contents": contents}), to_chat(json.loads(json.dumps({"contents": contents})))
    assert first.chat == again.chat
    assert first.chat["messages"][1:] == [
        {"role": "assistant", "content": "Looking.", "reasoning_content": "thinking", "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "read", "arguments": '{"path":"a","n":1}'}},
            {"id": "call_1_1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}},
            {"id": "call_1_2", "type": "function", "function": {"name": "read", "arguments": '{"path":"b"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": '{"output":"A"}'},
        {"role": "tool", "tool_call_id": "call_1_2", "content": '{"output":"B"}'},
        {"role": "tool", "tool_call_id": "call_1_1", "content": '{"error":"x"}'},
        {"role": "user", "content": "and also"}]  # fmt: skip
    assert first.notes == ["thoughtSignature"] and first.chat["stream"] is False


def test_a_response_to_no_call_and_misplaced_parts_are_refused():
    cases = {
        "answers no functionCall": [{"role": "user", "parts": [{"functionResponse": {"name": "x", "response": {}}}]}],
        "belongs in a model content": [{"role": "user", "parts": [{"functionCall": {"name": "x"}}]}],
        "fileData": [{"role": "user", "parts": [{"fileData": {"fileUri": "gs://b/f", "mimeType": "text/plain"}}]}],
        "code execution": [{"role": "model", "parts": [{"executableCode": {"code": "1", "language": "PYTHON"}}]}],
        "role must be": [{"role": "system", "parts": [{"text": "x"}]}],
        "no content this gateway can map": [{"role": "user", "parts": [{"videoMetadata": {}}]}],
        "must be a Content object": [{"role": "user", "parts": [{"text": "x"}]}, "not a content"],
    }
    for says, contents in cases.items():
        with pytest.raises(DialectError, match=says) as raised:
            to_chat({"contents": contents})
        assert raised.value.status == 400
    with pytest.raises(DialectError, match="malformed"):  # a field of the wrong JSON type: a 400, never a 500
        to_chat(
            {
                "contents": [{"parts": [{"text": "x"}]}],
                "tools": [{"functionDeclarations": [{"name": "x"}]}],
                "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": 5}},
            }
        )


def test_schemas_tools_and_tool_config():
    declaration = {
        "name": "edit",
        "description": "Edit",
        "parameters": {
            "type": "OBJECT",
            "propertyOrdering": ["path", "lines"],
            "required": ["path"],
            "properties": {
                "path": {"type": "STRING", "description": "where"},
                "dir_path": {"type": "STRING", "min_length": "1"},  # snake_case, as the SDK sends some fields
                "lines": {"type": "ARRAY", "max_items": "3", "items": {"type": "INTEGER", "nullable": True}},
                "mode": {"type": "STRING", "format": "enum", "enum": ["a", "b"]},
                "any": {"any_of": [{"type": "NUMBER"}, {"type": "BOOLEAN"}]},
            },
        },
    }
    tools = [
        {
            "functionDeclarations": [
                declaration,
                {"name": "noop"},
                {"name": "raw", "parametersJsonSchema": {"type": "object", "$defs": {}}},
            ]
        }
    ]
    call = to_chat({"contents": [{"parts": [{"text": "x"}]}], "tools": tools})
    edit, noop, raw = (t["function"] for t in call.chat["tools"])
    assert edit == {"name": "edit", "description": "Edit", "parameters": {
        "type": "object", "required": ["path"], "properties": {
            "path": {"type": "string", "description": "where"},
            "dir_path": {"type": "string", "minLength": 1},
            "lines": {"type": "array", "maxItems": 3, "items": {"type": ["integer", "null"]}},
            "mode": {"type": "string", "format": "enum", "enum": ["a", "b"]},
            "any": {"anyOf": [{"type": "number"}, {"type": "boolean"}]}}}}  # fmt: skip
    assert noop == {"name": "noop", "parameters": {"type": "object", "properties": {}}}
    assert raw["parameters"] == {"type": "object", "$defs": {}} and "tool_choice" not in call.chat
    choices = {
        "AUTO": ("auto", 3), "NONE": ("none", 3), "ANY": ("required", 3),
        ("ANY", ("edit",)): ({"type": "function", "function": {"name": "edit"}}, 1),
        ("ANY", ("edit", "raw")): ("required", 2),
    }  # fmt: skip
    for config, (choice, offered) in choices.items():
        mode, names = config if isinstance(config, tuple) else (config, None)
        calling = {"mode": mode, **({"allowedFunctionNames": list(names)} if names else {})}
        chat = to_chat({"contents": [{"parts": [{"text": "x"}]}], "tools": tools,
                        "toolConfig": {"functionCallingConfig": calling}}).chat  # fmt: skip
        assert (chat["tool_choice"], len(chat["tools"])) == (choice, offered), config


def answer_of(chunks: list[dict], streamed=True, framing="sse") -> bytes:
    """What the dialect sends for a chat stream made of these chunks (an SSE body, no [DONE])."""
    dialect = GeminiDialect()
    call = to_chat(
        {"contents": [{"parts": [{"text": "x"}]}]},
        f"/v1beta/models/{MODEL}:streamGenerateContent" + ("?alt=sse" if framing == "sse" else ""),
    )
    stream = AnswerStream(dialect, call, 200, "text/event-stream")
    out = b""
    for chunk in chunks:
        out += stream.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return out + stream.finish()


def sse_events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]


def delta(**fields) -> dict:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def test_a_cut_off_stream_still_ends_with_a_last_event_and_bad_arguments_stay_text():
    """No finish reason, no usage, no [DONE]: the agent still gets a last event (OTHER); a call
    whose arguments are not a JSON object reaches it as the text the model wrote."""
    raw = answer_of([
        delta(content="a"), delta(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "bash", "arguments": ""}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"command": "ls"}'}}]),
        delta(tool_calls=[{"index": 1, "id": "c2", "function": {"name": "bash", "arguments": '["not", "an object"]'}}]),
        delta(tool_calls=[{"index": 2, "id": "c3", "function": {"name": "bash", "arguments": '{"command": "cut'}}]),
    ])  # fmt: skip
    events = sse_events(raw)
    parts = [p for e in events for p in (e["candidates"][0].get("content") or {}).get("parts", [])]
    assert parts == [{"text": "a"}, {"functionCall": {"id": "c1", "name": "bash", "args": {"command": "ls"}}},
                     {"text": '["not", "an object"]'}, {"text": '{"command": "cut'}]  # fmt: skip
    # the first call left as soon as the second started, before the end
    assert "functionCall" in events[-3]["candidates"][0]["content"]["parts"][0]
    assert events[-1]["candidates"][0]["finishReason"] == "OTHER" and "usageMetadata" not in events[-1]
    types.GenerateContentResponse.model_validate(events[-1])  # the SDK's own model reads it


def test_json_array_framing_and_an_error_inside_the_stream():
    raw = answer_of([delta(content="a"), {"error": {"message": "engine died", "code": 503}}], framing="json_array")
    events = json.loads(raw)
    assert events[0]["candidates"][0]["content"]["parts"] == [{"text": "a"}]
    assert events[1] == {
        "error": {
            "code": 503,
            "message": "engine died",
            "status": "UNAVAILABLE",
            "details": [
                {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "api_error", "domain": "pi-env"}
            ],
        }
    }
    assert json.loads(answer_of([], framing="json_array"))[0]["candidates"][0]["finishReason"] == "OTHER"


def test_usage_counts_thoughts_apart():
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
        "completion_tokens_details": {"reasoning_tokens": 4},
        "prompt_tokens_details": {"cached_tokens": 6},
    }
    raw = answer_of([delta(reasoning_content="hm"), delta(content="ok"),
                     {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                     {"id": "chatcmpl-1", "choices": [], "usage": usage}])  # fmt: skip
    last = sse_events(raw)[-1]
    assert last["usageMetadata"] == {"promptTokenCount": 10, "candidatesTokenCount": 3, "totalTokenCount": 17,
                                     "thoughtsTokenCount": 4, "cachedContentTokenCount": 6}  # fmt: skip
    assert last["candidates"][0]["finishReason"] == "STOP" and last["responseId"] == "chatcmpl-1"
    parsed = types.GenerateContentResponse.model_validate(last)
    assert parsed.usage_metadata.thoughts_token_count == 4


# ------------------------------------------------------------------------ token-in and the gate


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    pytest.importorskip("renderers", reason="token-in needs pi-env[token-in] (the dev extra installs it)")
    from test_token_in import TEMPLATE, corpus

    from pi_env.testing.tiny_tokenizer import make_tokenizer_dir

    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"), corpus(), chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_token_in_a_gemini_conversation_is_one_bridged_sequence(gateway, tokenizer_dir, tokenizer, streamed):
    from pi_env.proxy.token_in import load_renderer
    from pi_env.scripted import ScriptedServer
    from pi_env.scripted.token_engine import TokenEngine

    turns = [ScriptedTurn(text="I will list the files.", reasoning="Hm.",
                          tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})]),
             ScriptedTurn(text="Two files: a and b.")]  # fmt: skip
    with ScriptedServer(token_engine=TokenEngine(tokenizer)) as engine:
        session = gateway.open_session(
            Upstream(engine.base_url, engine.add_script(turns), "scripted-model"), mode="transparent_proxy",
            capture=CaptureOptions(model="scripted-model", top_logprobs=2),
            token_in=load_renderer("chatml-hermes", str(tokenizer_dir)))  # fmt: skip
        try:
            first, _, _ = ask(gateway, session, [USER], streamed)
            (call,) = [p.function_call for p in first if p.function_call]
            assert call.name == "bash" and call.args == {"command": "ls"}
            assert text_of(first) == "I will list the files."
            result = types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                id=call.id, name="bash", response={"output": "a\nb"}))])  # fmt: skip
            second, _, _ = ask(gateway, session, [USER, types.Content(role="model", parts=first), result], streamed)
            assert text_of(second) == "Two files: a and b."
            assert session.wait_idle(5)
        finally:
            gateway.close_session(session)
    records = [t.capture for t in session.turns]
    assert [r.token_in["outcome"] for r in records] == ["first", "bridged"], records[1].token_in.get("reason")
    assert [r.token_in["sequence"] for r in records] == [0, 0]
    prompt, completion = records[0].prompt_token_ids, records[0].completion_token_ids
    assert records[1].prompt_token_ids[: len(prompt) + len(completion)] == prompt + completion


def test_interception_gate_hands_a_gemini_call_to_the_trainer(gateway):
    from pi_env.proxy.gate import GateCompletion

    session = gateway.open_session(Upstream("http://interception-gate.invalid/v1", None, "trainer-model"),
                                   mode="interception_gate", gate_timeout_s=30)  # fmt: skip
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pending = pool.submit(ask, gateway, session, [USER], True)
        request = session.strategy.next_request(10)
        assert request.messages == [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files."},
        ]
        assert request.tools == [BASH_CHAT] and request.stream is True
        session.strategy.deliver(request, GateCompletion(token_ids=[1, 2, 3], message={
            "reasoning_content": "Look first.", "content": "Listing.",
            "tool_calls": [{"name": "bash", "arguments": {"command": "ls"}}]}))  # fmt: skip
        parts, last, _ = pending.result(10)
        assert session.wait_idle(5)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        gateway.close_session(session)
    assert text_of(parts) == "Listing." and text_of(parts, thought=True) == "Look first."
    (call,) = [p.function_call for p in parts if p.function_call]
    assert call.name == "bash" and call.args == {"command": "ls"} and call.id
    assert last.candidates[0].finish_reason == types.FinishReason.STOP
    assert last.usage_metadata.candidates_token_count == 3
    (turn,) = session.turns
    assert turn.dialect == "gemini" and turn.capture.completion_token_ids == [1, 2, 3]


def test_the_key_header_is_the_session_token_and_the_real_key_goes_upstream(gateway, server):
    session = open_(gateway, server, [ScriptedTurn(text="ok")])
    try:
        keep(client(gateway, session)).models.generate_content(model=MODEL, contents="hi")
    finally:
        gateway.close_session(session)
    (received,) = server.requests
    assert received.headers["authorization"] == f"Bearer {KEY}"
    assert all(session.token not in value for value in received.headers.values())
    assert "x-goog-api-key" not in received.headers


def test_text_inline_data_of_bad_base64_is_refused():
    bad = {"role": "user", "parts": [{"inlineData": {"mimeType": "text/plain", "data": "%%%"}}]}
    with pytest.raises(DialectError, match="not base64"):
        to_chat({"contents": [bad]})
    good = {"role": "user", "parts": [{"inlineData": {"mimeType": "text/plain",
                                                       "data": base64.b64encode(b"x").decode()}}]}  # fmt: skip
    assert to_chat({"contents": [good]}).chat["messages"] == [{"role": "user", "content": "x"}]


def merged_parts(events: list[dict]) -> list[dict]:
    """The parts of a streamed answer with adjacent text (or thought) parts joined."""
    out: list[dict] = []
    for event in events:
        for part in (event["candidates"][0].get("content") or {}).get("parts", []):
            if out and "text" in part and "text" in out[-1] and part.get("thought") == out[-1].get("thought"):
                out[-1] = {**out[-1], "text": out[-1]["text"] + part["text"]}
            else:
                out.append(part)
    return out


@pytest.mark.parametrize("framing", ["sse", "json_array"])
def test_a_stream_fed_token_by_token_or_at_once_says_the_same(framing):
    """However the relay batches the chat stream (one event per write), the agent reads the same
    answer; a server that numbers no tool call (index absent) is followed by its ids."""
    chunks = [delta(role="assistant"), *[delta(reasoning_content=c) for c in "Hmm, "], delta(reasoning="ok."),
              *[delta(content=c) for c in "Hi é\n"],
              delta(tool_calls=[{"id": "c1", "function": {"name": "a", "arguments": '{"x":'}}]),
              delta(tool_calls=[{"function": {"arguments": " 1}"}}]),
              delta(tool_calls=[{"id": "c2", "function": {"name": "b", "arguments": "{}"}}]),
              {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}]  # fmt: skip
    one_by_one = answer_of(chunks, framing=framing)
    dialect = GeminiDialect()
    call = to_chat({"contents": [{"parts": [{"text": "x"}]}]}, f"/v1beta/models/{MODEL}:streamGenerateContent"
                   + ("?alt=sse" if framing == "sse" else ""))  # fmt: skip
    stream = AnswerStream(dialect, call, 200, "text/event-stream")
    at_once = stream.finish(
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )
    decoded = [sse_events(raw) if framing == "sse" else json.loads(raw) for raw in (one_by_one, at_once)]
    expected = [{"text": "Hmm, ok.", "thought": True}, {"text": "Hi é\n"},
                {"functionCall": {"id": "c1", "name": "a", "args": {"x": 1}}},
                {"functionCall": {"id": "c2", "name": "b", "args": {}}}]  # fmt: skip
    for events in decoded:
        assert merged_parts(events) == expected
        assert events[-1]["candidates"][0]["finishReason"] == "STOP"
        assert events[-1]["usageMetadata"] == {"promptTokenCount": 3, "candidatesTokenCount": 9, "totalTokenCount": 12}
        assert {e["responseId"] for e in events} == {"chatcmpl-1"} and {e["modelVersion"] for e in events} == {MODEL}
        for event in events:
            types.GenerateContentResponse.model_validate(event)
    assert len(decoded[0]) > len(decoded[1]) == 1
