"""What the gateway adds to a streamed model call, per mode: direct vs through the gateway.

N streamed answers of T synthetic tokens (one SSE chunk per token, written one by one like an
engine does) from the scripted server, fetched directly and through the gateway's TCP
listener, at each concurrency, for black_box (relay only) and transparent_proxy (request
rewriting + capture of ids, logprobs and top-5 logprobs). The direct fetch sends the same
(rewritten) request, so both paths move the same bytes. The scripted server and the gateway
run in their own processes so the client, the gateway and the "engine" do not share a GIL.
Direct and gateway rounds alternate to even out drift on a busy machine.

Capture finishes a turn's record after the agent has its last byte (large answers are parsed
in a capture worker process), so a gateway round ends only once the gateway is idle
(`wait_idle()`): its wall clock, and so its throughput, includes that work, and none of it
spills into the next direct round. Two latencies: agent-visible (the client's last byte) and
record-complete (the gateway's handler start until the turn is recorded). CPU per token: the
gateway's process (its event loop: one core) and, apart, its capture workers (a pool of k
processes; `--capture-workers 1 2` runs one gateway per k). Prints a table, then ONE JSON line
(with the load average and whether each mode met TARGETS).

    .venv/bin/python bench/proxy_overhead.py [--n 200] [--tokens 1000] [--concurrency 1 32]
                                             [--capture-workers 1 2] [--engine-delay-ms 0]

The relay floor: the same calls through a no-op relay process (bytes in, bytes out, no HTTP;
`serve_relay`) in the same alternating rounds. No process put between client and engine can
do better than that on the machine; it separates what the machine costs from what the gateway
costs (`relay_floor_ratio` beside `throughput_ratio`). `--c-relay` adds the same relay written
in C (socat, TCP_NODELAY both ways; `c_relay_floor_ratio`): what no Python process beats.

Cores busy: the CPU seconds of the engine, the client, and (through it) the gateway and its
workers, or the relay, over the wall clock. Flat out, the scripted engine and its client alone
keep about two cores busy, so on a 2-core machine the gateway's CPU at 1 stream comes out of the
engine's own cores; `--engine-delay-ms` paces the engine (still far faster than a model decodes
one stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

import aiohttp
import msgspec
from common import BoundedTurns

ROUNDS = 4  # direct/gateway alternations per concurrency level


MODES = ("black_box", "transparent_proxy")
# Issue 27's targets, per mode: throughput through idle, gateway CPU per token (capture workers
# included), record complete over direct at concurrency 1 (median).
TARGETS = {"black_box": {"throughput_ratio_min": 0.95, "cpu_us_per_token_max": 5.0},
           "transparent_proxy": {"throughput_ratio_min": 0.9, "cpu_us_per_token_max": 10.0,
                                 "added_record_median_ms_max_at_c1": 20.0}}


def meets(level: dict) -> bool:
    target = TARGETS[level["mode"]]
    record_max = target.get("added_record_median_ms_max_at_c1")
    return (level["throughput_ratio"] >= target["throughput_ratio_min"]
            and level["gateway_cpu_us_per_token"] <= target["cpu_us_per_token_max"]
            and (record_max is None or level["concurrency"] != 1 or level["added_record_median_ms"] <= record_max))


def capture_options():
    from pi_env.proxy.rewrite import CaptureOptions

    return CaptureOptions(logprobs=True, top_logprobs=5, return_token_ids=True, model="bench")


def serve_gateway(upstream_url: str, api_key: str) -> None:
    """Child process: run a gateway with one session per mode; print its URL and the tokens.
    Then per stdin line `idle MODE`: wait until that session is idle and print the
    record-complete latencies (seconds) of the turns recorded since the last line. Exits on EOF.
    Capture records are kept in memory only by the session (no trace file)."""
    from pi_env.proxy import Upstream, get_gateway
    from pi_env.proxy.capture_worker import capture_pool
    from pi_env.proxy.policy import SessionLimits

    gateway = get_gateway()
    tokens, sessions, recorded = {}, {}, {mode: [] for mode in MODES}
    for mode in MODES:
        # One session carries every stream of a level (a session's default limit is far lower).
        session = gateway.open_session(Upstream(upstream_url, api_key, "bench"), mode=mode,
                                       capture=capture_options(),
                                       limits=SessionLimits(max_concurrent_calls=1024, max_request_bytes=64 << 20))
        session.turns = BoundedTurns()  # a long benchmark must not grow the session without bound
        session.on_record = lambda turn, mode=mode: recorded[mode].append(
            (time.time() - turn.started_at, getattr(turn.capture, "worker_error", None)))
        tokens[mode], sessions[mode] = session.token, session
    print(json.dumps({"base_url": gateway.tcp_base_url, "tokens": tokens}), flush=True)
    held: list = []  # `sessions N`: sessions opened and kept open, their records kept whole
    for line in sys.stdin:
        command, argument = line.split()
        if command == "sessions":
            held += [gateway.open_session(Upstream(upstream_url, api_key, "bench"), mode="transparent_proxy",
                                          capture=capture_options()) for _ in range(int(argument))]
            print(json.dumps({"tokens": [session.token for session in held], "rss": rss_bytes()}), flush=True)
            continue
        if command == "held":  # wait for them, then what the process holds and what the records hold
            idle = all(session.wait_idle(120) for session in held)
            records = sum(len(msgspec.json.encode(turn.to_json())) for session in held for turn in session.turns)
            print(json.dumps({"idle": idle, "rss": rss_bytes(), "record_bytes": records,
                              "turns": sum(len(session.turns) for session in held)}), flush=True)
            continue
        mode = argument
        idle = sessions[mode].wait_idle(120)
        done, recorded[mode] = recorded[mode], []
        errors = sorted({error for _, error in done if error})
        print(json.dumps({"idle": idle, "record_s": [latency for latency, _ in done], "worker_errors": errors,
                          "worker_assembled": capture_pool().assembled}), flush=True)


def rss_bytes() -> int:
    """This process's resident memory (its capture workers are processes of their own)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def on_port(url: str, port: int) -> str:
    """`url` with its port replaced: a relay's base URL in front of the upstream's."""
    return url.replace(f":{urlsplit(url).port}/", f":{port}/", 1)


def serve_relay(upstream_url: str) -> None:
    """Child process: a no-op TCP relay to the upstream's host and port (asyncio, one upstream
    connection per client connection, each read written on as it arrives); print its base URL.
    Exits on stdin EOF."""
    upstream = urlsplit(upstream_url)

    class Pipe(asyncio.Protocol):
        """One side of a relayed connection: what it reads goes to `peer`."""

        def __init__(self, peer: asyncio.Transport | None = None):
            self.peer, self.transport = peer, None

        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.peer.write(data)

        def connection_lost(self, exc):
            if self.peer is not None:
                self.peer.close()

    class Client(Pipe):
        def connection_made(self, transport):
            super().connection_made(transport)
            transport.pause_reading()  # until the upstream connection is open
            asyncio.ensure_future(self.connect())

        async def connect(self):
            loop = asyncio.get_running_loop()
            try:
                upstream_side, _ = await loop.create_connection(lambda: Pipe(self.transport), upstream.hostname,
                                                                upstream.port)  # fmt: skip
            except OSError:
                self.transport.close()  # the client sees the failure rather than waiting
                return
            self.peer = upstream_side
            self.transport.resume_reading()

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        print(on_port(upstream_url, port), flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # until EOF

    asyncio.run(main())


def start_c_relay(upstream_url: str) -> tuple[subprocess.Popen, str]:
    """socat relaying a free local port to the upstream's (a child per connection, TCP_NODELAY
    both ways, 256 KB reads): the relay floor in C. Returns it with its base URL once it accepts."""
    socat = shutil.which("socat")
    if socat is None:
        sys.exit("--c-relay needs socat on PATH (scripts/bootstrap.sh installs it)")
    upstream = urlsplit(upstream_url)
    with socket.socket() as probe:  # a free port for socat to listen on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # -b: 256 KB a read (its default, 8 KB, stalls a large answer for ~200 ms now and then)
    process = subprocess.Popen([socat, "-b", str(256 << 10), f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr,nodelay",
                                f"TCP:{upstream.hostname}:{upstream.port},nodelay"], stdin=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                sys.exit(f"socat did not listen on 127.0.0.1:{port}")
            time.sleep(0.02)
    return process, on_port(upstream_url, port)


async def hold_sessions(base_url: str, tokens: list[str], body: bytes, concurrency: int = 32) -> None:
    """One call in each held session, `concurrency` at a time."""
    queue = iter(tokens)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        async def worker():
            for token in queue:
                await one_call(client, base_url + "/chat/completions", token, body)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure_held_sessions(gateway: subprocess.Popen, gateway_info: dict, count: int, body: bytes) -> dict:
    """Memory per open session beyond what its records hold: `count` transparent_proxy sessions,
    one answer each, all kept open."""
    gateway.stdin.write(f"sessions {count}\n")
    gateway.stdin.flush()
    opened = json.loads(gateway.stdout.readline())
    asyncio.run(hold_sessions(gateway_info["base_url"], opened["tokens"], body))
    gateway.stdin.write("held all\n")
    gateway.stdin.flush()
    held = json.loads(gateway.stdout.readline())
    if not held["idle"] or held["turns"] != count:
        raise RuntimeError(f"held sessions: {held}")
    grown = held["rss"] - opened["rss"]
    return {"sessions": count, "rss_growth_mb": grown / 1e6, "record_mb": held["record_bytes"] / 1e6,
            "mb_per_session_beyond_records": (grown - held["record_bytes"]) / count / 1e6,
            "mb_per_session_with_records": grown / count / 1e6}


def spawn(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start a child python process and return it with its first stdout line."""
    proc = subprocess.Popen(
        [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    return proc, proc.stdout.readline().strip()


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime + stime of a process, of its live descendants: the capture worker), from /proc."""
    own, children = 0.0, 0.0
    for process in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{process}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if process == pid:
            own += seconds
        else:
            children += seconds
    return own, children


def descendants(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(child) for child in f.read().split()]
        except FileNotFoundError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


async def one_call(client: aiohttp.ClientSession, url: str, key: str, body: bytes, end: bytes = b"data: [DONE]\n\n"):
    """(total seconds, seconds to first body byte, bytes) of one streamed answer, which must end
    with `end` (a dialect's last event: DIALECTS)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    start = time.perf_counter()
    async with client.post(url, data=body, headers=headers) as response:
        response.raise_for_status()
        first = await response.content.readany()
        ttfb = time.perf_counter() - start
        size, tail = len(first), first
        while chunk := await response.content.readany():
            size += len(chunk)
            tail = (tail + chunk)[-512:]  # the end may arrive split across reads
    if end not in tail[-len(end) - 256 :]:
        raise RuntimeError(f"stream did not end with {end!r}: ...{tail[-200:]!r}")
    return time.perf_counter() - start, ttfb, size


async def run_phase(base_url: str, key: str, n: int, concurrency: int, body: bytes, engine_pid: int,
                    gateway: subprocess.Popen | None = None, mode: str = "", relay_pid: int | None = None,
                    route: str = "/chat/completions", end: bytes = b"data: [DONE]\n\n") -> dict:
    """n calls over `concurrency` connections, after one warm-up call per connection. Through
    the gateway (`gateway` given), the round ends once the gateway is idle, and it reports the
    record-complete latencies and the CPU seconds of the gateway and of its capture worker;
    through the relay (`relay_pid`), its CPU seconds. Either way, the CPU seconds of the engine
    (the scripted server) and of this client."""
    between = gateway.pid if gateway else relay_pid  # the process between client and engine, if any
    url = base_url + route if route.startswith("/") else base_url.removesuffix("/v1") + route.removeprefix("..")
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as client:
        # Warm the connection pools: one connection per stream, opened side by side.
        await asyncio.gather(*(one_call(client, url, key, body, end) for _ in range(concurrency)))
        assembled_before = idle(gateway, mode)["worker_assembled"] if gateway else 0  # the warm-up's are not this round's
        results = []
        queue = iter(range(n))

        async def worker():
            for _ in queue:
                results.append(await one_call(client, url, key, body, end))

        cpu_before = cpu_seconds(between) if between else (0.0, 0.0)
        engine_before, client_before = sum(cpu_seconds(engine_pid)), time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        answered = time.perf_counter() - start
        recorded = idle(gateway, mode) if gateway else {"record_s": [], "worker_errors": [], "worker_assembled": 0}
        wall = time.perf_counter() - start
        cpu_after = cpu_seconds(between) if between else (0.0, 0.0)
        engine_cpu, client_cpu = sum(cpu_seconds(engine_pid)) - engine_before, time.process_time() - client_before
    if gateway and len(recorded["record_s"]) != n:
        raise RuntimeError(f"{len(recorded['record_s'])} turns recorded for {n} calls")
    if recorded["worker_errors"]:
        raise RuntimeError(f"the capture worker failed: {recorded['worker_errors']}")
    return {
        "totals": [r[0] for r in results],
        "ttfbs": [r[1] for r in results],
        "record": recorded["record_s"],
        "wall": wall,
        "idle_wait": wall - answered,
        "cpu": cpu_after[0] - cpu_before[0],
        "worker_cpu": cpu_after[1] - cpu_before[1],
        "in_worker": recorded["worker_assembled"] - assembled_before,
        "engine_cpu": engine_cpu,
        "client_cpu": client_cpu,
    }


def idle(gateway: subprocess.Popen, mode: str) -> dict:
    """Wait until the gateway's `mode` session is idle; what it recorded since the last call."""
    gateway.stdin.write(f"idle {mode}\n")
    gateway.stdin.flush()
    answer = json.loads(gateway.stdout.readline())
    if not answer["idle"]:
        raise RuntimeError("the gateway was not idle after 120 s")
    return answer


def summarize(phases: list[dict], n_calls: int) -> dict:
    totals = [t for p in phases for t in p["totals"]]
    ttfbs = [t for p in phases for t in p["ttfbs"]]
    record = [t for p in phases for t in p["record"]]
    summary = {
        "median_ms": statistics.median(totals) * 1e3,
        "p90_ms": statistics.quantiles(totals, n=10)[-1] * 1e3,
        "p99_ms": statistics.quantiles(totals, n=100)[-1] * 1e3,
        "ttfb_median_ms": statistics.median(ttfbs) * 1e3,
        "req_per_s": n_calls / sum(p["wall"] for p in phases),  # through idle, for the gateway
        # Cores the whole setup kept busy (engine + client, + gateway and workers through it): on
        # a machine this saturates, every gateway microsecond is one the engine does not get.
        "cores_busy": sum(p["engine_cpu"] + p["client_cpu"] + p["cpu"] + p["worker_cpu"] for p in phases)
        / sum(p["wall"] for p in phases),
    }
    if record:
        summary["record_median_ms"] = statistics.median(record) * 1e3
        summary["record_p99_ms"] = statistics.quantiles(record, n=100)[-1] * 1e3
        summary["idle_wait_ms_per_round"] = statistics.mean(p["idle_wait"] for p in phases) * 1e3
    return summary


def round_ratios(direct: list[dict], through: list[dict]) -> list[float]:
    """[lowest, highest] of the per-round throughput ratios (rounds paired in order)."""
    def rate(phase: dict) -> float:
        return len(phase["totals"]) / phase["wall"]

    ratios = [rate(t) / rate(d) for d, t in zip(direct, through)]
    return [min(ratios), max(ratios)]


def measure_level(args, mode: str, c: int, k: int, gateway: subprocess.Popen, gateway_info: dict, direct_url: str,
                  bodies: dict, engine_pid: int, relays: dict[str, tuple[subprocess.Popen, str]]) -> dict:
    """One mode at one concurrency through one gateway: direct, relay-floor (each of `relays`)
    and gateway rounds alternating."""
    per_round = max(args.n // ROUNDS, c, 1 if args.n < ROUNDS else 0)
    direct, through = [], []
    floors: dict[str, list[dict]] = {name: [] for name in relays}
    for _ in range(ROUNDS):
        direct.append(asyncio.run(run_phase(direct_url, "bench-key", per_round, c, bodies[mode], engine_pid)))
        for name, (relay_process, relay_url) in relays.items():
            floors[name].append(asyncio.run(run_phase(relay_url, "bench-key", per_round, c, bodies[mode], engine_pid,
                                                      relay_pid=relay_process.pid)))  # fmt: skip
        through.append(asyncio.run(run_phase(
            gateway_info["base_url"], gateway_info["tokens"][mode], per_round, c,
            bodies["black_box"], engine_pid, gateway, mode)))  # fmt: skip
    calls = per_round * ROUNDS
    worker_cpu = sum(p["worker_cpu"] for p in through)
    loop_cpu = sum(p["cpu"] for p in through)
    gateway_cpu = loop_cpu + worker_cpu
    d, g = summarize(direct, calls), summarize(through, calls)
    level = {
        "mode": mode,
        "concurrency": c,
        "capture_workers": k or None,  # None: the default size
        "direct": d,
        "gateway": g,
    }
    for name, phases in floors.items():
        # What a no-op relay process achieves in the same rounds: the machine's floor for any
        # process put between client and engine.
        level[name] = summarize(phases, calls)
        level[f"{name}_floor_ratio"] = level[name]["req_per_s"] / d["req_per_s"]
    return level | {
        "added_median_ms": g["median_ms"] - d["median_ms"],
        "added_p99_ms": g["p99_ms"] - d["p99_ms"],
        "added_ttfb_ms": g["ttfb_median_ms"] - d["ttfb_median_ms"],
        "throughput_ratio": g["req_per_s"] / d["req_per_s"],
        # The spread: each round's gateway throughput over the direct round just before it.
        "throughput_ratio_range": round_ratios(direct, through),
        "added_record_median_ms": g["record_median_ms"] - d["median_ms"],
        "gateway_cpu_ms_per_call": gateway_cpu / calls * 1e3,  # capture workers included
        "capture_worker_cpu_ms_per_call": worker_cpu / calls * 1e3,
        "answers_parsed_in_worker": sum(p["in_worker"] for p in through),
        "calls": calls,
        "gateway_cpu_us_per_token": gateway_cpu / calls / args.tokens * 1e6,
        # The gateway's own process is one event loop (one core); capture spreads over k workers.
        "loop_cpu_us_per_token": loop_cpu / calls / args.tokens * 1e6,
        "worker_cpu_us_per_token": worker_cpu / calls / args.tokens * 1e6,
    }


# The same streamed call in each dialect the gateway speaks (proxy/dialects): its route (after
# the gateway's /v1 base URL; "../" for Gemini's /v1beta), its body, and its last event.
PROMPT = "Write a thousand tokens."
DIALECTS = {
    "responses": ("/responses", {"model": "bench", "stream": True, "input": PROMPT}, b"response.completed"),
    "messages": ("/messages", {"model": "bench", "stream": True, "max_tokens": 1 << 20,
                               "messages": [{"role": "user", "content": PROMPT}]}, b"message_stop"),
    "gemini": ("../v1beta/models/bench:streamGenerateContent?alt=sse",
               {"contents": [{"role": "user", "parts": [{"text": PROMPT}]}]}, b'"finishReason"'),
}  # fmt: skip
# Issue 43's target: a dialect's capture cost (gateway CPU per token, capture workers included,
# transparent_proxy) within this factor of the same call in Chat Completions, in the same rounds.
DIALECT_CPU_RATIO_MAX = 1.2


def measure_dialects(args, c: int, gateway: subprocess.Popen, gateway_info: dict, chat_body: bytes,
                     engine_pid: int, names: list[str]) -> dict:
    """transparent_proxy at concurrency `c`: the same answer asked in Chat Completions and in each
    dialect, through the same gateway session, in alternating rounds; gateway CPU per token."""
    per_round = max(args.n // ROUNDS, c, 1 if args.n < ROUNDS else 0)
    mode, base_url, token = "transparent_proxy", gateway_info["base_url"], gateway_info["tokens"]["transparent_proxy"]
    phases: dict[str, list[dict]] = {"chat": [], **{name: [] for name in names}}
    for _ in range(ROUNDS):
        phases["chat"].append(asyncio.run(run_phase(base_url, token, per_round, c, chat_body, engine_pid, gateway,
                                                    mode)))  # fmt: skip
        for name in names:
            route, body, end = DIALECTS[name]
            phases[name].append(asyncio.run(run_phase(base_url, token, per_round, c, json.dumps(body).encode(),
                                                      engine_pid, gateway, mode, route=route, end=end)))  # fmt: skip
    calls = per_round * ROUNDS

    def cpu_per_token(runs: list[dict]) -> float:
        return sum(p["cpu"] + p["worker_cpu"] for p in runs) / calls / args.tokens * 1e6

    chat = cpu_per_token(phases["chat"])
    level = {"concurrency": c, "calls": calls, "chat": {"gateway_cpu_us_per_token": chat,
                                                         **summarize(phases["chat"], calls)}}  # fmt: skip
    for name in names:
        ours = cpu_per_token(phases[name])
        level[name] = {"gateway_cpu_us_per_token": ours, "cpu_ratio_to_chat": ours / chat,
                       **summarize(phases[name], calls)}  # fmt: skip
    return level


def stop(gateways: dict, relays: dict, server: subprocess.Popen, script_path: str) -> None:
    for gateway, _ in gateways.values():
        gateway.stdin.close()  # it exits on EOF, removing its socket directory
        gateway.wait(10)
    for relay_process, _ in relays.values():
        if relay_process.stdin is not None:
            relay_process.stdin.close()  # the Python relay exits on EOF
        else:
            relay_process.terminate()  # socat
        relay_process.wait(10)
    server.terminate()
    server.wait(10)
    os.unlink(script_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="calls per path and concurrency")
    parser.add_argument("--tokens", type=int, default=1000, help="streamed tokens per answer")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--capture-workers", type=int, nargs="+", default=[0], metavar="K",
                        help="capture pool sizes to compare, one gateway process each (0: the default, "
                             "PI_ENV_CAPTURE_WORKERS or the CPUs)")
    parser.add_argument("--engine-delay-ms", type=float, default=0.0,
                        help="the scripted engine waits this long between tokens (0: flat out, ~125k tokens/s "
                             "a stream here, which with its client keeps about 2 cores busy)")
    parser.add_argument("--held-sessions", type=int, default=300,
                        help="then hold this many open sessions with one answer each and measure memory (0: skip)")
    parser.add_argument("--c-relay", action="store_true",
                        help="also measure a no-op relay written in C (socat) in the same rounds")
    parser.add_argument("--dialects", nargs="*", choices=sorted(DIALECTS), default=None, metavar="DIALECT",
                        help="only compare transparent_proxy's cost per token in each dialect the gateway speaks "
                             "(responses, messages, gemini; none named: all) with Chat Completions, in the same "
                             "rounds")
    parser.add_argument("--serve-gateway", nargs=2, metavar=("UPSTREAM_URL", "KEY"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--serve-relay", metavar="UPSTREAM_URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_gateway:
        return serve_gateway(*args.serve_gateway)
    if args.serve_relay:
        return serve_relay(args.serve_relay)

    # 4 characters per synthetic token and per chunk: one SSE event per token.
    turn = {"text": "abcd" * args.tokens, "chunk_chars": 4}
    if args.engine_delay_ms:
        turn["fault"] = {"delay_s": args.engine_delay_ms / 1e3}  # the scripted server's pacing
    script = {"scripts": {"bench-key": [turn]}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(script, f)
    server, line = spawn(["-m", "pi_env.scripted", "--port", "0", "--script", f.name])
    direct_url = line.rsplit(" ", 1)[1]
    relays = {"relay": spawn([__file__, "--serve-relay", direct_url])}
    if args.c_relay:
        relays["c_relay"] = start_c_relay(direct_url)
    gateways = {}  # capture pool size -> (gateway process, its URL and tokens)
    for k in args.capture_workers:
        env = {**os.environ, "PI_ENV_CAPTURE_WORKERS": str(k)} if k else None
        process, line = spawn([__file__, "--serve-gateway", direct_url, "bench-key"], env=env)
        gateways[k] = (process, json.loads(line))
    load_before = os.getloadavg()
    from pi_env.proxy.rewrite import rewrite_request

    agent_body = {
        "model": "bench", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Write a thousand tokens."}],
    }  # fmt: skip
    bodies = {"black_box": json.dumps(agent_body).encode(),
              # What the gateway forwards in transparent_proxy: the direct path asks the same.
              "transparent_proxy": json.dumps(rewrite_request(agent_body, capture_options())).encode()}

    report = {"bench": "proxy_overhead", "n": args.n, "tokens": args.tokens, "cpus": os.cpu_count(),
              "engine_delay_ms": args.engine_delay_ms, "levels": []}
    if args.dialects is not None:
        names = args.dialects or list(DIALECTS)
        try:
            gateway, gateway_info = next(iter(gateways.values()))
            levels = [measure_dialects(args, c, gateway, gateway_info, bodies["black_box"], server.pid, names)
                      for c in args.concurrency]  # fmt: skip
        finally:
            stop(gateways, relays, server, f.name)
        print(f"transparent_proxy, {args.n} streamed answers of {args.tokens} tokens per dialect and level")
        print(f"{'dialect':10} {'c':>3} {'CPU us/token':>13} {'x chat':>7} {'median ms':>10} {'req/s':>8}")
        for level in levels:
            for name in ("chat", *names):
                d = level[name]
                print(f"{name:10} {level['concurrency']:>3} {d['gateway_cpu_us_per_token']:>13.2f} "
                      f"{d.get('cpu_ratio_to_chat', 1.0):>7.2f} {d['median_ms']:>10.2f} {d['req_per_s']:>8.1f}")
        meets_dialects = {name: all(level[name]["cpu_ratio_to_chat"] <= DIALECT_CPU_RATIO_MAX for level in levels)
                          for name in names}  # fmt: skip
        print(json.dumps({"bench": "proxy_overhead.dialects", "n": args.n, "tokens": args.tokens,
                          "cpus": os.cpu_count(), "levels": levels, "cpu_ratio_max": DIALECT_CPU_RATIO_MAX,
                          "meets_targets": meets_dialects,
                          "loadavg": {"before": load_before, "after": os.getloadavg()}}))  # fmt: skip
        return
    try:
        for mode in MODES:
            for c in args.concurrency:
                for k, (gateway, gateway_info) in gateways.items():
                    report["levels"].append(measure_level(args, mode, c, k, gateway, gateway_info, direct_url,
                                                          bodies, server.pid, relays))  # fmt: skip
        if args.held_sessions:
            gateway, gateway_info = next(iter(gateways.values()))
            report["held_sessions"] = measure_held_sessions(gateway, gateway_info, args.held_sessions,
                                                            bodies["black_box"])
    finally:
        stop(gateways, relays, server, f.name)

    pace = f"the engine pausing {args.engine_delay_ms:g} ms a token" if args.engine_delay_ms else "the engine flat out"
    print(f"{args.n} streamed answers of {args.tokens} tokens per path and level, {pace}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    header = f"{'mode':17} {'c':>3} {'k':>2} {'path':8} {'median ms':>10} {'p99 ms':>8} {'ttfb ms':>8} {'req/s':>8}"
    print(header)
    for level in report["levels"]:
        k = level["capture_workers"] or "-"
        paths = [path for path in ("direct", "relay", "c_relay", "gateway") if path in level]
        for path in paths:
            s = level[path]
            print(f"{level['mode']:17} {level['concurrency']:>3} {k:>2} {path:8} {s['median_ms']:>10.2f} "
                  f"{s['p99_ms']:>8.2f} {s['ttfb_median_ms']:>8.2f} {s['req_per_s']:>8.1f}")  # fmt: skip
        print(f"    gateway adds {level['added_median_ms']:+.2f} ms median, {level['added_ttfb_ms']:+.2f} ms ttfb; "
              f"record complete {level['added_record_median_ms']:+.2f} ms over direct (median); throughput "
              f"through idle x{level['throughput_ratio']:.2f} (rounds x{level['throughput_ratio_range'][0]:.2f}-"
              f"{level['throughput_ratio_range'][1]:.2f}; a no-op relay x{level['relay_floor_ratio']:.2f}"
              + (f", in C x{level['c_relay_floor_ratio']:.2f}" if "c_relay" in level else "") + "); "
              f"CPU {level['gateway_cpu_us_per_token']:.2f} us/token (event loop {level['loop_cpu_us_per_token']:.2f}, "
              f"capture workers {level['worker_cpu_us_per_token']:.2f}; {level['answers_parsed_in_worker']} answers "
              f"in workers); cores busy " + ", ".join(f"{path} {level[path]['cores_busy']:.2f}" for path in paths)
              + f" of {os.cpu_count()}")
    if "held_sessions" in report:
        held = report["held_sessions"]
        print(f"{held['sessions']} open transparent_proxy sessions, one answer each: the gateway grew "
              f"{held['rss_growth_mb']:.1f} MB, its records {held['record_mb']:.1f} MB as JSON; "
              f"{held['mb_per_session_with_records']:.3f} MB per session with its record, "
              f"{held['mb_per_session_beyond_records']:.3f} MB beyond it (target <= 10)")
    report["targets"] = TARGETS
    report["meets_targets"] = {mode: all(meets(level) for level in report["levels"] if level["mode"] == mode)
                               for mode in MODES}  # fmt: skip
    report["loadavg"] = {"before": load_before, "after": os.getloadavg()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
