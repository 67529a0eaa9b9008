"""What the scripted server (and the oracle built on it) holds after an agent-like run.

An agent's every request carries the whole conversation, so a server that keeps each request
body keeps the conversation quadratically. Side by side in one run, the same requests (a
conversation growing by `--turn-bytes` per request, `--requests` of them) go to three
ScriptedServers in this process: one keeping every body as before (1,000 requests, no byte
bound), one with the default bound (MAX_RECORDED_BYTES), and one like the oracle's shared
server (record_requests=0). Memory held afterwards is measured with tracemalloc (the bytes
still allocated once the run is over). Prints ONE JSON line. Target: the oracle's server holds
under 1 MiB, the default bound holds at most MAX_RECORDED_BYTES plus overhead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tracemalloc
import urllib.request

from pi_env.scripted import ScriptedServer, ScriptedTurn
from pi_env.scripted.server import MAX_RECORDED_BYTES


def held_after_run(server: ScriptedServer, requests: int, turn_bytes: int) -> int:
    key = server.add_script([ScriptedTurn(text="ok")] * requests)
    messages = [{"role": "system", "content": "You are an agent."}]
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for index in range(requests):
        messages.append({"role": "user" if index % 2 else "assistant", "content": "x" * turn_bytes})
        body = json.dumps({"model": "m", "messages": messages}).encode()
        request = urllib.request.Request(server.base_url + "/chat/completions", body,
                                         {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()
    server.remove_script(key)
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--turn-bytes", type=int, default=2000)
    args = parser.parse_args()
    load_before = os.getloadavg()
    tracemalloc.start()
    held = {}
    for name, options in (("keep_all", {"record_requests": 1000, "record_bytes": 1 << 62}),
                          ("default_bound", {}), ("oracle", {"record_requests": 0})):
        with ScriptedServer(**options) as server:
            held[name] = held_after_run(server, args.requests, args.turn_bytes)
            print(f"{name}: {held[name] / 2**20:.1f} MiB held after {args.requests} requests", flush=True)
    mib = {name: round(value / 2**20, 2) for name, value in held.items()}
    print(json.dumps({"bench": "scripted_memory", "requests": args.requests, "turn_bytes": args.turn_bytes,
                      "held_mib": mib, "default_bound_mib": MAX_RECORDED_BYTES >> 20,
                      "keep_all_over_oracle": round(held["keep_all"] / max(held["oracle"], 1), 1),
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))


if __name__ == "__main__":
    main()
