"""Hostile model output through token-in and interception_gate: what each pathological answer
costs, and whether the gateway's /health still answers while one is processed.

Classes (model output as token ids, at each --sizes N tokens):
  tool_call_loop   `<tool_call>` repeated (a model stuck in a loop; the worst class)
  invalid_utf8     N lone 0xFF byte tokens (no UTF-8 text holds them)
  lt_then_gt       `<` then N-1 `>` (every `>` may close a tag)
  nested_json      one tool call whose arguments nest `[` about N deep
  plain            ordinary prose (the control)

Per class and size:
  parse_ms         chatml-hermes `parse_response` of the ids (the final parse), in this process
  gate_text_ms     interception_gate's validation + parse of a text delivery (what `deliver` does)
  upstream_ms      the answer streamed straight from the engine-like upstream to the agent
  turn_ms          the same answer through the gateway's token-in path (agent's wall time to [DONE])
  health_max_ms    the slowest /health answer polled every 10 ms during that turn (p50 beside it)
  recorded         the turn's record holds every id and logprob

The gateway runs here; the upstream (the scripted server's token engine) and the agent + /health
poller each run in a child process, so neither shares the gateway's GIL. Tokenizer: as in
token_in_overhead.py. Target: /health within 100 ms while the worst class is processed. Prints a
table, then ONE JSON line; exits non-zero when a turn failed or was not recorded whole.

    .venv/bin/python bench/token_in_hostile.py [--sizes 1024 2048 4096 8192] [--classes ...]
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

from token_in_overhead import tokenizer_dir

CLASSES = ("tool_call_loop", "invalid_utf8", "lt_then_gt", "nested_json", "plain")
HEALTH_TARGET_MS = 100.0
POLL_S = 0.01


def answer_ids(tokenizer, name: str, size: int) -> list[int]:
    """The class's answer: about `size` ids."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    if name == "tool_call_loop":
        unit = encode("<tool_call>")
        return (unit * (size // len(unit) + 1))[:size]
    if name == "invalid_utf8":
        return [tokenizer.convert_tokens_to_ids("ÿ")] * size  # byte-level BPE's token for the byte 0xFF
    if name == "lt_then_gt":
        return encode("<") + encode(">") * (size - 1)
    if name == "nested_json":
        head, tail = '<tool_call>\n{"name": "bash", "arguments": {"a": ', '}}\n</tool_call>'
        depth = max(1, size - len(encode(head + tail)))  # `[[` is one token: about size ids
        return encode(head + "[" * depth + "]" * depth + tail) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    if name == "plain":
        unit = encode("The handler answers 404 when the route is missing, so we add it. ")
        return (unit * (size // len(unit) + 1))[:size]
    raise ValueError(name)


def timed(work) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        work()
        outcome = "ok"
    except Exception as error:  # noqa: BLE001 - the outcome is part of the figures
        outcome = type(error).__name__
    return round((time.perf_counter() - started) * 1000, 2), outcome


def in_process(renderer, tokenizer, ids: list[int]) -> dict:
    from pi_env.proxy.gate import GateCompletion, build_capture

    text = tokenizer.decode(ids, skip_special_tokens=False)
    parse_ms, parse_outcome = timed(lambda: renderer.parse_response(ids))
    completion = GateCompletion(token_ids=ids, logprobs=[-0.5] * len(ids), text=text, prompt_token_ids=[1, 2])
    gate_ms, gate_outcome = timed(lambda: build_capture({"model": "bench"}, completion))
    return {"parse_ms": parse_ms, "parse": parse_outcome, "gate_text_ms": gate_ms, "gate_text": gate_outcome}


# ------------------------------------------------------------------------------ the children


def serve(tok_dir: str) -> None:
    """Child: the engine-like upstream; scripts ({api key: ids}) on the first stdin line."""
    from transformers import AutoTokenizer

    from pi_env.scripted import ScriptedServer, ScriptedTurn
    from pi_env.scripted.token_engine import TokenEngine

    server = ScriptedServer(token_engine=TokenEngine(AutoTokenizer.from_pretrained(tok_dir)), record_requests=0)
    for key, ids in json.loads(sys.stdin.readline()).items():
        server.add_script([ScriptedTurn(token_ids=ids)], api_key=key)
    server.start()
    print(json.dumps({"upstream": server.base_url}), flush=True)
    sys.stdin.read()


def agent(gateway_url: str, upstream_url: str, timeout_s: float) -> None:
    """Child: for each job on stdin, the answer straight from the upstream, then through the
    gateway with /health polled meanwhile; one JSON line of results."""
    import aiohttp

    jobs = json.loads(sys.stdin.read())
    health_url = gateway_url.rsplit("/v1", 1)[0] + "/health"

    async def read_stream(client, url, body, key) -> tuple[float, bytes, int]:
        started = time.perf_counter()
        async with client.post(url, json=body, headers={"Authorization": f"Bearer {key}"},
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
            raw = await answer.read()
            return (time.perf_counter() - started) * 1000, raw, answer.status

    async def poll(client, latencies: list, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            async with client.get(health_url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
                await answer.read()
            latencies.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(POLL_S)

    async def one(job) -> dict:
        engine_body = {"model": "bench", "prompt": [1, 2, 3], "stream": True, "return_token_ids": True,
                       "logprobs": 1, "stream_options": {"include_usage": True}}
        chat = {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "Go."}]}
        async with aiohttp.ClientSession() as direct:
            upstream_ms, _, _ = await read_stream(direct, upstream_url + "/completions", engine_body, job["key"])
        latencies: list[float] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as health, aiohttp.ClientSession() as client:
            poller = asyncio.ensure_future(poll(health, latencies, stop))
            await asyncio.sleep(3 * POLL_S)
            started = time.perf_counter()
            try:
                turn_ms, raw, status = await read_stream(client, gateway_url + "/chat/completions", chat, job["token"])
                error = None
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # a broken answer is a figure too
                turn_ms, raw, status, error = (time.perf_counter() - started) * 1000, b"", 0, type(exc).__name__
            stop.set()
            await poller
        chunks = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        return {"upstream_ms": round(upstream_ms, 1), "turn_ms": round(turn_ms, 1), "status": status, "error": error,
                "health_max_ms": round(max(latencies), 1), "health_p50_ms": round(statistics.median(latencies), 1),
                "health_polls": len(latencies),
                "agent_text_chars": sum(len(d.get("content") or "") for d in deltas),
                "agent_tool_calls": sum(len(d.get("tool_calls") or []) for d in deltas)}

    async def main() -> list:
        return [await one(job) for job in jobs]

    print(json.dumps(asyncio.run(main())), flush=True)


# --------------------------------------------------------------------------------- the bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    parser.add_argument("--turn-timeout-s", type=float, default=300.0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pi_env.proxy import Upstream, get_gateway
    from pi_env.proxy.rewrite import CaptureOptions
    from pi_env.proxy.token_in import load_renderer

    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tok_dir, tok_name = tokenizer_dir(scratch)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        spec = load_renderer("chatml-hermes", tok_dir)
        jobs = [(name, size, answer_ids(tokenizer, name, size)) for name in args.classes for size in args.sizes]
        for name, size, ids in jobs:
            rows.append({"class": name, "size": size, "tokens": len(ids),
                         **in_process(spec.renderer, tokenizer, ids)})
        keys = {f"sk-hostile-{k}": ids for k, (_, _, ids) in enumerate(jobs)}
        upstream = subprocess.Popen([sys.executable, __file__, "--serve-child", tok_dir], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        try:
            upstream.stdin.write(json.dumps(keys) + "\n")
            upstream.stdin.flush()
            info = json.loads(upstream.stdout.readline())
            gateway = get_gateway()
            sessions = [gateway.open_session(Upstream(info["upstream"], key, "bench"), mode="transparent_proxy",
                                             capture=CaptureOptions(model="bench", top_logprobs=1),
                                             token_in=spec)
                        for key in keys]
            child = subprocess.run(
                [sys.executable, __file__, "--agent-child", gateway.tcp_base_url, info["upstream"],
                 str(args.turn_timeout_s)],
                input=json.dumps([{"key": key, "token": s.token} for key, s in zip(keys, sessions)]),
                capture_output=True, text=True, timeout=len(jobs) * (args.turn_timeout_s + 30) + 60)
            if child.returncode != 0:
                raise RuntimeError(f"agent child exited {child.returncode}: {child.stderr[-3000:]}")
            for row, session, measured in zip(rows, sessions, json.loads(child.stdout.splitlines()[-1])):
                session.wait_idle(args.turn_timeout_s)
                capture = session.turns[0].capture if session.turns else None
                choice = capture.choices[0] if capture is not None and capture.choices else None
                row.update(measured)
                row["recorded"] = bool(choice and len(choice.token_ids) == row["tokens"]
                                       and None not in choice.logprobs and len(choice.logprobs) == row["tokens"])
                gateway.close_session(session)
        finally:
            upstream.stdin.close()
            upstream.wait(timeout=30)
    worst = [r for r in rows if r["class"] == "tool_call_loop"]
    print(f"token-in under hostile output, {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before "
          f"(tokenizer: {tok_name})")
    print(f"{'class':>15} {'tokens':>6} {'parse ms':>9} {'gate text ms':>13} {'upstream ms':>12} {'turn ms':>9} "
          f"{'health max/p50 ms':>18} {'recorded':>9} {'agent text':>11}")
    for r in rows:
        parse = f"{r['parse_ms']:.1f}" if r["parse"] == "ok" else r["parse"][:9]
        gate = f"{r['gate_text_ms']:.1f}" if r["gate_text"] == "ok" else r["gate_text"][:13]
        print(f"{r['class']:>15} {r['tokens']:>6} {parse:>9} {gate:>13} {r['upstream_ms']:>12.1f} "
              f"{r['turn_ms']:>9.1f} {r['health_max_ms']:>9.1f} / {r['health_p50_ms']:<6.1f} {str(r['recorded']):>9} "
              f"{r['agent_text_chars']:>11}" + (f"  agent got {r['error']}" if r["error"] else ""))
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f}")
    print(json.dumps({
        "bench": "token_in_hostile", "tokenizer": tok_name, "rows": rows,
        "health_target_ms": HEALTH_TARGET_MS,
        "worst_health_max_ms": max((r["health_max_ms"] for r in worst), default=None),
        "worst_within_target": all(r["health_max_ms"] <= HEALTH_TARGET_MS for r in worst),
        "loadavg": {"before": load_before, "after": load_after},
    }))
    failed = [f"{r['class']} {r['size']}" for r in rows if r["status"] != 200 or r["error"] or not r["recorded"]
              or r["parse"] != "ok" or r["gate_text"] != "ok"]
    if failed:  # a figure made of failures is no figure
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-child":
        serve(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "--agent-child":
        agent(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        main()
