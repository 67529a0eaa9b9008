"""The engine alone, no pi-env in between: what the proxy capture will rely on.

vLLM (CPU, float32) serving SmolLM2-135M-Instruct, greedy (temperature 0, fixed seed), asked
for ``logprobs``, ``top_logprobs: 5``, ``return_token_ids`` and ``return_tokens_as_token_ids``
(logprob entries then name their token as ``token_id:N``, so alignment is checked exactly).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from engine import NOTES, Engine, eos_token_ids, get_json, post_json, stream_sse
from scoring import render_with_transformers, score_with_transformers

SEED = 1234
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colors of the rainbow."},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A conversation shaped like Pi's: an assistant tool call, its result, and a follow-up.
TOOL_HISTORY = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, light rain"},
    {"role": "assistant", "content": "It is 18 C with light rain in Paris."},
    {"role": "user", "content": "And should I take an umbrella?"},
]
CONVERSATIONS = {
    "plain": (MESSAGES, None),
    "tools": (TOOL_MESSAGES, [WEATHER_TOOL]),
    "tool_history": (TOOL_HISTORY, [WEATHER_TOOL]),
}
ID_FIELDS = {"logprobs": True, "top_logprobs": 5, "return_token_ids": True, "return_tokens_as_token_ids": True}


def request(engine: Engine, messages, tools=None, **extra) -> dict[str, Any]:
    body = {"model": engine.model, "messages": messages, "temperature": 0, "seed": SEED, "max_tokens": 32, **ID_FIELDS}
    if tools:
        body["tools"] = tools
    body.update(extra)
    return body


def tokenize(engine: Engine, messages, tools=None) -> list[int]:
    body = {"model": engine.model, "messages": messages, "add_generation_prompt": True}
    if tools:
        body["tools"] = tools
    return post_json(engine.root_url + "/tokenize", body)["tokens"]


def detokenize(engine: Engine, ids: list[int]) -> str:
    return post_json(engine.root_url + "/detokenize", {"model": engine.model, "tokens": ids})["prompt"]


def entry_id(entry: dict[str, Any]) -> int:
    """The token id of a logprob entry (tokens are `token_id:N` with return_tokens_as_token_ids)."""
    prefix, _, number = entry["token"].partition(":")
    assert prefix == "token_id", entry
    return int(number)


def collect_stream(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """Run a streaming request and put its pieces back together."""
    out: dict[str, Any] = {"prompt_token_ids": None, "token_ids": [], "logprobs": [], "content": "", "chunks": 0}
    tool_calls: dict[int, dict[str, str]] = {}
    for chunk in stream_sse(engine.base_url + "/chat/completions", dict(body, stream=True, stream_options={"include_usage": True})):
        out["chunks"] += 1
        if chunk.get("prompt_token_ids") is not None:
            assert out["prompt_token_ids"] is None, "prompt_token_ids sent twice"
            out["prompt_token_ids"] = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            out["token_ids"] += choice.get("token_ids") or []
            if choice.get("logprobs"):
                out["logprobs"] += choice["logprobs"]["content"] or []
            delta = choice.get("delta") or {}
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = tool_calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
    out["tool_calls"] = [tool_calls[i] for i in sorted(tool_calls)]
    return out


def check_aligned(token_ids: list[int], logprobs: list[dict[str, Any]], n_top: int = 5) -> None:
    """One logprob entry per generated token, naming that token; sane numbers; greedy = top-1."""
    assert token_ids, "no token ids"
    assert len(logprobs) == len(token_ids), (len(logprobs), len(token_ids))
    for tid, entry in zip(token_ids, logprobs):
        assert entry_id(entry) == tid
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0.0
        top = entry["top_logprobs"]
        assert len(top) == n_top
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        # temperature 0 picks the argmax: the chosen token is the top-1 (up to exact ties)
        assert entry["logprob"] == pytest.approx(values[0], abs=1e-6)


@pytest.fixture(scope="module")
def greedy(vllm_engine) -> dict[str, Any]:
    """One non-streaming greedy answer to MESSAGES, shared by the tests below."""
    return post_json(vllm_engine.base_url + "/chat/completions", request(vllm_engine, MESSAGES))


def test_models_lists_the_served_model(vllm_engine):
    models = get_json(vllm_engine.base_url + "/models")
    assert [m["id"] for m in models["data"]] == [vllm_engine.model]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_token_ids_equal_tokenize(vllm_engine, name):
    messages, tools = CONVERSATIONS[name]
    response = post_json(vllm_engine.base_url + "/chat/completions", request(vllm_engine, messages, tools, max_tokens=4))
    prompt_ids = response["prompt_token_ids"]
    assert prompt_ids == tokenize(vllm_engine, messages, tools)
    assert response["usage"]["prompt_tokens"] == len(prompt_ids)
    assert detokenize(vllm_engine, prompt_ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_transformers_renders_the_same_prompt(vllm_engine, name):
    """The chat template gives the same ids in the engine and in transformers (the scorer)."""
    messages, tools = CONVERSATIONS[name]
    assert render_with_transformers(vllm_engine.model_dir, messages, tools) == tokenize(vllm_engine, messages, tools)


def test_nonstreaming_ids_and_logprobs_aligned(vllm_engine, greedy):
    choice = greedy["choices"][0]
    ids = choice["token_ids"]
    check_aligned(ids, choice["logprobs"]["content"])
    assert greedy["usage"]["completion_tokens"] == len(ids)
    text = choice["message"]["content"]
    assert text.strip(), greedy
    # the ids are the text: decoding them (special tokens dropped) gives the message content
    eos = eos_token_ids(vllm_engine.model_dir)
    assert detokenize(vllm_engine, [i for i in ids if i not in eos]).strip() == text.strip()
    NOTES.append(f"greedy answer ({len(ids)} tokens, finish={choice['finish_reason']}): {text!r}")


def test_streaming_equals_nonstreaming(vllm_engine, greedy):
    streamed = collect_stream(vllm_engine, request(vllm_engine, MESSAGES))
    choice = greedy["choices"][0]
    assert streamed["prompt_token_ids"] == greedy["prompt_token_ids"]
    assert streamed["token_ids"] == choice["token_ids"]
    check_aligned(streamed["token_ids"], streamed["logprobs"])
    assert streamed["content"] == choice["message"]["content"]
    assert streamed["finish_reason"] == choice["finish_reason"]
    assert streamed["usage"]["completion_tokens"] == len(streamed["token_ids"])
    diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed["logprobs"], choice["logprobs"]["content"])]
    assert max(diffs) < 1e-3, diffs
    NOTES.append(f"stream vs non-stream: {streamed['chunks']} chunks, max |dlogprob| {max(diffs):.2e}")


def test_forced_tool_call_streams_with_ids(vllm_engine):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    body = request(vllm_engine, TOOL_MESSAGES, [WEATHER_TOOL], tool_choice=tool_choice, max_tokens=96)
    streamed = collect_stream(vllm_engine, body)
    assert streamed["prompt_token_ids"] == tokenize(vllm_engine, TOOL_MESSAGES, [WEATHER_TOOL])
    assert [c["name"] for c in streamed["tool_calls"]] == ["get_weather"], streamed
    check_aligned(streamed["token_ids"], streamed["logprobs"])
    assert streamed["usage"]["completion_tokens"] == len(streamed["token_ids"])
    assert streamed["finish_reason"] in ("stop", "tool_calls")
    arguments = streamed["tool_calls"][0]["arguments"]
    # The ids are the whole call as the model wrote it, a hermes block
    # <tool_call>{"name": ..., "arguments": ...}</tool_call>; the streamed arguments are that
    # block's "arguments" (re-serialised).
    eos = eos_token_ids(vllm_engine.model_dir)
    text = detokenize(vllm_engine, [i for i in streamed["token_ids"] if i not in eos]).strip()
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "get_weather"
    assert json.loads(arguments) == call["arguments"]
    shape = "as the schema asks" if isinstance(call["arguments"].get("city"), str) else "wrong-shaped"
    NOTES.append(f"forced tool call ({len(streamed['token_ids'])} tokens, {shape}): {json.dumps(call['arguments'])}")


def test_tools_on_auto_answer_with_ids(vllm_engine):
    """Pi always sends tools with tool_choice auto; SmolLM2 answers in text, ids still there."""
    streamed = collect_stream(vllm_engine, request(vllm_engine, TOOL_HISTORY, [WEATHER_TOOL], tool_choice="auto"))
    assert streamed["prompt_token_ids"] == tokenize(vllm_engine, TOOL_HISTORY, [WEATHER_TOOL])
    check_aligned(streamed["token_ids"], streamed["logprobs"])
    assert streamed["content"] or streamed["tool_calls"]


def test_transformers_logprobs_match_engine(vllm_engine, greedy):
    choice = greedy["choices"][0]
    engine_lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    hf_lps = score_with_transformers(vllm_engine.model_dir, greedy["prompt_token_ids"], choice["token_ids"])
    assert len(hf_lps) == len(engine_lps)
    diffs = [abs(a - b) for a, b in zip(engine_lps, hf_lps)]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    NOTES.append(
        f"transformers vs vLLM logprobs over {len(diffs)} tokens: max |diff| {worst:.2e}, mean {mean:.2e}"
        f" (engine sum {sum(engine_lps):.4f}, transformers sum {sum(hf_lps):.4f})"
    )
    # both compute in float32 from the same weights: seen here max 2e-5
    assert worst < 1e-3, list(zip(engine_lps, hf_lps))
