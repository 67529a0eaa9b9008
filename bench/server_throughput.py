"""Rollouts per minute through the server (MCP, `PiEnv`) vs the same rollouts in-process.

One run, same machine, same concurrency: `pi-env serve` (web off, MAX_CONCURRENT_ENVS =
concurrency) in a subprocess on 127.0.0.1, driven by PiEnv over MCP streamable HTTP; and
`PiSessionFactory` rollouts in this process on that many threads. The bundled examples
(oracle endpoint) round-robin. Rounds alternate in-process / MCP so drift on a shared machine
hits both. Then the fixed cost of one MCP call: connect, initialize and a `run_rollout` the server
refuses at once (an empty instruction), `--fixed-calls` times. Prints per-round numbers and ends
with ONE JSON line (with the load average). Target: ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pi_env import PiSessionFactory, load_tasks
from pi_env.server.client import PiEnv, PiEnvError

ROOT = Path(__file__).resolve().parent.parent
TASKS = load_tasks(ROOT / "examples")


def start_server(concurrency: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MAX_CONCURRENT_ENVS": str(concurrency), "ENABLE_WEB_INTERFACE": "false"}
    process = subprocess.Popen([sys.executable, "-m", "pi_env.cli", "serve", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("the server did not start")


def in_process(rollouts: int, concurrency: int) -> tuple[float, list]:
    factory = PiSessionFactory()

    def one(index: int):
        with factory.create(TASKS[index % len(TASKS)]) as session:
            return session.wait_for_completion()

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(rollouts)))
    return time.perf_counter() - started, results


def through_mcp(url: str, rollouts: int, concurrency: int) -> tuple[float, list]:
    env = PiEnv(url, timeout_s=600)

    async def run():
        gate = asyncio.Semaphore(concurrency)  # the same concurrency as in-process (no queueing at the server)

        async def one(index: int):
            async with gate:
                return await env.arun_rollout(TASKS[index % len(TASKS)])

        return await asyncio.gather(*(one(i) for i in range(rollouts)))

    started = time.perf_counter()
    results = asyncio.run(run())
    return time.perf_counter() - started, results


def mcp_fixed_cost_ms(url: str, calls: int) -> list[float]:
    """Milliseconds per MCP call that does no rollout: connect, initialize, call, refusal."""
    env = PiEnv(url, timeout_s=60)
    times = []
    for _ in range(calls + 1):  # the first warms the client's imports and the server's routes
        started = time.perf_counter()
        try:
            env.run_rollout(instruction="")
        except PiEnvError as error:
            if "instruction" not in str(error):
                raise
        else:
            raise RuntimeError("the server ran a rollout with an empty instruction")
        times.append((time.perf_counter() - started) * 1000)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16, help="per round and path")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fixed-calls", type=int, default=20, help="MCP calls that run no rollout")
    args = parser.parse_args()

    load_before = os.getloadavg()
    process, url = start_server(args.concurrency)
    try:
        in_process(args.concurrency, args.concurrency)  # warm both paths (runtime check, imports)
        through_mcp(url, args.concurrency, args.concurrency)
        totals = {"in_process": 0.0, "mcp": 0.0}
        rewards = []
        for round_ in range(args.rounds):
            for name in ("in_process", "mcp") if round_ % 2 == 0 else ("mcp", "in_process"):
                seconds, results = in_process(args.rollouts, args.concurrency) if name == "in_process" \
                    else through_mcp(url, args.rollouts, args.concurrency)
                rewards += [r.reward for r in results]
                totals[name] += seconds
                print(f"round {round_} {name:<10} {args.rollouts} rollouts in {seconds:6.2f} s = "
                      f"{60 * args.rollouts / seconds:6.1f}/min", flush=True)
        fixed = mcp_fixed_cost_ms(url, args.fixed_calls)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    count = args.rollouts * args.rounds
    per_min = {name: 60 * count / seconds for name, seconds in totals.items()}
    ratio = per_min["mcp"] / per_min["in_process"]
    failed = sum(reward != 1.0 for reward in rewards)
    print(json.dumps({"bench": "server_throughput", "concurrency": args.concurrency, "rollouts_per_path": count,
                      "in_process_per_min": round(per_min["in_process"], 1), "mcp_per_min": round(per_min["mcp"], 1),
                      "ratio": round(ratio, 3), "target_ratio": 0.9, "met": ratio >= 0.9,
                      "rollouts_not_reward_1": failed, "mcp_fixed_cost_ms": {
                          "median": round(statistics.median(fixed), 1), "min": round(min(fixed), 1),
                          "max": round(max(fixed), 1), "calls": len(fixed)}, "loadavg": {"before": load_before, "after": os.getloadavg()}}))
    if failed:
        sys.exit(1)  # a figure made of failures is no figure


if __name__ == "__main__":
    main()
