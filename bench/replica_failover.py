"""Several replicas, one endpoint, one killed mid-run (docs/async-rl.md, "Several replicas").

A `pi-env collect` of N rollouts (real Pi, real bubblewrap) against an endpoint given as three
scripted replicas (each the same 3-turn script, streamed slowly so that a kill can land
mid-answer); at a random moment (after a random share of the run's model calls) one replica is
killed: `--kill sigkill` (the default) runs that replica as its own process
(`python -m pi_env.scripted`) and SIGKILLs it by its PID (its answers in flight break, then it
refuses connections); `--kill stop` stops an in-process one by its handle (answers in flight
get a second to end, then it refuses connections).

Checked, and printed as figures:
  - every rollout stored once: scored, or unscored with a named error kind (none lost);
  - no duplicate: every request a surviving replica received is exactly one recorded turn of
    that rollout's session (the killed one's, when it ran in-process: at most its recorded turns
    plus those failed over);
  - sticky: consecutive turns of a session are on one replica unless the later is flagged
    `failed_over`;
  - what each replica received, and the failovers; every rollout's session released (the
    replicas' health at the end counts no session and no call in flight).
`tests/test_replicas.py` runs `run()` with a few rollouts in the default suite.

Ends with ONE JSON line (with the load average before and after); exits 1 if a check failed.

    .venv/bin/python bench/replica_failover.py [--rollouts 64] [--concurrency 4] [--seed S] [--mode M]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from pi_env import PiConfig, PiTask
from pi_env.collect import CollectRunner
from pi_env.collect.store import read_records
from pi_env.proxy.gateway import replica_health
from pi_env.scripted import Fault, ScriptedServer, ScriptedToolCall, ScriptedTurn

KEY = "sk-replicas-bench"
SLOW = Fault(delay_s=0.03)  # between stream events: an answer takes a while, a kill may cut it


def bash(command: str) -> ScriptedTurn:
    return ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": command})], chunk_chars=4,
                        fault=SLOW)


SCRIPT = [bash("echo 1 > a.txt"), bash("echo 2 >> a.txt"), ScriptedTurn(text="done: a.txt has two lines",
                                                                          chunk_chars=2, fault=SLOW)]
CALLS_PER_ROLLOUT = len(SCRIPT)


def tasks(n: int) -> list[PiTask]:
    return [PiTask(task_id=f"replica-{i}", instruction="write 1 then 2 into a.txt, one per line",
                   verify=["test \"$(cat a.txt)\" = \"$(printf '1\\n2')\""]) for i in range(n)]


class ProcessReplica:
    """A scripted replica in a process of its own, to be SIGKILLed (its requests are not seen)."""

    def __init__(self, script_dir: Path):
        script = script_dir / "script.json"
        script.write_text(json.dumps({"scripts": {KEY: [t.model_dump() for t in SCRIPT]}}))
        self.process = subprocess.Popen([sys.executable, "-m", "pi_env.scripted", "--port", "0", "--script",
                                         str(script)], stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()  # "scripted server listening on http://127.0.0.1:P/v1"
        self.base_url = line.strip().rsplit(" ", 1)[-1]
        self.port = int(self.base_url.split(":")[2].split("/")[0])
        self.requests: list = []

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)  # by its PID: this one, and no other
        self.process.wait(10)

    stop = kill


def run(rollouts: int, out: Path, *, concurrency: int = 4, seed: int | None = None, mode: str = "transparent_proxy",
        replicas: int = 3, retries: int = 2, kill: str = "sigkill") -> dict:
    """The collect, the kill, and the figures (`violations` lists every check that failed)."""
    rng = random.Random(seed)
    victim = rng.randrange(replicas)
    servers: list = []
    try:
        for index in range(replicas):
            if index == victim and kill == "sigkill":
                servers.append(ProcessReplica(out.parent))
            else:
                servers.append(ScriptedServer(record_requests=100_000).start())
                servers[-1].add_script(SCRIPT, api_key=KEY)
        # After a random share of the run's calls (between 10% and 70% of them).
        kill_after = max(1, int(rollouts * CALLS_PER_ROLLOUT * rng.uniform(0.1, 0.7) * (replicas - 1) / replicas))
        killed_at: list[float] = []
        done = threading.Event()

        def killer():
            while not done.is_set():
                if sum(len(s.requests) for s in servers) >= kill_after:  # the survivors' calls
                    servers[victim].stop()
                    killed_at.append(time.monotonic())
                    return
                time.sleep(0.01)

        thread = threading.Thread(target=killer, daemon=True)
        config = PiConfig(
            endpoint={"name": [s.base_url for s in servers], "model": "scripted-model", "api_key": KEY},
            mode=mode,
        )
        started = time.monotonic()
        thread.start()
        try:
            summary = CollectRunner(tasks(rollouts), out, config, concurrency=concurrency, retries=retries,
                                    retry_backoff_s=[0.5]).run()
        finally:
            done.set()
            thread.join()
        wall = time.monotonic() - started
        result = figures(list(read_records(out, kept_only=False)), servers, victim, rollouts, wall,
                         killed_at[0] - started if killed_at else None, summary.retried, seen=kill != "sigkill")
        hosts = {f"127.0.0.1:{s.port}" for s in servers}
        (health,) = [h["replicas"] for h in replica_health() if {r["replica"] for r in h["replicas"]} == hosts]
        result["replica_health"] = health
        if any(r["sessions"] or r["in_flight"] for r in health):  # every rollout closed: nothing left counted
            result["violations"].append(f"sessions or calls still counted on a replica: {health}")
        return result
    finally:
        for server in servers:
            server.stop()


def figures(records, servers, victim, rollouts, wall, killed_after_s, retried, *, seen: bool) -> dict:
    hosts = [f"127.0.0.1:{s.port}" for s in servers]
    received = [Counter(r.headers.get("x-session-id") for r in s.requests if r.path.endswith("completions"))
                for s in servers]
    violations: list[str] = []
    ids = [r["id"] for r in records]
    if len(ids) != len(set(ids)):
        violations.append(f"duplicate records: {[i for i, c in Counter(ids).items() if c > 1]}")
    if len(set(ids)) != rollouts:
        violations.append(f"{rollouts - len(set(ids))} rollouts lost (stored {len(set(ids))} of {rollouts})")
    unnamed = [r["id"] for r in records if r["reward"] is None and not r["error_kind"]]
    if unnamed:
        violations.append(f"unscored without an error kind: {unnamed}")
    failed_over = switched = 0
    for record in records:
        turns, session = record["turns"], record["session_id"]
        for before, turn in zip(turns, turns[1:], strict=False):
            if turn["replica"] != before["replica"]:
                switched += 1
                if not turn["failed_over"]:
                    violations.append(f"{record['id']}: turn {turn['turn']} moved replica without the flag")
        flagged = sum(t["failed_over"] for t in turns)
        failed_over += flagged
        on = Counter(t["replica"] for t in turns if t["upstream_status"] is not None)
        for index, host in enumerate(hosts):
            got = received[index].get(session, 0)
            if index != victim and got != on.get(host, 0):
                violations.append(f"{record['id']}: {host} received {got} calls, recorded {on.get(host, 0)}")
            if index == victim and seen and not on.get(host, 0) <= got <= on.get(host, 0) + flagged:
                violations.append(f"{record['id']}: the killed {host} received {got}, recorded {on.get(host, 0)}")
    errors = Counter(r["error_kind"] for r in records if r["reward"] is None)
    return {
        "rollouts": rollouts,
        "stored": len(set(ids)),
        "scored": sum(r["reward"] is not None for r in records),
        "reward_1": sum(r["reward"] == 1.0 for r in records),
        "unscored": dict(errors),
        "retried_attempts": retried,
        "duplicates": len(ids) - len(set(ids)),
        "turns": sum(len(r["turns"]) for r in records),
        "failed_over_turns": failed_over,
        "replica_switches": switched,
        "requests_per_replica": [sum(c.values()) if seen or i != victim else None for i, c in enumerate(received)],
        "killed_replica": victim,
        "killed_after_s": round(killed_after_s, 2) if killed_after_s is not None else None,
        "wall_s": round(wall, 1),
        "violations": violations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--mode", default="transparent_proxy", choices=["transparent_proxy", "black_box"])
    parser.add_argument("--kill", default="sigkill", choices=["sigkill", "stop"])
    args = parser.parse_args()
    load_before = os.getloadavg()
    args.seed = random.randrange(1 << 30) if args.seed is None else args.seed  # printed: a run can be repeated
    with tempfile.TemporaryDirectory(prefix="pi-env-replicas-") as out:
        result = run(args.rollouts, Path(out) / "ds", concurrency=args.concurrency, seed=args.seed, mode=args.mode,
                     kill=args.kill)
    for name, value in result.items():
        print(f"{name}: {value}")
    print(json.dumps({"bench": "replica_failover", "cpus": os.cpu_count(), "mode": args.mode, "kill": args.kill,
                      "seed": args.seed,
                      **result,
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))
    raise SystemExit(1 if result["violations"] else 0)


if __name__ == "__main__":
    main()
