"""The gateway's dialects on the real engine (vLLM CPU, SmolLM2-135M-Instruct): each official SDK
(openai Responses, anthropic Messages, google-genai generateContent), streamed and not, makes a
tool call and sends its result back through a transparent_proxy session with token-in. What must
hold in every dialect: the tool call the SDK parsed is the one the engine's ids say (the captured
message), every completion id is what vLLM streamed for that prompt, and the second call is
bridged from the first (one exact training sequence: its prompt starts with the first call's
prompt and completion ids).

As in test_token_in_engine.py (whose relay this reuses), SmolLM2 never calls a tool on its own:
the relay forces the answers into a Hermes call of `bash` (both calls here: FORCED_CALLS).
"""

from __future__ import annotations

import json

import pytest
from test_token_in_engine import Relay

from pi_env._aio import run_sync
from pi_env.proxy import Upstream, get_gateway
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.proxy.token_in import load_renderer

pytest.importorskip("renderers", reason="token-in needs pi-env[token-in]")

PROMPT = "Look around the work dir with bash, then say what you found."
RESULT = "notes.txt\n"
DESCRIPTION = "Run a shell command."
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def responses_calls(root: str, token: str, streamed: bool) -> list[tuple[str, list[tuple[str, dict]]]]:
    from openai import OpenAI

    client = OpenAI(base_url=root + "/v1", api_key=token, max_retries=0)
    tools = [{"type": "function", "name": "bash", "description": DESCRIPTION, "parameters": SCHEMA}]

    def ask(items):
        if not streamed:
            return client.responses.create(model="m", input=items, tools=tools, max_output_tokens=96)
        with client.responses.stream(model="m", input=items, tools=tools, max_output_tokens=96) as stream:
            return stream.get_final_response()

    def seen(response):
        calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
        return response.output_text, calls

    items: list = [{"role": "user", "content": PROMPT}]
    first = ask(items)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, f"the forced answer reached the SDK without its call: {first.output}"
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT} for call in calls]
    return [seen(first), seen(ask(items))]


def messages_calls(root: str, token: str, streamed: bool) -> list[tuple[str, list[tuple[str, dict]]]]:
    from anthropic import Anthropic

    client = Anthropic(base_url=root, api_key=token, max_retries=0)
    tools = [{"name": "bash", "description": DESCRIPTION, "input_schema": SCHEMA}]

    def ask(messages):
        if not streamed:
            return client.messages.create(model="m", max_tokens=96, messages=messages, tools=tools)
        with client.messages.stream(model="m", max_tokens=96, messages=messages, tools=tools) as stream:
            return stream.get_final_message()

    def seen(message):
        text = "".join(block.text for block in message.content if block.type == "text")
        return text, [(block.name, block.input) for block in message.content if block.type == "tool_use"]

    messages: list = [{"role": "user", "content": PROMPT}]
    first = ask(messages)
    uses = [block for block in first.content if block.type == "tool_use"]
    assert uses, f"the forced answer reached the SDK without its call: {first.content}"
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}
                                              for use in uses]}]  # fmt: skip
    return [seen(first), seen(ask(messages))]


def gemini_calls(root: str, token: str, streamed: bool) -> list[tuple[str, list[tuple[str, dict]]]]:
    from google import genai
    from google.genai import types

    client = genai.Client(api_key=token, http_options=types.HttpOptions(base_url=root, api_version="v1beta"))
    config = types.GenerateContentConfig(
        max_output_tokens=96,
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
            name="bash", description=DESCRIPTION, parameters_json_schema=SCHEMA)])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )  # fmt: skip

    def ask(contents) -> list[types.Part]:
        if not streamed:
            answer = client.models.generate_content(model="m", contents=contents, config=config)
            return list(answer.candidates[0].content.parts or [])
        parts: list[types.Part] = []
        for chunk in client.models.generate_content_stream(model="m", contents=contents, config=config):
            if chunk.candidates and chunk.candidates[0].content:
                parts += chunk.candidates[0].content.parts or []
        return parts

    def seen(parts):
        text = "".join(part.text for part in parts if part.text and not part.thought)
        return text, [(part.function_call.name, dict(part.function_call.args)) for part in parts if part.function_call]

    contents: list = [types.Content(role="user", parts=[types.Part(text=PROMPT)])]
    first = ask(contents)
    calls = [part.function_call for part in first if part.function_call]
    assert calls, f"the forced answer reached the SDK without its call: {first}"
    contents += [types.Content(role="model", parts=first),
                 types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                     id=call.id, name=call.name, response={"output": RESULT})) for call in calls])]  # fmt: skip
    return [seen(first), seen(ask(contents))]


CLIENTS = {"responses": responses_calls, "messages": messages_calls, "gemini": gemini_calls}


@pytest.fixture(scope="module")
def relay(vllm_engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vllm_engine.model_dir))
    relay = Relay(vllm_engine.base_url, tokenizer.encode("<|im_start|>assistant", add_special_tokens=False))
    run_sync(relay.start(), timeout=30)
    yield relay
    run_sync(relay.runner.cleanup(), timeout=30)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("dialect", sorted(CLIENTS))
def test_each_dialects_sdk_round_trip_is_one_exact_sequence(dialect, streamed, relay, vllm_engine):
    gateway = get_gateway()
    options = CaptureOptions(logprobs=True, top_logprobs=1, return_token_ids=True, model=vllm_engine.model,
                             sampling={"temperature": 0.0, "seed": 7})  # fmt: skip
    session = gateway.open_session(Upstream(relay.base_url, None, vllm_engine.model), mode="transparent_proxy",
                                   capture=options, max_tokens_cap=96, token_in=load_renderer("auto", str(vllm_engine.model_dir)))
    try:
        answers = CLIENTS[dialect](f"http://127.0.0.1:{gateway.tcp_port}", session.token, streamed)
        assert session.wait_idle(120)
        turns = list(session.turns)
    finally:
        gateway.close_session(session)
    assert [turn.dialect for turn in turns] == [dialect, dialect]
    first, second = (turn.capture for turn in turns)
    # One sequence: the second prompt is the first prompt + its completion + the tool result.
    assert (first.token_in["outcome"], second.token_in["outcome"]) == ("first", "bridged"), second.token_in
    head = first.prompt_token_ids + first.completion_token_ids
    assert second.prompt_token_ids[: len(head)] == head
    for capture in (first, second):
        engine = relay.seen[("completions", tuple(capture.prompt_token_ids))]
        assert capture.completion_token_ids == engine["ids"] and capture.per_token_logps == engine["logprobs"]
    # What the SDK parsed is the captured message: the text and every tool call, name and arguments.
    for (text, calls), capture in zip(answers, (first, second)):
        message = capture.choices[0].message()
        assert text == (message["content"] or "")
        assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in message.get("tool_calls") or []]  # fmt: skip
    assert answers[0][1], "the forced first answer is a tool call"
