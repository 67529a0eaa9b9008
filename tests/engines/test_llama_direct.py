"""llama.cpp's llama-server alone: the second engine, serving the Q4_1 GGUF directly.

Its OpenAI-compatible answers carry no prompt ids and no ``token_ids`` field; its logprob
entries carry each token's ``id``, and the prompt ids come from ``/apply-template`` +
``/tokenize``. These tests pin down what a capture can rely on there, and where it differs
from vLLM (no logprobs with tools + stream).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

import pytest

from engine import NOTES, Engine, eos_token_ids, post_json
from scoring import score_with_transformers
from test_engine_direct import CONVERSATIONS, MESSAGES, SEED, TOOL_MESSAGES, WEATHER_TOOL, tokenize

LOGPROBS = {"logprobs": True, "top_logprobs": 5}


def request(engine: Engine, messages, tools=None, **extra) -> dict[str, Any]:
    body = {"model": engine.model, "messages": messages, "temperature": 0, "seed": SEED, "max_tokens": 32, **LOGPROBS}
    if tools:
        body["tools"] = tools
    body.update(extra)
    return body


def llama_prompt_ids(engine: Engine, messages, tools=None) -> list[int]:
    """The ids llama-server feeds the model: its own template rendering, tokenized as it does."""
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    prompt = post_json(engine.root_url + "/apply-template", body)["prompt"]
    return post_json(engine.root_url + "/tokenize", {"content": prompt, "add_special": False, "parse_special": True})[
        "tokens"
    ]


def llama_detokenize(engine: Engine, ids: list[int]) -> str:
    return post_json(engine.root_url + "/detokenize", {"tokens": ids})["content"]


def collect_stream(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    from engine import stream_sse

    out: dict[str, Any] = {"ids": [], "logprobs": [], "content": "", "chunks": 0}
    for chunk in stream_sse(engine.base_url + "/chat/completions", dict(body, stream=True, stream_options={"include_usage": True})):
        out["chunks"] += 1
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            entries = (choice.get("logprobs") or {}).get("content") or []
            out["logprobs"] += entries
            out["ids"] += [e["id"] for e in entries]
            out["content"] += (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
    return out


def check_entries(entries: list[dict[str, Any]], n_top: int = 5, greedy: bool = True) -> list[int]:
    """Every entry names its token id; logprobs sane; greedy = top-1 (unless a grammar may
    have masked the argmax: logprobs are the model's, before constraints). Returns the ids."""
    assert entries, "no logprobs"
    for entry in entries:
        assert isinstance(entry["id"], int)
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0.0
        top = entry["top_logprobs"]
        assert len(top) == n_top and all(isinstance(t["id"], int) for t in top)
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        if greedy:
            assert top[0]["id"] == entry["id"]  # temperature 0: the argmax
            assert entry["logprob"] == pytest.approx(values[0], abs=1e-6)
    return [e["id"] for e in entries]


@pytest.fixture(scope="module")
def llama_greedy(llama_engine) -> dict[str, Any]:
    return post_json(llama_engine.base_url + "/chat/completions", request(llama_engine, MESSAGES))


def test_llama_logprob_entries_carry_token_ids(llama_engine, llama_greedy):
    choice = llama_greedy["choices"][0]
    ids = check_entries(choice["logprobs"]["content"])
    assert llama_greedy["usage"]["completion_tokens"] == len(ids)
    eos = eos_token_ids(llama_engine.model_dir)
    text = choice["message"]["content"]
    assert llama_detokenize(llama_engine, [i for i in ids if i not in eos]).strip() == text.strip()
    NOTES.append(f"llama.cpp greedy answer ({len(ids)} tokens, finish={choice['finish_reason']}): {text!r}")


def test_llama_prompt_ids_from_apply_template_and_tokenize(llama_engine, llama_greedy):
    ids = llama_prompt_ids(llama_engine, MESSAGES)
    assert llama_greedy["usage"]["prompt_tokens"] == len(ids)
    assert llama_detokenize(llama_engine, ids).endswith("<|im_start|>assistant\n")


def test_llama_streaming_equals_nonstreaming(llama_engine, llama_greedy):
    streamed = collect_stream(llama_engine, request(llama_engine, MESSAGES))
    choice = llama_greedy["choices"][0]
    assert check_entries(streamed["logprobs"]) == [e["id"] for e in choice["logprobs"]["content"]]
    assert streamed["content"] == choice["message"]["content"]
    diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed["logprobs"], choice["logprobs"]["content"])]
    assert max(diffs) < 1e-3, diffs


def test_llama_refuses_logprobs_with_tools_while_streaming(llama_engine):
    """The limitation the gateway's unstreamed fallback exists for."""
    body = request(llama_engine, TOOL_MESSAGES, [WEATHER_TOOL], stream=True)
    req = urllib.request.Request(
        llama_engine.base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 400
    assert "logprobs is not supported with tools + stream" in refused.value.read().decode()


def test_llama_tools_unstreamed_have_ids(llama_engine):
    """With tools (unstreamed, as the gateway falls back to) the answer still has ids.

    With this template llama-server does not turn "required" into a tool call: SmolLM2 answers
    in text (a constraint still acts: the chosen token is not always the argmax, e.g. the end
    of turn is masked). Recorded, not asserted."""
    body = request(llama_engine, TOOL_MESSAGES, [WEATHER_TOOL], tool_choice="required", max_tokens=64)
    answer = post_json(llama_engine.base_url + "/chat/completions", body)
    choice = answer["choices"][0]
    ids = check_entries(choice["logprobs"]["content"], greedy=False)
    assert answer["usage"]["completion_tokens"] == len(ids)
    assert answer["usage"]["prompt_tokens"] == len(llama_prompt_ids(llama_engine, TOOL_MESSAGES, [WEATHER_TOOL]))
    calls = choice["message"].get("tool_calls") or []
    what = f"tool call {calls[0]['function']}" if calls else f"text {choice['message']['content'][:60]!r}..."
    NOTES.append(f"llama.cpp with tools, tool_choice=required ({len(ids)} tokens): {what}")


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_both_engines_tokenize_the_same_prompt(vllm_engine, llama_engine, name):
    """Same template, same vocabulary: llama.cpp's prompt ids equal vLLM's /tokenize."""
    messages, tools = CONVERSATIONS[name]
    assert llama_prompt_ids(llama_engine, messages, tools) == tokenize(vllm_engine, messages, tools)


def test_transformers_logprobs_match_llama(llama_engine, llama_greedy):
    """llama.cpp computes with the Q4_1 weights (and 8-bit activations in its dot products);
    transformers with the same weights dequantized to float32: close, not equal."""
    choice = llama_greedy["choices"][0]
    entries = choice["logprobs"]["content"]
    prompt = llama_prompt_ids(llama_engine, MESSAGES)
    hf = score_with_transformers(llama_engine.model_dir, prompt, [e["id"] for e in entries])
    diffs = [abs(e["logprob"] - h) for e, h in zip(entries, hf)]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    NOTES.append(f"transformers vs llama.cpp logprobs over {len(diffs)} tokens: max |diff| {worst:.2e}, mean {mean:.2e}")
    # seen here: max 0.14, mean 0.04 over 32 tokens
    assert worst < 0.5, list(zip([e["logprob"] for e in entries], hf))
