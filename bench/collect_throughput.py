"""What `pi-env collect` costs over running the same rollouts yourself, at each concurrency.

Two ways to run N rollouts of one task (oracle endpoint, transparent_proxy) at concurrency c:
  - loop:    `c` threads of this process, each taking the next task and running it through one
             shared PiSessionFactory (create + wait_for_completion), nothing else;
  - collect: CollectRunner (local executor) at concurrency c into a fresh dataset directory
             (its store, records, retries off, report and card).
The rounds interleave (loop, collect, loop, collect, ...) so a shared machine's load hits both
sides alike; ratio = collect's rollouts/min over the loop's. Target: >= 0.9 at every level.
Then `--stress` rollouts at that concurrency through collect: no errors.

Ends with ONE JSON line (with the load average before and after).

    .venv/bin/python bench/collect_throughput.py [--levels 1,2,4,8] [--per-level 8] [--rounds 2] [--stress 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rollout_overhead import TASK  # noqa: E402 - the same 2-turn task

from pi_env import PiConfig, PiSessionFactory  # noqa: E402
from pi_env.collect import CollectRunner  # noqa: E402

CONFIG = PiConfig(mode="transparent_proxy")


def tasks(prefix: str, n: int):
    return [TASK.model_copy(update={"task_id": f"{prefix}-{i}"}) for i in range(n)]


def loop(factory: PiSessionFactory, concurrency: int, rollouts: int, prefix: str) -> dict:
    def one(task):
        with factory.create(task) as session:
            return session.wait_for_completion()

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, tasks(prefix, rollouts)))
    wall = time.perf_counter() - started
    errors: dict[str, int] = {}
    for result in results:
        if result.error_kind:
            errors[result.error_kind] = errors.get(result.error_kind, 0) + 1
    return {"rollouts": len(results), "wall_s": wall, "errors": errors,
            "scored": sum(r.reward is not None for r in results)}


def collect(concurrency: int, rollouts: int, out: Path, prefix: str) -> dict:
    started = time.perf_counter()
    summary = CollectRunner(tasks(prefix, rollouts), out, CONFIG, concurrency=concurrency, retries=0,
                            progress=False).run()
    wall = time.perf_counter() - started
    counts = summary.counts
    return {"rollouts": counts["records"], "wall_s": wall, "errors": counts["errors"], "scored": counts["scored"]}


def per_min(phases: list[dict]) -> float:
    return sum(p["rollouts"] for p in phases) / sum(p["wall_s"] for p in phases) * 60


def merged_errors(phases: list[dict]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for phase in phases:
        for kind, count in phase["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,2,4,8", help="concurrency levels")
    parser.add_argument("--per-level", type=int, default=8, help="rollouts per side and round")
    parser.add_argument("--rounds", type=int, default=2, help="loop/collect alternations per level")
    parser.add_argument("--stress", type=int, default=32, help="concurrency (and rollouts) of the error check; 0: none")
    args = parser.parse_args()

    load_before = os.getloadavg()
    factory = PiSessionFactory(CONFIG)
    levels = []
    with tempfile.TemporaryDirectory(prefix="pi-env-collect-bench-") as tmp:
        factory.create(TASK).close()  # installs/loads Pi's runtime once, outside the clock
        for concurrency in (int(c) for c in args.levels.split(",")):
            looped, collected = [], []
            for round_ in range(args.rounds):
                prefix = f"c{concurrency}-r{round_}"
                looped.append(loop(factory, concurrency, args.per_level, prefix))
                collected.append(collect(concurrency, args.per_level, Path(tmp) / prefix, prefix))
            level = {"concurrency": concurrency, "rollouts_per_side": args.per_level * args.rounds,
                     "loop_per_min": round(per_min(looped), 2), "collect_per_min": round(per_min(collected), 2),
                     "loop_errors": merged_errors(looped), "collect_errors": merged_errors(collected)}
            level["ratio"] = round(level["collect_per_min"] / level["loop_per_min"], 3)
            levels.append(level)
            print(f"concurrency {concurrency:>2}: loop {level['loop_per_min']:>6.1f}, collect "
                  f"{level['collect_per_min']:>6.1f} rollouts/min (x{level['ratio']:.2f}); errors loop "
                  f"{level['loop_errors'] or 'none'}, collect {level['collect_errors'] or 'none'}", flush=True)
        stress = None
        if args.stress:
            stress = collect(args.stress, args.stress, Path(tmp) / "stress", "stress")
            stress["rollouts_per_min"] = round(stress["rollouts"] / stress["wall_s"] * 60, 2)
            print(f"concurrency {args.stress}: {stress['rollouts']} rollouts through collect, errors "
                  f"{stress['errors'] or 'none'}, {stress['rollouts_per_min']:.1f} rollouts/min")

    errors = sum(sum(lv["loop_errors"].values()) + sum(lv["collect_errors"].values()) for lv in levels)
    print(json.dumps({"bench": "collect_throughput", "cpus": os.cpu_count(), "mode": CONFIG.mode.name, "endpoint": "oracle",
                      "levels": levels, "min_ratio": min(lv["ratio"] for lv in levels), "target_ratio": 0.9,
                      "errors": errors, "stress": stress,
                      "stress_errors": sum(stress["errors"].values()) if stress else None,
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))
    if errors or (stress and stress["errors"]):
        sys.exit(1)  # a figure made of failures is no figure


if __name__ == "__main__":
    main()
