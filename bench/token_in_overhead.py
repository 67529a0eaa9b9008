"""What token-in adds per turn: the gateway's own render + parse work at 30k tokens, and the
streamed time to first byte through the token-in path vs the plain capture path.

The gateway runs here, the upstream in a child process (they do not share a GIL).

1. Render + parse: a Pi-shaped conversation (system prompt, tools, tool calls and results) grown
   to about --tokens tokens; per turn, what the gateway does on top of relaying: check the
   agent's history against the previous call, bridge the new tool result onto the previous
   prompt + completion ids, and parse the completion ids into the agent's message. Median over
   --turns turns, beside one full render of the same conversation (what a re-rendering engine
   tokenises every turn; the ratio holds on a loaded machine where the absolute times do not).
2. TTFB: the scripted server's token engine (an engine-like upstream with a real tokenizer);
   sessions of two calls (the second is the bridged one) go
   through transparent_proxy with and without token-in, alternating; time to the first body
   byte of the second call, median.

Tokenizer: the engine tier's SmolLM2 ($PI_ENV_ENGINES_DIR/models/smollm2-135m-instruct) when it is
installed, else a byte-level BPE trained here (pi_env.testing.tiny_tokenizer). Prints ONE JSON
line. Target: <= 5 ms added per turn at 30k tokens.

    .venv/bin/python bench/token_in_overhead.py [--tokens 30000] [--turns 20] [--sessions 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pi_env.proxy import get_gateway

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "scripts/engines/chatml_tools.jinja"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a bash command in the work dir.",
                                           "parameters": {"type": "object", "properties": {
                                               "command": {"type": "string"}, "timeout": {"type": "number"}},
                                               "required": ["command"]}}},
         {"type": "function", "function": {"name": "read", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}}, "required": ["path"]}}}]


def tokenizer_dir(scratch: str) -> tuple[str, str]:
    engines = Path(os.environ.get("PI_ENV_ENGINES_DIR") or ROOT / ".engines")
    smol = engines / "models" / "smollm2-135m-instruct"
    if (smol / "tokenizer.json").exists():
        return str(smol), "SmolLM2-135M-Instruct"
    from pi_env.testing.tiny_tokenizer import make_tokenizer_dir

    corpus = [TEMPLATE.read_text()] + [p.read_text() for p in sorted((ROOT / "src/pi_env").rglob("*.py"))]
    return str(make_tokenizer_dir(Path(scratch) / "tok", corpus, chat_template=TEMPLATE.read_text())), "tiny BPE"


def tool_output(step: int) -> str:
    return "\n".join(f"src/module_{step}_{k}.py: def handler_{k}(request): return respond(request, code={k})"
                     for k in range(40))


def render_parse(tok_dir: str, target_tokens: int, turns: int) -> dict:
    from pi_env.proxy.token_in import TokenLedger, load_renderer
    from pi_env.scripted.script import ScriptedToolCall, ScriptedTurn
    from pi_env.scripted.token_engine import TokenEngine

    spec = load_renderer("chatml-hermes", tok_dir)
    ledger, engine = TokenLedger(spec), TokenEngine(spec.renderer._tokenizer)
    messages = [{"role": "system", "content": "You are an expert coding assistant. " * 40},
                {"role": "user", "content": "Find the handler that answers 404 and fix it."}]
    plan = ledger.plan(messages, TOOLS)
    step = 0

    def next_turn(plan, messages):
        turn = ScriptedTurn(text="Let me look.", tool_calls=[ScriptedToolCall(name="bash", arguments={
            "command": f"grep -rn handler_{step} src | head -40"})])
        completion = engine.answer_ids(turn)
        started, cpu_started = time.perf_counter(), time.process_time()
        answer = ledger.parse(completion, plan.token_ids, TOOLS).message
        ledger.remember(plan, completion, answer)
        messages = [*messages, answer, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"],
                                        "content": tool_output(step)}]
        plan = ledger.plan(messages, TOOLS)
        elapsed_ms = (time.perf_counter() - started) * 1000, (time.process_time() - cpu_started) * 1000
        assert plan.outcome == "bridged", plan.reason
        return plan, messages, elapsed_ms

    while len(plan.token_ids) < target_tokens:  # grow the conversation to the target size
        plan, messages, _ = next_turn(plan, messages)
        step += 1
    per_turn = []
    for _ in range(turns):  # then time the next turn from that same state, again and again
        per_turn.append(next_turn(plan, messages)[2])
    size = len(plan.token_ids)
    # The reference on the same machine at the same moment: one full render of the conversation,
    # which is what a re-rendering engine (the plain path) tokenises on every turn.
    full = []
    for _ in range(3):
        started = time.perf_counter()
        spec.renderer.render_ids(messages, tools=TOOLS, add_generation_prompt=True)
        full.append((time.perf_counter() - started) * 1000)
    turn_ms = statistics.median(wall for wall, _ in per_turn)
    return {"prompt_tokens": size, "turn_ms_median": round(turn_ms, 3),
            "turn_ms_max": round(max(wall for wall, _ in per_turn), 3),
            # CPU time: the work itself, which a loaded machine does not inflate as it does wall time
            "turn_cpu_ms_median": round(statistics.median(cpu for _, cpu in per_turn), 3),
            "full_render_ms_median": round(statistics.median(full), 3),
            "turn_vs_full_render": round(turn_ms / statistics.median(full), 3)}


def serve(tok_dir: str) -> None:
    """Child process: the engine-like upstream (a scripted server with a token engine)."""
    from transformers import AutoTokenizer

    from pi_env.scripted import ScriptedServer, ScriptedToolCall, ScriptedTurn
    from pi_env.scripted.token_engine import TokenEngine

    server = ScriptedServer(token_engine=TokenEngine(AutoTokenizer.from_pretrained(tok_dir))).start()
    script = [ScriptedTurn(text="Let me look.", tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})]),
              ScriptedTurn(text="The handler is in src/app.py; " * 20)]
    key = server.add_script(script)
    print(json.dumps({"upstream": server.base_url, "key": key}), flush=True)
    sys.stdin.read()


def open_sessions(info: dict, tok_dir: str, count: int) -> dict[bool, list]:
    from pi_env.proxy import Upstream, get_gateway
    from pi_env.proxy.rewrite import CaptureOptions
    from pi_env.proxy.token_in import load_renderer

    spec = load_renderer("chatml-hermes", tok_dir)
    gateway = get_gateway()
    sessions = {}
    for token_in in (False, True):
        sessions[token_in] = [gateway.open_session(
            Upstream(info["upstream"], info["key"], "bench"), mode="transparent_proxy",
            capture=CaptureOptions(model="bench", return_token_ids=True, top_logprobs=1),
            token_in=spec if token_in else None) for _ in range(count)]
    return sessions


async def two_calls(base_url: str, token: str) -> float:
    """Two calls of one session; the second's time to first body byte, in ms."""
    messages = [{"role": "system", "content": "You are an expert coding assistant."},
                {"role": "user", "content": "Find the handler."}]
    body = {"model": "bench", "stream": True, "stream_options": {"include_usage": True}, "messages": messages,
            "tools": TOOLS}
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as client:
        async with client.post(base_url + "/chat/completions", json=body, headers=headers) as answer:
            raw = await answer.read()
        chunks = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]
        call = next(c for chunk in chunks if chunk["choices"] for c in chunk["choices"][0]["delta"].get("tool_calls") or [])
        history = [*messages, {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "src/app.py\nsrc/util.py"}]
        started = time.perf_counter()
        async with client.post(base_url + "/chat/completions", json={**body, "messages": history},
                               headers=headers) as answer:
            await answer.content.readany()
            ttfb = (time.perf_counter() - started) * 1000
            await answer.read()
    return ttfb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=20)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        tok_dir, tok_name = tokenizer_dir(scratch)
        costs = render_parse(tok_dir, args.tokens, args.turns)
        child = subprocess.Popen([sys.executable, __file__, "--serve-child", tok_dir], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            info = json.loads(child.stdout.readline())
            sessions = open_sessions(info, tok_dir, args.sessions)
            ttfb = {False: [], True: []}
            for k in range(args.sessions):
                for token_in in (False, True):  # alternate to even out drift
                    session = sessions[token_in][k]
                    ttfb[token_in].append(asyncio.run(two_calls(get_gateway().tcp_base_url, session.token)))
                    assert session.wait_idle(300), "a record did not finish"
            outcomes = [t.capture.token_in["outcome"] for s in sessions[True] for t in s.turns]
            assert outcomes.count("bridged") == args.sessions, outcomes
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    plain_ms, token_in_ms = statistics.median(ttfb[False]), statistics.median(ttfb[True])
    print(json.dumps({
        "bench": "token_in_overhead", "tokenizer": tok_name, **costs,
        "target_turn_ms": 5.0, "turn_within_target": costs["turn_ms_median"] <= 5.0,
        "turn_cpu_within_target": costs["turn_cpu_ms_median"] <= 5.0,
        "ttfb_ms_plain_median": round(plain_ms, 3), "ttfb_ms_token_in_median": round(token_in_ms, 3),
        "ttfb_added_ms": round(token_in_ms - plain_ms, 3), "ttfb_ratio": round(token_in_ms / plain_ms, 3),
        "sessions": args.sessions, "loadavg": {"before": load_before, "after": os.getloadavg()},
    }))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-child":
        serve(sys.argv[2])
    else:
        main()
