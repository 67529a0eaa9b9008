"""transparent_proxy against a real engine (vLLM CPU serving SmolLM2-135M-Instruct).

What a GRPO user relies on: the ids and logprobs the gateway captures are exactly the engine's,
the captured prompt ids are the engine's own tokenisation, tool-call streams keep their ids, a
real Pi rollout gets ids and logprobs on every turn, and the same weights in transformers give
the same logprobs for the captured sequence (reported per turn)."""

from __future__ import annotations

import asyncio
import math
import statistics

import aiohttp
import pytest

from engine import NOTES, post_json
from pi_env import PiConfig, PiTask, run_rollout
from pi_env.proxy import Upstream, get_gateway
from pi_env.proxy.rewrite import CaptureOptions, rewrite_request
from scoring import score_with_transformers
from test_engine_direct import MESSAGES, SEED, WEATHER_TOOL, collect_stream, tokenize

TOP = 5


def capture_options(engine) -> CaptureOptions:
    return CaptureOptions(logprobs=True, top_logprobs=TOP, return_token_ids=True, model=engine.model,
                          sampling={"temperature": 0.0, "seed": SEED})


def agent_body(**extra) -> dict:
    """What Pi would send: streaming, no capture parameters, its own sampling choices."""
    return {"model": "whatever-pi-calls-it", "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 1.3, "max_tokens": 4096, **extra}


def through_gateway(engine, body: dict, options: CaptureOptions | None = None, max_tokens_cap: int = 48):
    """One call through a transparent_proxy session (its cap on every call: `max_tokens_cap`);
    returns (session's turn record, SSE bytes)."""
    gateway = get_gateway()
    session = gateway.open_session(Upstream(engine.base_url, None, engine.model), mode="transparent_proxy",
                                   capture=options or capture_options(engine), max_tokens_cap=max_tokens_cap)

    async def call() -> bytes:
        async with aiohttp.ClientSession() as client:
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {session.token}"}) as response:
                assert response.status == 200, await response.text()
                return await response.read()

    try:
        raw = asyncio.run(call())
        assert session.wait_idle(60)
        (turn,) = session.turns
        return turn, raw
    finally:
        gateway.close_session(session)


def test_captured_ids_and_logprobs_equal_the_engines(vllm_engine):
    turn, _ = through_gateway(vllm_engine, agent_body())
    capture = turn.capture
    assert capture.request["temperature"] == 0.0 and capture.request["max_tokens"] == 48  # forced, capped
    direct = collect_stream(vllm_engine, {k: v for k, v in capture.request.items()
                                          if k not in ("stream", "stream_options")})
    assert capture.completion_token_ids == direct["token_ids"] and capture.completion_token_ids
    assert capture.per_token_logps == pytest.approx([e["logprob"] for e in direct["logprobs"]], abs=1e-6)
    assert capture.prompt_token_ids == direct["prompt_token_ids"]
    assert capture.token_ids_source == "token_ids" and capture.token_ids_missing_reason is None
    assert all(len(top) == TOP for top in capture.choices[0].decoded_top_logprobs())


def test_captured_prompt_ids_equal_the_engines_tokenize(vllm_engine):
    turn, _ = through_gateway(vllm_engine, agent_body())
    assert turn.capture.prompt_token_ids == tokenize(vllm_engine, MESSAGES)


def test_forced_tool_call_streams_through_with_ids(vllm_engine):
    body = agent_body(tools=[WEATHER_TOOL],
                      tool_choice={"type": "function", "function": {"name": WEATHER_TOOL["function"]["name"]}})
    turn, raw = through_gateway(vllm_engine, body)
    capture = turn.capture
    (call,) = capture.choices[0].tool_calls
    assert call["function"]["name"] == WEATHER_TOOL["function"]["name"]  # arguments: the model's own shape
    assert capture.completion_token_ids and len(capture.per_token_logps) == len(capture.completion_token_ids)
    assert capture.prompt_token_ids == tokenize(vllm_engine, MESSAGES, [WEATHER_TOOL])
    assert b'"tool_calls"' in raw and raw.endswith(b"data: [DONE]\n\n")


def test_pi_rollout_against_the_engine_has_ids_and_logprobs_on_every_turn(vllm_engine, tmp_path):
    config = PiConfig(
        endpoint={"name": vllm_engine.base_url, "model": vllm_engine.model},
        mode={"name": "transparent_proxy", "return_token_ids": True, "sampling": {"temperature": 0.0, "seed": SEED}, "trace_dir": str(tmp_path)},
        gateway={"max_turns": 3, "max_tokens": 64},
        agent={"context_window": 8192},
    )
    task = PiTask(task_id="engine-hello", instruction="Say hello in one short sentence.", verify=["true"],
                  timeouts={"agent_s": 600})
    result = run_rollout(task, config)
    assert result.error_kind is None, (result.error, result.agent_log_tail)
    assert result.proxy_turns, "Pi made no model call"
    for turn in result.proxy_turns:
        assert turn.upstream_status == 200
        assert turn.prompt_token_ids and turn.completion_token_ids, turn.token_ids_missing_reason
        assert len(turn.per_token_logps) == len(turn.completion_token_ids)
        assert all(lp is not None and lp <= 0 for lp in turn.per_token_logps)
    assert result.training.segments and sum(result.training.segments[0].loss_mask) >= 1
    NOTES.append(f"Pi rollout against vLLM: {len(result.proxy_turns)} turn(s), completion tokens per turn "
                 f"{[len(t.completion_token_ids) for t in result.proxy_turns]}, stop_reason={result.stop_reason}, "
                 f"wall {result.wall_s:.1f} s")
    _compare_with_transformers(vllm_engine, result.proxy_turns)


def _compare_with_transformers(engine, turns) -> None:
    """The trainer's check: the same weights score the captured ids as the engine did."""
    for turn in turns:
        scored = score_with_transformers(engine.model_dir, turn.prompt_token_ids, turn.completion_token_ids)
        diffs = [abs(a - b) for a, b in zip(scored, turn.per_token_logps)]
        assert len(scored) == len(turn.completion_token_ids) and all(math.isfinite(d) for d in diffs)
        NOTES.append(f"turn {turn.turn}: {len(diffs)} tokens, transformers vs captured logprobs: "
                     f"max abs diff {max(diffs):.5f}, mean {statistics.fmean(diffs):.5f}")
        assert max(diffs) < 0.05


def test_a_plain_request_through_the_proxy_matches_direct_transformers_scoring(vllm_engine):
    turn, _ = through_gateway(vllm_engine, agent_body())
    _compare_with_transformers(vllm_engine, [_TurnView(turn)])


class _TurnView:
    """A gateway record seen with RolloutTurn's field names."""

    def __init__(self, record):
        self.turn = record.turn
        self.prompt_token_ids = record.capture.prompt_token_ids
        self.completion_token_ids = record.capture.completion_token_ids
        self.per_token_logps = record.capture.per_token_logps


def test_engine_request_rewrite_is_what_the_engine_received(vllm_engine):
    """The rewrite is accepted by a real vLLM (no 400 for any parameter we add)."""
    body = rewrite_request(agent_body(max_tokens=48), capture_options(vllm_engine))  # as the policy capped it
    unstreamed = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    answer = post_json(vllm_engine.base_url + "/chat/completions", unstreamed)
    assert answer["choices"][0]["token_ids"] and answer["prompt_token_ids"]


def test_llama_cpp_rejecting_logprobs_with_tools_and_stream_falls_back_keeping_ids(llama_engine):
    """llama.cpp answers 400 "logprobs is not supported with tools + stream": the gateway asks
    unstreamed with capture, replays the answer to the agent as SSE, and keeps the ids."""
    options = CaptureOptions(logprobs=True, top_logprobs=TOP, model=llama_engine.model,
                             sampling={"temperature": 0.0, "seed": SEED})
    turn, raw = through_gateway(llama_engine, agent_body(tools=[WEATHER_TOOL]), options, max_tokens_cap=32)
    capture = turn.capture
    assert capture.fallback and capture.fallback.startswith("non_streaming")
    assert raw.startswith(b"data: ") and raw.endswith(b"data: [DONE]\n\n")
    assert capture.completion_token_ids and len(capture.per_token_logps) == len(capture.completion_token_ids)
    assert capture.token_ids_source == "logprob_tokens"
    NOTES.append(f"llama.cpp fallback: {capture.fallback[:60]}..., {len(capture.completion_token_ids)} ids kept")
