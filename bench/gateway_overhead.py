"""What the gateway adds to a streamed model call: direct vs through the gateway, side by side.

N streamed answers of T synthetic tokens (one SSE chunk per token, written one by one like an
engine does) from the scripted server, fetched directly and through the gateway's TCP
listener, at each concurrency. The scripted server and the gateway run in their own processes
so the client, the gateway and the "engine" do not share a GIL. Direct and gateway rounds
alternate to even out drift on a busy machine. Prints a table, then ONE JSON line.

    .venv/bin/python bench/gateway_overhead.py [--n 200] [--tokens 1000] [--concurrency 1 16]
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

import aiohttp

ROUNDS = 4  # direct/gateway alternations per concurrency level


def serve_gateway(upstream_url: str, api_key: str) -> None:
    """Child process: run a gateway with one session; print its URL and token; exit on EOF."""
    from pi_env.proxy import Upstream, get_gateway

    gateway = get_gateway()
    session = gateway.open_session(Upstream(upstream_url, api_key))
    print(json.dumps({"base_url": gateway.tcp_base_url, "token": session.token}), flush=True)
    sys.stdin.read()


def spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    """Start a child python process and return it with its first stdout line."""
    proc = subprocess.Popen(
        [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc, proc.stdout.readline().strip()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_call(client: aiohttp.ClientSession, url: str, key: str, body: bytes):
    """(total seconds, seconds to first body byte, bytes) of one streamed answer."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    start = time.perf_counter()
    async with client.post(url, data=body, headers=headers) as response:
        response.raise_for_status()
        first = await response.content.readany()
        ttfb = time.perf_counter() - start
        size, tail = len(first), first
        while chunk := await response.content.readany():
            size += len(chunk)
            tail = chunk
    if not tail.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError("stream did not end with data: [DONE]")
    return time.perf_counter() - start, ttfb, size


async def run_phase(
    base_url: str, key: str, n: int, concurrency: int, body: bytes, cpu_pid: int | None = None
) -> dict:
    """n calls over `concurrency` connections, after one warm-up call per connection; with
    cpu_pid, also the CPU seconds that process spent during the timed calls."""
    url = base_url + "/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as client:
        for _ in range(concurrency):  # warm the connection pools
            await one_call(client, url, key, body)
        results = []
        queue = iter(range(n))

        async def worker():
            for _ in queue:
                results.append(await one_call(client, url, key, body))

        cpu_before = cpu_seconds(cpu_pid) if cpu_pid else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        cpu = cpu_seconds(cpu_pid) - cpu_before if cpu_pid else 0.0
    return {
        "totals": [r[0] for r in results],
        "ttfbs": [r[1] for r in results],
        "wall": wall,
        "cpu": cpu,
    }


def summarize(phases: list[dict], n_calls: int) -> dict:
    totals = [t for p in phases for t in p["totals"]]
    ttfbs = [t for p in phases for t in p["ttfbs"]]
    return {
        "median_ms": statistics.median(totals) * 1e3,
        "p90_ms": statistics.quantiles(totals, n=10)[-1] * 1e3,
        "ttfb_median_ms": statistics.median(ttfbs) * 1e3,
        "req_per_s": n_calls / sum(p["wall"] for p in phases),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="calls per path and concurrency")
    parser.add_argument("--tokens", type=int, default=1000, help="streamed tokens per answer")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--serve-gateway", nargs=2, metavar=("UPSTREAM_URL", "KEY"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.serve_gateway:
        return serve_gateway(*args.serve_gateway)

    # 4 characters per synthetic token and per chunk: one SSE event per token.
    script = {"scripts": {"bench-key": [{"text": "abcd" * args.tokens, "chunk_chars": 4}]}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(script, f)
    server, line = spawn(["-m", "pi_env.testing.scripted", "--port", "0", "--script", f.name])
    direct_url = line.rsplit(" ", 1)[1]
    gateway, line = spawn([__file__, "--serve-gateway", direct_url, "bench-key"])
    gateway_info = json.loads(line)
    body = json.dumps({
        "model": "bench", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Write a thousand tokens."}],
    }).encode()  # fmt: skip

    report = {"n": args.n, "tokens": args.tokens, "cpus": os.cpu_count(), "levels": []}
    try:
        for c in args.concurrency:
            per_round = max(args.n // ROUNDS, c)
            direct, through = [], []
            for _ in range(ROUNDS):
                direct.append(asyncio.run(run_phase(direct_url, "bench-key", per_round, c, body)))
                through.append(asyncio.run(run_phase(
                    gateway_info["base_url"], gateway_info["token"], per_round, c, body, gateway.pid)))  # fmt: skip
            calls = per_round * ROUNDS
            gateway_cpu = sum(p["cpu"] for p in through)
            d, g = summarize(direct, calls), summarize(through, calls)
            report["levels"].append({
                "concurrency": c,
                "direct": d,
                "gateway": g,
                "added_median_ms": g["median_ms"] - d["median_ms"],
                "added_ttfb_ms": g["ttfb_median_ms"] - d["ttfb_median_ms"],
                "throughput_ratio": g["req_per_s"] / d["req_per_s"],
                "gateway_cpu_ms_per_call": gateway_cpu / calls * 1e3,
                "gateway_cpu_us_per_token": gateway_cpu / calls / args.tokens * 1e6,
            })  # fmt: skip
    finally:
        gateway.stdin.close()  # it exits on EOF, removing its socket directory
        gateway.wait(10)
        server.terminate()
        server.wait(10)
        os.unlink(f.name)

    print(f"{args.n} streamed answers of {args.tokens} tokens per path and level, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    header = f"{'c':>3} {'path':8} {'median ms':>10} {'p90 ms':>8} {'ttfb ms':>8} {'req/s':>8}"
    print(header)
    for level in report["levels"]:
        for path in ("direct", "gateway"):
            s = level[path]
            print(f"{level['concurrency']:>3} {path:8} {s['median_ms']:>10.2f} {s['p90_ms']:>8.2f} "
                  f"{s['ttfb_median_ms']:>8.2f} {s['req_per_s']:>8.1f}")  # fmt: skip
        print(f"    gateway adds {level['added_median_ms']:+.2f} ms median, "
              f"{level['added_ttfb_ms']:+.2f} ms ttfb; throughput x{level['throughput_ratio']:.2f}; "
              f"gateway CPU {level['gateway_cpu_ms_per_call']:.2f} ms/call "
              f"({level['gateway_cpu_us_per_token']:.2f} us/token)")  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
