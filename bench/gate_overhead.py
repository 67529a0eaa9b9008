"""What interception_gate adds between the agent and the trainer, both ways.

  request -> trainer: from the agent sending a chat/completions call to the trainer's
                      `next_request()` returning it (the gateway reads, decodes and queues it);
  deliver -> agent:   from the trainer calling `deliver()` to the agent holding the first byte of
                      the answer (validation, the SSE answer, the write, the agent's read).

The agents run in a child process (like Pi, they are not in the trainer's process), one per
session, over the gateway's Unix socket (the path sandboxes use), each making calls one after
another. The trainer is this process: one thread per session on the sync API, as a simple
trainer would. Both sides stamp CLOCK_MONOTONIC, which is shared by processes on one machine.
Each request is a Pi-sized body (a long system prompt, Pi's seven tools, a growing history);
each answer a bash tool call with 200 token ids and logprobs.

Two paces: "saturated" (the trainer delivers at once, every agent calls again at once: on 2
CPUs, 32 sessions then measure queueing for the CPU as much as the gate) and "paced" (the
trainer takes --generate-ms per turn, as an engine would, so sessions are not all active at
once). Prints a table, then ONE JSON line.

    .venv/bin/python bench/gate_overhead.py [--calls 300] [--sessions 1 32] [--generate-ms 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from common import BoundedTurns

WARMUP = 3  # calls per session left out of the figures


def agent_body(session: int, seq: int) -> dict:
    """A request the size of Pi's: ~8 KB system prompt, 7 tools, history growing per call."""
    tools = [{"type": "function", "function": {
        "name": name, "description": f"The {name} tool. " + "Explains its parameters at length. " * 12,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "command": {"type": "string"}}},
    }} for name in ("read", "bash", "edit", "write", "grep", "find", "ls")]  # fmt: skip
    history = [{"role": "system", "content": "You are an expert coding assistant. " * 230},
               {"role": "user", "content": f"Session {session}: fix the failing test."}]
    for k in range(seq % 20):
        history += [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"call_{k}", "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": f"ls -la dir{k}"})}}]},
                    {"role": "tool", "tool_call_id": f"call_{k}", "content": "file.py\n" * 40}]  # fmt: skip
    return {"model": "trainer-model", "messages": history, "tools": tools, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 4096, "temperature": 0.7}


def run_agents(socket_path: str, tokens: list[str], calls: int) -> None:
    """Child process: each session's agent calls `calls` times in turn; prints one JSON line."""
    import aiohttp

    async def agent(client, index: int, token: str, out: list) -> None:
        for seq in range(calls):
            prefix = json.dumps(agent_body(index, seq))[:-1]
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            sent_ns = time.monotonic_ns()  # the stamp rides in the body, added after serialising it
            data = f'{prefix}, "pi_env_bench": {{"session": {index}, "seq": {seq}, "sent_ns": {sent_ns}}}}}'.encode()
            async with client.post("http://gateway/v1/chat/completions", data=data, headers=headers) as response:
                first = await response.content.readany()
                first_ns = time.monotonic_ns()
                rest = await response.read()
            if response.status != 200 or not (first + rest).endswith(b"data: [DONE]\n\n"):
                raise RuntimeError(f"bad answer: {response.status} {(first + rest)[-200:]!r}")
            out.append((index, seq, first_ns))

    async def main() -> list:
        out: list = []
        connector = aiohttp.UnixConnector(path=socket_path, limit=0)
        async with aiohttp.ClientSession(connector=connector) as client:
            await asyncio.gather(*(agent(client, i, token, out) for i, token in enumerate(tokens)))
        return out

    print(json.dumps(asyncio.run(main())), flush=True)


def completion():
    from pi_env.proxy.gate import GateCompletion

    return GateCompletion(token_ids=list(range(1000, 1200)), logprobs=[-0.5] * 200, prompt_token_ids=list(range(3000)),
                          message={"content": "Running the tests first.",
                                   "tool_calls": [{"name": "bash", "arguments": {"command": "pytest -q -x"}}]})


def measure(sessions: int, calls_per_session: int, generate_ms: float = 0.0) -> dict:
    """One level: `sessions` agents and trainer threads, `calls_per_session` calls each; the
    trainer spends `generate_ms` on each turn before delivering."""
    from pi_env.proxy import Upstream, get_gateway

    gateway = get_gateway()
    opened = [gateway.open_session(Upstream("http://interception-gate.invalid/v1", None, "trainer-model"),
                                   mode="interception_gate") for _ in range(sessions)]
    for session in opened:
        session.turns = BoundedTurns()
    seen: dict[tuple[int, int], tuple[int, int]] = {}  # (session, seq) -> (request -> trainer ns, deliver ns)
    answer = completion()
    errors: list[BaseException] = []

    def trainer(index: int) -> None:
        gate = opened[index].strategy
        try:
            for _ in range(calls_per_session):
                request = gate.next_request(60)
                seen_ns = time.monotonic_ns()
                stamp = request.body["pi_env_bench"]
                if generate_ms:
                    time.sleep(generate_ms / 1e3)
                deliver_ns = time.monotonic_ns()
                gate.deliver(request, answer)
                seen[(stamp["session"], stamp["seq"])] = (seen_ns - stamp["sent_ns"], deliver_ns)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=trainer, args=(i,), daemon=True) for i in range(sessions)]
    for thread in threads:
        thread.start()
    child = subprocess.run([sys.executable, __file__, "--run-agents", gateway.socket_path, str(calls_per_session)],
                           input=json.dumps([s.token for s in opened]), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    for thread in threads:
        thread.join(30)
    for session in opened:
        gateway.close_session(session)
    if child.returncode != 0 or errors:
        raise RuntimeError(f"agents exited {child.returncode}: {child.stderr[-2000:]} {errors[:1]}")
    to_trainer, to_agent = [], []
    for index, seq, first_ns in json.loads(child.stdout.splitlines()[-1]):
        if seq < WARMUP:
            continue
        request_ns, deliver_ns = seen[(index, seq)]
        to_trainer.append(request_ns / 1e6)
        to_agent.append((first_ns - deliver_ns) / 1e6)
    return {"sessions": sessions, "generate_ms": generate_ms, "calls": len(to_trainer),
            "request_to_trainer_ms": summary(to_trainer), "deliver_to_first_byte_ms": summary(to_agent)}


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3),
            "p99": round(statistics.quantiles(values, n=100)[-1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="measured calls per level (spread over sessions)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--generate-ms", type=float, default=100.0, help="the paced trainer's time per turn")
    parser.add_argument("--run-agents", nargs=2, help=argparse.SUPPRESS)  # socket, calls; tokens on stdin
    args = parser.parse_args()
    if args.run_agents:
        socket_path, calls = args.run_agents
        return run_agents(socket_path, json.loads(sys.stdin.read()), int(calls))

    load_before = os.getloadavg()
    levels = [measure(n, WARMUP + max(1, -(-args.calls // n)), pace) for pace in (0.0, args.generate_ms)
              for n in args.sessions]
    print(f"interception_gate overhead, {os.cpu_count()} CPUs (load average {load_before[0]:.1f} before); agents in "
          "a child process over the Unix socket, the trainer on threads here")  # fmt: skip
    print(f"{'sessions':>8} {'generate':>9} {'calls':>6} {'request->trainer median/p99 ms':>32} "
          f"{'deliver->first byte median/p99 ms':>35}")  # fmt: skip
    for level in levels:
        a, b = level["request_to_trainer_ms"], level["deliver_to_first_byte_ms"]
        print(f"{level['sessions']:>8} {level['generate_ms']:>7g}ms {level['calls']:>6} {a['median']:>20.3f} / "
              f"{a['p99']:>8.3f} {b['median']:>23.3f} / {b['p99']:>8.3f}")  # fmt: skip
    print(json.dumps({"bench": "gate_overhead", "cpus": os.cpu_count(), "levels": levels,
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))


if __name__ == "__main__":
    main()
