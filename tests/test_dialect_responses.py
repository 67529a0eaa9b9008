"""The Responses dialect (POST /v1/responses, what Codex speaks) on the real gateway, with the
official openai SDK as the client and the scripted server as the model: text, reasoning, tool
calls and their results both ways, usage, incomplete answers, errors in Responses' shape, the
gateway's refusals and budget, the notes on the turn's record, the upstream seeing only Chat
Completions, in black_box, transparent_proxy (ids), token-in (one sequence) and interception_gate."""

import concurrent.futures
import copy
import json
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pi_env.proxy import Upstream
from pi_env.proxy.gate import GateCompletion
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.scripted import Fault, ScriptedServer, ScriptedToolCall, ScriptedTurn

FIXTURE = Path(__file__).parent / "fixtures/dialects/codex_request.json"
MODES = ["black_box", "transparent_proxy"]
BASH = {
    "type": "function",
    "name": "bash",
    "description": "Run a command",
    "strict": False,
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
# What a Chat Completions request may carry upstream: the translation's fields plus what the
# gateway's own modes add (transparent_proxy asks for logprobs, the policy sets a token limit).
CHAT_FIELDS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "max_tokens",
    "stream",
    "stream_options",
    "response_format",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def client(gateway, session) -> OpenAI:
    return OpenAI(base_url=gateway.tcp_base_url, api_key=session.token, max_retries=0, timeout=20)


def open_session(gateway, server, turns, mode="black_box", **kwargs):
    if mode == "transparent_proxy":
        kwargs.setdefault("capture", CaptureOptions(model="scripted-model", return_token_ids=True, top_logprobs=2))
    return gateway.open_session(
        Upstream(server.base_url, server.add_script(turns), "scripted-model"), mode=mode, **kwargs
    )


def raw_events(gateway, session, body) -> list[dict]:
    """The SSE events as sent, each validated strictly against the SDK's event union (its client
    constructs leniently), `event:` matching the data's type."""
    answer = httpx.post(
        gateway.tcp_base_url + "/responses", json=body, timeout=20, headers={"Authorization": f"Bearer {session.token}"}
    )
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream"), answer.text
    events = []
    for block in answer.text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        EVENTS.validate_json(data[6:], strict=False)
        event = json.loads(data[6:])
        assert event["type"] == name[7:]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def upstream_bodies(server) -> list[dict]:
    return [r.body for r in server.requests if r.path.endswith("/chat/completions")]


def history(response, *results) -> list[dict]:
    """The items the agent sends back: the answer's output items, then its tool results."""
    return [item.model_dump(exclude_none=True) for item in response.output] + list(results)


# ------------------------------------------------------------------------------- the answers


@pytest.mark.parametrize("mode", MODES)
def test_text_and_reasoning_whole_streamed_and_through_the_stream_helper(gateway, server, mode):
    turn = ScriptedTurn(text="Hello there, world.", reasoning="The user greets me.", chunk_chars=4)
    session = open_session(gateway, server, [turn] * 4, mode)
    sdk = client(gateway, session)
    try:
        whole = sdk.responses.create(model="codex-model", instructions="Be brief.", input="hi")
        streamed = list(sdk.responses.create(model="codex-model", input="hi", stream=True))
        with sdk.responses.stream(model="codex-model", input="hi") as stream:
            deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
            helped = stream.get_final_response()
        raw = raw_events(gateway, session, {"model": "codex-model", "input": "hi", "stream": True})
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    Response.model_validate(whole.model_dump())
    assert isinstance(whole, Response) and whole.status == "completed" and whole.model == "codex-model"
    assert whole.output_text == "Hello there, world." == helped.output_text == "".join(deltas)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["The user greets me."]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert helped.usage.output_tokens == whole.usage.output_tokens

    # How many delta events carry the text depends on how the answer's chunks were batched
    # (what arrives in one write leaves as one event): compare the shapes without repeats.
    types = collapsed([event.type for event in streamed])
    assert types == collapsed([e["type"] for e in raw])
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    item_events = ["response.output_item.added", "response.content_part.added"]
    assert types[2:4] == item_events and "response.reasoning_text.delta" in types
    assert types.count("response.output_item.done") == 2 and types.count("response.content_part.done") == 2
    assert "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta") == "The user greets me."
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == "Hello there, world."
    done = [e for e in raw if e["type"] == "response.output_text.done"]
    assert done[0]["text"] == "Hello there, world." and done[0]["output_index"] == 1
    completed = streamed[-1].response
    assert completed.status == "completed" and completed.usage.output_tokens == whole.usage.output_tokens
    assert [item.type for item in completed.output] == ["reasoning", "message"]
    assert len({e["response"]["id"] for e in raw if "response" in e}) == 1

    bodies = upstream_bodies(server)
    assert bodies[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert all(set(body) <= CHAT_FIELDS for body in bodies)
    assert bodies[1]["stream"] is True and bodies[1]["stream_options"] == {"include_usage": True}
    assert [t.dialect for t in session.turns] == ["responses"] * 4
    if mode == "transparent_proxy":
        for record in session.turns:
            assert record.capture.completion_token_ids and record.capture.prompt_token_ids
            assert len(record.capture.per_token_logps) == len(record.capture.completion_token_ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_and_its_result_round_trip_as_one_assistant_message(gateway, server, mode, stream):
    turns = [
        ScriptedTurn(
            text="Let me look.",
            reasoning="I should list the files.",
            tool_calls=[
                ScriptedToolCall(name="bash", arguments={"command": "ls"}),
                ScriptedToolCall(name="bash", arguments={"command": "pwd"}, id="call_b"),
            ],
        ),
        ScriptedTurn(text="Two files."),
    ]
    session = open_session(gateway, server, turns, mode)
    sdk = client(gateway, session)
    user = {"role": "user", "content": [{"type": "input_text", "text": "What is here?"}]}
    try:
        if stream:
            with sdk.responses.stream(model="m", input=[user], tools=[BASH], parallel_tool_calls=True) as events:
                arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
                first = events.get_final_response()
            assert "".join(arguments) == '{"command": "ls"}{"command": "pwd"}'
        else:
            first = sdk.responses.create(model="m", input=[user], tools=[BASH], parallel_tool_calls=True)
        assert [item.type for item in first.output] == ["reasoning", "message", "function_call", "function_call"]
        calls = first.output[2:]
        assert [c.call_id for c in calls] == ["call_0_0", "call_b"] and [c.id for c in calls] == [
            "fc_call_0_0",
            "fc_call_b",
        ]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("bash", {"command": "ls"}),
            ("bash", {"command": "pwd"}),
        ]
        assert first.status == "completed"
        results = [
            {"type": "function_call_output", "call_id": "call_0_0", "output": "a\nb"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "/work"}]},
        ]
        second = sdk.responses.create(model="m", input=[user, *history(first, *results)], tools=[BASH], stream=False)
        assert second.output_text == "Two files."
    finally:
        gateway.close_session(session)
    sent = upstream_bodies(server)[1]
    assert sent["messages"] == [
        {"role": "user", "content": "What is here?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "I should list the files.",
            "tool_calls": [
                {"id": "call_0_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
                {"id": "call_b", "type": "function", "function": {"name": "bash", "arguments": '{"command": "pwd"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "content": "a\nb"},
        {"role": "tool", "tool_call_id": "call_b", "content": "/work"},
    ]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": "Run a command",
                "parameters": BASH["parameters"],
                "strict": False,
            },
        }
    ]
    assert upstream_bodies(server)[0]["parallel_tool_calls"] is True


def test_a_custom_freeform_tool_is_a_one_string_function_upstream_and_custom_again_for_the_agent(gateway, server):
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    turns = [
        ScriptedTurn(tool_calls=[ScriptedToolCall(name="apply_patch", arguments={"input": patch})]),
        ScriptedTurn(text="Applied."),
    ]
    session = open_session(gateway, server, turns)
    sdk = client(gateway, session)
    tool = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch."}
    try:
        with sdk.responses.stream(model="m", input="patch it", tools=[tool]) as events:
            kinds = [e.type for e in events]
            first = events.get_final_response()
        (call,) = first.output
        assert call.type == "custom_tool_call" and call.input == patch and call.call_id == "call_0_0"
        assert "response.custom_tool_call_input.done" in kinds
        result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}
        assert (
            sdk.responses.create(
                model="m",
                input=[{"role": "user", "content": "patch it"}, *history(first, result)],
                tools=[tool],
            ).output_text
            == "Applied."
        )
    finally:
        gateway.close_session(session)
    first_body, second_body = upstream_bodies(server)
    (function,) = [t["function"] for t in first_body["tools"]]
    assert function["name"] == "apply_patch" and function["parameters"]["required"] == ["input"]
    assert second_body["messages"][1]["tool_calls"][0]["function"] == {
        "name": "apply_patch",
        "arguments": json.dumps({"input": patch}, separators=(",", ":")),
    }
    assert second_body["messages"][2] == {"role": "tool", "tool_call_id": "call_0_0", "content": "Done!"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_output_tokens_is_max_tokens_and_a_length_finish_is_incomplete(gateway, server, stream):
    session = open_session(gateway, server, [ScriptedTurn(text="cut sho", finish_reason="length")])
    sdk = client(gateway, session)
    try:
        if stream:
            events = list(sdk.responses.create(model="m", input="write a lot", max_output_tokens=7, stream=True))
            assert events[-1].type == "response.incomplete"
            answer = events[-1].response
        else:
            answer = sdk.responses.create(model="m", input="write a lot", max_output_tokens=7)
    finally:
        gateway.close_session(session)
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output_text == "cut sho" and answer.output[0].status == "incomplete"
    assert answer.max_output_tokens == 7 and answer.usage.output_tokens > 0
    assert upstream_bodies(server)[0]["max_tokens"] == 7


# ------------------------------------------------------------------------------ errors, refusals


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "status, error", [(400, openai.BadRequestError), (429, openai.RateLimitError), (500, openai.InternalServerError)]
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_upstream_error_reaches_the_sdk_as_its_typed_exception_with_the_message(
    gateway, server, mode, status, error, stream
):
    body = {"error": {"message": f"engine says no ({status})", "type": "BadRequestError"}}
    session = open_session(gateway, server, [ScriptedTurn(fault=Fault(http_status=status, body=body))], mode)
    try:
        with pytest.raises(error) as raised:
            answer = client(gateway, session).responses.create(model="m", input="hi", stream=stream)
            list(answer) if stream else None
        assert raised.value.status_code == status
        assert f"engine says no ({status})" in raised.value.message
        assert set(raised.value.body) == {"message", "type", "param", "code"}
    finally:
        gateway.close_session(session)


@pytest.mark.parametrize(
    "request_fields, says",
    [
        ({"tools": [{"type": "web_search"}]}, "hosted tool `web_search`"),
        ({"tools": [BASH, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "hosted tool `file_search`"),
        ({"previous_response_id": "resp_123"}, "keeps no responses"),
        ({"background": True}, "foreground only"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "keeps none"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "`input_file` part"),
        ({"stream": "yes"}, "`stream` must be a JSON boolean"),
    ],
    ids=["web_search", "file_search", "previous_response_id", "background", "item_reference", "input_file", "stream"],
)
def test_what_cannot_be_honoured_is_refused_in_responses_shape_and_never_sent(gateway, server, request_fields, says):
    session = open_session(gateway, server, [ScriptedTurn(text="never")])
    try:
        with pytest.raises(openai.BadRequestError) as raised:
            client(gateway, session).responses.create(**{"model": "m", "input": "hi", **request_fields})
        raw = httpx.post(
            gateway.tcp_base_url + "/responses",
            json={"model": "m", "input": "hi", **request_fields},
            headers={"Authorization": f"Bearer {session.token}"},
        )
    finally:
        gateway.close_session(session)
    assert raised.value.status_code == 400 and says in raised.value.message
    assert raw.status_code == 400 and raw.json() == {
        "error": {"message": raised.value.body["message"], "type": "invalid_request_error", "param": None, "code": None}
    }
    assert server.requests == [] and session.turns == []


@pytest.mark.parametrize("mode", MODES)
def test_an_upstream_dying_mid_stream_fails_the_sdks_call_as_in_chat_completions(gateway, server, mode):
    turn = ScriptedTurn(
        text="a long answer that will not finish", chunk_chars=2, fault=Fault(disconnect_after_chunks=4)
    )
    session = open_session(gateway, server, [turn], mode)
    try:
        with pytest.raises(openai.APIConnectionError):
            list(client(gateway, session).responses.create(model="m", input="hi", stream=True))
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    (record,) = session.turns
    assert record.upstream_broke and record.dialect == "responses"


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)


@pytest.mark.parametrize(
    "ending, says",
    [
        (b"data: [DONE]\n\n", "cut off"),  # a clean end, but no finish reason
        (b"", "cut off"),  # no [DONE] either
        (sse({"error": {"message": "engine overloaded", "type": "server_error"}}), "engine overloaded"),
    ],
    ids=["no_finish_reason", "no_done", "error_event"],
)
def test_a_chat_stream_without_its_end_still_ends_the_responses_stream(ending, says):
    """What reaches the agent when the chat stream the strategy writes stops early: the
    Responses stream still ends, with `error` and `response.failed` (items closed first)."""
    from pi_env.proxy.dialects.base import AnswerStream, Route
    from pi_env.proxy.dialects.responses import ResponsesDialect

    dialect = ResponsesDialect()
    call = dialect.to_chat({"model": "m", "input": "hi", "stream": True}, Route())
    stream = AnswerStream(dialect, call, 200, "text/event-stream")
    chunk = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
    raw = stream.feed(sse(chunk)[:20]) + stream.feed(sse(chunk)[20:]) + stream.finish(ending)
    events = [json.loads(block.split("\ndata: ")[1]) for block in raw.decode().split("\n\n") if block]
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][-5:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert says in events[-1]["response"]["error"]["message"] and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hel"
    assert stream.finish() == b""  # ended once


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_past_max_turns_the_agent_gets_an_empty_completed_answer(gateway, server, stream):
    session = open_session(gateway, server, [ScriptedTurn(text="first")] * 3, max_turns=1)
    sdk = client(gateway, session)
    try:
        assert sdk.responses.create(model="m", input="hi").output_text == "first"
        if stream:
            events = list(sdk.responses.create(model="m", input="hi", stream=True))
            answer = events[-1].response
            assert events[-1].type == "response.completed"
        else:
            answer = sdk.responses.create(model="m", input="hi")
    finally:
        gateway.close_session(session)
    assert answer.status == "completed" and answer.output == [] and answer.output_text == ""
    assert session.budget_exhausted == "max_turns" and len(upstream_bodies(server)) == 1


# ------------------------------------------------------------------------- Codex's own request


@pytest.mark.parametrize("mode", MODES)
def test_codexs_request_is_noted_not_forwarded_and_its_developer_messages_are_the_system_message(gateway, server, mode):
    request = json.loads(FIXTURE.read_text())
    session = open_session(gateway, server, [ScriptedTurn(text="ok")], mode)
    try:
        events = raw_events(gateway, session, request)
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    assert events[-1]["type"] == "response.completed"
    (body,) = upstream_bodies(server)
    assert set(body) <= CHAT_FIELDS
    assert [t["function"]["name"] for t in body["tools"]] == [t["name"] for t in request["tools"]]
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True
    developer = [part["text"] for item in request["input"][:2] for part in item["content"]]
    assert body["messages"][0] == {"role": "system", "content": [{"type": "text", "text": t} for t in developer]}
    assert [m["role"] for m in body["messages"]] == ["system", "user", "user"]
    (turn,) = session.turns
    assert turn.dialect == "responses"
    assert turn.dialect_notes == [
        "store=false",
        "include reasoning.encrypted_content",
        "reasoning summary=auto",
        "prompt_cache_key",
        "client_metadata",
    ]


def test_consecutive_assistant_items_are_one_message_and_the_translation_is_deterministic():
    from pi_env.proxy.dialects.base import Route
    from pi_env.proxy.dialects.responses import ResponsesDialect

    items = [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}], "encrypted_content": "xx"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "A"}, {"type": "output_text", "text": "B"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
        {"type": "message", "role": "developer", "content": "later rule"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]
    request = {"model": "m", "instructions": "sys", "input": items}
    call = ResponsesDialect().to_chat(copy.deepcopy(request), Route())
    assert call.chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "AB",
            "reasoning_content": "plan",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "system", "content": "later rule"},
        {"role": "assistant", "content": "done"},
    ]
    assert "input reasoning.encrypted_content (not forwarded)" in call.notes
    assert ResponsesDialect().to_chat(copy.deepcopy(request), Route()).chat == call.chat


# ------------------------------------------------------------------------------ token-in, gate


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("renderers", reason="token-in needs pi-env[token-in] (the dev extra installs it)")
    transformers = pytest.importorskip("transformers")
    from test_token_in import TEMPLATE, corpus

    from pi_env.testing.tiny_tokenizer import make_tokenizer_dir

    directory = make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"), corpus(), chat_template=TEMPLATE)
    return directory, transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_token_in_two_calls_of_one_codex_conversation_are_one_sequence(gateway, tokenizer, stream):
    from pi_env.proxy.rewrite import CaptureOptions
    from pi_env.proxy.token_in import load_renderer
    from pi_env.scripted.token_engine import TokenEngine
    from pi_env.training import build_training_trace

    directory, tok = tokenizer
    turns = [
        ScriptedTurn(
            text="I will list the files.",
            reasoning="Listing is the first step.",
            tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls -la"})],
        ),
        ScriptedTurn(text="Two files: a and b."),
    ]
    turns.append(turns[-1])  # the server picks a turn by the assistant messages it got: a history
    # translated into more than one would still be answered, and token-in says what is wrong with it
    request = json.loads(FIXTURE.read_text())  # Codex's own request, with a bash tool
    request["tools"] = [BASH]
    request.pop("stream")
    request["extra_body"] = {"client_metadata": request.pop("client_metadata")}  # not in the SDK's signature
    with ScriptedServer(token_engine=TokenEngine(tok)) as engine:
        session = gateway.open_session(
            Upstream(engine.base_url, engine.add_script(turns), "scripted-model"),
            mode="transparent_proxy",
            capture=CaptureOptions(model="scripted-model"),
            token_in=load_renderer("chatml-hermes", str(directory)),
        )
        sdk = client(gateway, session)
        try:
            if stream:
                with sdk.responses.stream(**request) as events:
                    first = events.get_final_response()
            else:
                first = sdk.responses.create(**request)
            (call,) = [item for item in first.output if item.type == "function_call"]
            assert call.name == "bash" and json.loads(call.arguments) == {"command": "ls -la"}
            # Codex sends the items back as it keeps them: no ids, arguments as given.
            back = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in history(first)]
            request["input"] = (
                request["input"] + back + [{"type": "function_call_output", "call_id": call.call_id, "output": "a\nb"}]
            )
            second = sdk.responses.create(**request)
            assert second.output_text == "Two files: a and b."
            assert session.wait_idle(5)
        finally:
            gateway.close_session(session)
    records = [t.capture.token_in for t in session.turns]
    assert [r["outcome"] for r in records] == ["first", "bridged"], records[-1].get("reason")
    assert [r["sequence"] for r in records] == [0, 0]

    class Ids:
        def __init__(self, record):
            self.turn, self.token_in = record.turn, record.capture.token_in
            self.prompt_token_ids = record.capture.prompt_token_ids
            self.completion_token_ids = record.capture.completion_token_ids
            self.per_token_logps = record.capture.per_token_logps

    trace = build_training_trace([Ids(t) for t in session.turns])
    assert trace.append_only and len(trace.segments) == 1


def test_interception_gate_hands_the_translated_call_to_the_trainer_and_its_answer_to_the_sdk(gateway):
    session = gateway.open_session(
        Upstream("http://interception-gate.invalid/v1", None, "trainer-model"),
        mode="interception_gate",
        gate_timeout_s=30,
    )
    sdk = client(gateway, session)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    try:
        pending = pool.submit(
            lambda: sdk.responses.create(
                model="codex", instructions="sys", input="write a.txt", tools=[BASH], stream=True, max_output_tokens=50
            )
        )
        request = session.strategy.next_request(5)
        assert request.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "write a.txt"}]
        assert request.tools == [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "description": "Run a command",
                    "parameters": BASH["parameters"],
                    "strict": False,
                },
            }
        ]
        session.strategy.deliver(
            request,
            GateCompletion(
                token_ids=[5, 6, 7],
                logprobs=[-0.1, -0.2, -0.3],
                prompt_token_ids=[1, 2],
                message={
                    "reasoning_content": "Write it.",
                    "content": "Writing.",
                    "tool_calls": [{"name": "bash", "arguments": {"command": "echo hi > a.txt"}}],
                },
            ),
        )
        events = list(pending.result(10))
        whole = pool.submit(lambda: sdk.responses.create(model="codex", input="again"))
        held = session.strategy.next_request(5)
        session.strategy.deliver(held, GateCompletion(token_ids=[8], message={"content": "Done."}))
        assert whole.result(10).output_text == "Done."
        assert session.wait_idle(5)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        gateway.close_session(session)
    completed = events[-1].response
    assert events[-1].type == "response.completed"
    assert [item.type for item in completed.output] == ["reasoning", "message", "function_call"]
    assert completed.output_text == "Writing." and completed.output[0].content[0].text == "Write it."
    assert json.loads(completed.output[2].arguments) == {"command": "echo hi > a.txt"}
    assert completed.usage.input_tokens == 2 and completed.usage.output_tokens == 3
    assert [t.capture.completion_token_ids for t in session.turns] == [[5, 6, 7], [8]]
    assert [t.dialect for t in session.turns] == ["responses"] * 2


def _delta(**delta):
    return {"id": "c", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _call(index, id=None, name=None, arguments=""):
    function = {"arguments": arguments, **({"name": name} if name else {})}
    return {"index": index, **({"id": id, "type": "function"} if id else {}), "function": function}


ANSWERS = {
    "reasoning_text_two_calls": [
        _delta(reasoning_content="Think"),
        _delta(reasoning_content=" more."),
        _delta(content="I will "),
        _delta(content="look."),
        _delta(tool_calls=[_call(0, "call_a", "bash", '{"comm')]),
        _delta(tool_calls=[_call(0, arguments='and": "ls"}')]),
        _delta(tool_calls=[_call(1, "call_b", "read", '{"path": "a"}')]),
    ],
    "text_after_a_call": [
        _delta(tool_calls=[_call(0, "call_a", "bash", '{"command": "ls"}')]),
        _delta(content="Then "),
        _delta(reasoning="hmm"),
        _delta(content="this."),
    ],
    "custom_tool": [
        _delta(content="Patching."),
        _delta(tool_calls=[_call(0, "call_p", "apply_patch", '{"input": "*** Begin')]),
        _delta(tool_calls=[_call(0, arguments=' Patch\\n"}')]),
    ],
    "no_id_no_text": [_delta(tool_calls=[_call(0, None, "bash", "{}")])],
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_answers_items_sent_back_are_the_assistant_message_the_chat_stream_made(name):
    """The token-in property at its root: whatever the chat stream held (reasoning, text around
    tool calls, a custom tool's call), its Responses items, sent back as Codex keeps them,
    translate to an assistant message with the same text and the same calls in order."""
    from pi_env.proxy.capture import Assembler, TurnCapture
    from pi_env.proxy.dialects.base import AnswerStream, Route
    from pi_env.proxy.dialects.responses import ResponsesDialect

    dialect = ResponsesDialect()
    tools = [BASH, {"type": "function", "name": "read"}, {"type": "custom", "name": "apply_patch"}]
    call = dialect.to_chat({"model": "m", "input": "go", "tools": tools, "stream": True}, Route())
    finish = {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    usage = {
        "id": "c",
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
    }
    chat_stream = sse(*ANSWERS[name], finish, usage) + b"data: [DONE]\n\n"
    stream = AnswerStream(dialect, call, 200, "text/event-stream")
    raw = b"".join(stream.feed(chat_stream[i : i + 7]) for i in range(0, len(chat_stream), 7)) + stream.finish()
    events = [json.loads(block.split("\ndata: ")[1]) for block in raw.decode().split("\n\n") if block]
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    completed = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and completed["usage"]["total_tokens"] == 14
    output = completed["output"]
    assert [item["id"] for item in output] == [
        e["item"]["id"] for e in events if e["type"] == "response.output_item.added"
    ]
    assert output == [
        e["item"]
        for e in sorted(
            (e for e in events if e["type"] == "response.output_item.done"), key=lambda e: e["output_index"]
        )
    ]

    given = Assembler(TurnCapture(request={})).stream(chat_stream).choices[0].message()
    back = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in output]
    again = dialect.to_chat(
        {"model": "m", "input": [{"role": "user", "content": "go"}, *back], "tools": tools}, Route()
    )
    (sent,) = [m for m in again.chat["messages"] if m["role"] == "assistant"]
    assert (sent["content"] or "") == (given.get("content") or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in sent["tool_calls"]] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in given["tool_calls"]
    ]
    assert [c["id"] for c in sent["tool_calls"]] == [
        i["call_id"] for i in output if i["type"] != "message" and i["type"] != "reasoning"
    ]
    if name == "custom_tool":
        assert output[-1]["type"] == "custom_tool_call" and output[-1]["input"] == "*** Begin Patch\n"


def test_sampling_output_format_tool_choice_and_images_map_to_their_chat_fields():
    from pi_env.proxy.dialects.base import Route
    from pi_env.proxy.dialects.responses import ResponsesDialect

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}
    call = ResponsesDialect().to_chat(
        {
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, image]}],
            "tools": [BASH],
            "tool_choice": {"type": "function", "name": "bash"},
            "parallel_tool_calls": False,
            "temperature": 0.3,
            "top_p": 0.9,
            "max_output_tokens": 99,
            "stream": False,
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True},
                "verbosity": "low",
            },
            "reasoning": {"effort": "high", "summary": None},
            "metadata": {"secret": "kept out of notes"},
            "service_tier": "flex",
            "some_new_field": 1,
        },
        Route(),
    )
    assert call.chat == {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image_url", "image_url": {"url": image["image_url"], "detail": "low"}},
                ],
            }
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "description": "Run a command",
                    "parameters": BASH["parameters"],
                    "strict": False,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "bash"}},
        "parallel_tool_calls": False,
        "temperature": 0.3,
        "top_p": 0.9,
        "max_tokens": 99,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
    }
    assert call.streamed is False and call.model == "m"
    assert call.notes == [
        "text.verbosity: low",
        "reasoning effort=high",
        "metadata",
        "service_tier=flex",
        "ignored: some_new_field",
    ]
    assert "kept out" not in json.dumps(call.notes)


def collapsed(types: list[str]) -> list[str]:
    """The event types with runs of one type (delta events) counted once."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]
