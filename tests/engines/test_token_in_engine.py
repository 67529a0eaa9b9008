"""Token-in against the real engine (vLLM CPU, SmolLM2-135M-Instruct, the chatml_tools template):
real Pi rollouts with two tool-calling turns each stay one exact sequence; every prompt sent is
what the engine echoes, every completion id and logprob is what the engine streamed; transformers
scoring the merged sequence reproduces the captured logprobs; the same rollouts through the plain
capture path, for comparison, extend far less often.

SmolLM2 never calls a tool on its own, so a tier-only knob forces the first two answers of each
rollout into a Hermes tool call: a loopback relay between the gateway and vLLM adds a
`structured_outputs` regex to those requests (same regex in both modes; the tokens are still
chosen by the model, and vLLM's logprobs stay the raw ones), and caps the free third answer at
UNFORCED_MAX_TOKENS (the CPU engine is slow on a shared machine). The relay also keeps what the
engine streamed for every prompt, to check the gateway's records against. Greedy decoding with
a different task per rollout; both modes run side by side (CONCURRENCY rollouts at a time).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from engine import NOTES
from pi_env import PiConfig, PiSessionFactory, PiTask
from pi_env._aio import run_sync
from scoring import score_with_transformers

pytest.importorskip("renderers", reason="token-in needs pi-env[token-in]")

ROLLOUTS = int(os.environ.get("TOKEN_IN_ROLLOUTS", "20"))  # fewer while working on it
PLAIN_ROLLOUTS = int(os.environ.get("TOKEN_IN_PLAIN_ROLLOUTS", str(ROLLOUTS)))  # the comparison: the first ones
CONCURRENCY = int(os.environ.get("TOKEN_IN_CONCURRENCY", "8"))
FORCED_CALLS = 2
UNFORCED_MAX_TOKENS = 16
COMMANDS = ["ls", "pwd", "ls -la", "cat notes.txt", "echo hello", "date", "wc -l notes.txt", "head notes.txt"]
TOOL_CALL_REGEX = ('<tool_call>\\n\\{"name": "bash", "arguments": \\{"command": "('
                   + "|".join(c.replace(".", "\\.") for c in COMMANDS) + ')"\\}\\}\\n</tool_call>')


@dataclass
class Relay:
    """Forward to vLLM; force the first FORCED_CALLS answers of a conversation into a tool call;
    keep what vLLM streamed back (per request: prompt ids echoed, completion ids, logprobs)."""

    upstream: str  # http://127.0.0.1:PORT/v1
    assistant_ids: list[int]  # "<|im_start|>assistant": counts a token prompt's past turns
    regex: str = TOOL_CALL_REGEX  # the forced answer (an agent's own shell tool: test_agents_engine.py)
    seen: dict[tuple, dict] = field(default_factory=dict)  # (path, prompt ids) -> what the engine streamed
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def past_turns(self, body: dict) -> int:
        if "messages" in body:
            return sum(1 for m in body["messages"] if m.get("role") == "assistant")
        prompt, marker = body.get("prompt") or [], self.assistant_ids
        return sum(prompt[i:i + len(marker)] == marker for i in range(len(prompt))) - 1

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream") and self.past_turns(body) < FORCED_CALLS:
            body["structured_outputs"] = {"regex": self.regex}
        elif body.get("stream"):
            body["max_tokens"] = min(body.get("max_tokens") or UNFORCED_MAX_TOKENS, UNFORCED_MAX_TOKENS)
        # No total timeout: on a shared CPU a forced answer can take minutes (aiohttp's default is 5).
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=1800)) as client:
            async with client.post(self.upstream + "/" + request.match_info["rest"], json=body) as answer:
                response = web.StreamResponse(status=answer.status, headers={"Content-Type": answer.content_type})
                await response.prepare(request)
                # Each chunk is passed on when the next arrives, so the answer is kept before the
                # stream's last chunk reaches the gateway: its turn, and the test reading `seen`
                # after it, can finish before this handler goes on.
                raw, held = bytearray(), b""
                async for chunk in answer.content.iter_any():
                    raw += chunk
                    if held:
                        await response.write(held)
                    held = chunk
                if body.get("stream"):
                    self.keep(request.match_info["rest"], raw, chat="messages" in body)
                if held:
                    await response.write(held)
                await response.write_eof()
        return response

    def keep(self, path: str, raw: bytearray, chat: bool) -> None:
        answer = engine_answer(bytes(raw), chat=chat)
        # By path too: a first turn's prompt is the same ids through both paths.
        self.seen[(path, tuple(answer["prompt"] or ()))] = answer

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/{rest:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock).start()


def engine_answer(raw: bytes, chat: bool) -> dict:
    """Prompt ids, completion ids and logprobs as the engine streamed them."""
    prompt, ids, logprobs = None, [], []
    for line in raw.decode().split("\n"):
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices") or ():
            prompt = prompt or choice.get("prompt_token_ids")
            ids += choice.get("token_ids") or []
            entries = choice.get("logprobs") or {}
            logprobs += [e["logprob"] for e in entries.get("content") or []] if chat else entries.get("token_logprobs") or []
        chunk = json.loads(line[6:])
        prompt = prompt or chunk.get("prompt_token_ids")
    return {"prompt": prompt, "ids": ids, "logprobs": logprobs}


@pytest.fixture(scope="module")
def relay(vllm_engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vllm_engine.model_dir))
    relay = Relay(vllm_engine.base_url, tokenizer.encode("<|im_start|>assistant", add_special_tokens=False))
    run_sync(relay.start(), timeout=30)
    yield relay
    run_sync(relay.runner.cleanup(), timeout=30)


def rollout(relay, vllm_engine, tmp_path, token_in: bool, index: int):
    config = PiConfig(
        endpoint={"name": relay.base_url, "model": vllm_engine.model},
        mode={"name": "transparent_proxy", "return_token_ids": True, "token_in": token_in, "renderer": "auto", "tokenizer": str(vllm_engine.model_dir), "top_logprobs": 1, "sampling": {"temperature": 0.0, "seed": 1000 + index}, "trace_dir": str(tmp_path / ("token-in" if token_in else "plain"))},
        gateway={"max_turns": FORCED_CALLS + 1, "max_tokens": 96},
        agent={"context_window": 8192},
    )
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]
    task = PiTask(task_id=f"token-in-{index}", instruction=f"Task {index}: look around the work dir with bash, "
                  f"then say in one sentence what notes.txt is about ({words[index % 10]}).",
                  files={"notes.txt": f"{words[index % 10]}\n{index}\n"}, verify=["true"],
                  timeouts={"agent_s": 1800})
    session = PiSessionFactory(config).create(task)
    try:
        return session.wait_for_completion()
    finally:
        try:
            session.close()
        except Exception as error:  # noqa: BLE001 - a teardown failure is not this test's subject
            NOTES.append(f"token-in tier: closing rollout {index} ({'token-in' if token_in else 'plain'}) failed: "
                         f"{type(error).__name__}: {error}")


def transitions(result) -> list[bool]:
    return [t.extends_previous for t in result.training.turns[1:]]


@pytest.mark.timeout(4 * 3600)
def test_token_in_rollouts_are_one_exact_sequence_and_plain_ones_break(relay, vllm_engine, tmp_path):
    jobs = [(token_in, index) for index in range(ROLLOUTS) for token_in in (True, False)
            if token_in or index < PLAIN_ROLLOUTS]
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        done = list(pool.map(lambda job: rollout(relay, vllm_engine, tmp_path, *job), jobs))
    token_in = [result for (mode, _), result in zip(jobs, done) if mode]
    plain = [result for (mode, _), result in zip(jobs, done) if not mode]

    diffs, forced, turns_checked = [], [], 0
    for result in token_in:
        assert result.error_kind is None, result.error
        calls = [t for t in result.proxy_turns if t.message and t.message.get("tool_calls")]
        assert len(calls) >= FORCED_CALLS, [t.message for t in result.proxy_turns]
        assert all(transitions(result)) and result.training.append_only
        for turn in result.proxy_turns:
            engine = relay.seen[("completions", tuple(turn.prompt_token_ids))]
            assert turn.token_in["engine_prompt_token_ids_match"] is True
            assert turn.prompt_token_ids == engine["prompt"]
            assert turn.completion_token_ids == engine["ids"] and turn.per_token_logps == engine["logprobs"]
            turns_checked += 1
        # transformers scores the whole merged sequence once; each turn's completion sits right
        # after its prompt in it. vLLM applies the forcing grammar's mask to the logits before it
        # computes logprobs, so only the free answers are comparable to unconstrained scoring;
        # the forced ones are reported, not asserted.
        segment = result.training.segments[0]
        start = segment.loss_mask.index(1)
        scored = score_with_transformers(vllm_engine.model_dir, segment.token_ids[:start], segment.token_ids[start:])
        for index, turn in enumerate(result.proxy_turns):
            at = len(turn.prompt_token_ids) - start
            for k, captured in enumerate(turn.per_token_logps):
                (forced if index < FORCED_CALLS else diffs).append(abs(scored[at + k] - captured))
    token_in_rate = sum(sum(transitions(r)) for r in token_in) / sum(len(transitions(r)) for r in token_in)
    plain_transitions = [x for r in plain if r.training for x in transitions(r)]
    plain_rate = sum(plain_transitions) / len(plain_transitions)
    plain_calls = sum(1 for r in plain for t in r.proxy_turns if t.message and t.message.get("tool_calls"))
    NOTES.append(f"token-in: {len(token_in)} real Pi rollouts, {turns_checked} turns, "
                 f"{sum(len(transitions(r)) for r in token_in)} transitions, extend rate {token_in_rate:.0%}; "
                 f"prompt ids == engine's echo and completion ids/logprobs == engine's on every turn")
    NOTES.append(f"token-in: transformers on the merged sequences vs captured logprobs over {len(diffs)} freely "
                 f"sampled tokens: max abs diff {max(diffs):.2e}, mean {statistics.fmean(diffs):.2e}; over the "
                 f"{len(forced)} grammar-forced tokens (vLLM's logprobs are the constrained ones): max "
                 f"{max(forced):.2e}, mean {statistics.fmean(forced):.2e}")
    NOTES.append(f"plain capture, same {len(plain)} rollouts (same forcing, seeds): {len(plain_transitions)} "
                 f"transitions, extend rate {plain_rate:.0%} ({plain_calls} tool-calling turns); "
                 f"errors {[r.error_kind for r in plain if r.error_kind]}")
    assert token_in_rate == 1.0 and max(diffs) < 1e-3
