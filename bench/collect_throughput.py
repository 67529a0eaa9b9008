"""Collect throughput against the ideal set by Pi's own CPU cost, on this machine.

1. Pi's CPU cost: the same 2-turn task run by bare Pi (no sandbox, gateway or verify; the
   process of bench/rollout_overhead.py) `--calibrate` times in a row; its CPU seconds (user +
   sys of Pi and what it ran) per run give the ideal: cores x 60 / cpu_s rollouts per minute.
2. `pi-env collect` (CollectRunner, local executor, transparent_proxy, oracle endpoint) of that
   task, copied under distinct ids, at concurrency 1, 2, 4 and 8: rollouts/min and efficiency =
   rate / ideal. Target: >= 0.8 at the best concurrency.
3. Concurrency 32 (32 rollouts at once): no errors.

Everything in one run, so the load of a shared machine hits both sides. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rollout_overhead import TASK, bare_pi_run  # noqa: E402 - the same bare Pi run, reused

from pi_env import PiConfig  # noqa: E402
from pi_env.agent.runtime import ensure_runtime  # noqa: E402
from pi_env.collect import CollectRunner  # noqa: E402
from pi_env.oracle import solution_turns  # noqa: E402
from pi_env.testing import ScriptedServer  # noqa: E402


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pi_cpu_per_run(n: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per bare Pi run, averaged over n runs after one warm-up."""
    config = PiConfig()
    runtime = ensure_runtime(config.pi_package, config.pi_version, config.node_version, config.runtime_cache_dir)
    with ScriptedServer() as server:
        key = server.add_script(solution_turns(TASK))
        bare_pi_run(runtime, server, key, config)
        cpu, started = children_cpu_s(), time.perf_counter()
        for _ in range(n):
            bare_pi_run(runtime, server, key, config)
        return (children_cpu_s() - cpu) / n, (time.perf_counter() - started) / n


def collect(concurrency: int, rollouts: int, out_root: Path) -> dict:
    tasks = [TASK.model_copy(update={"task_id": f"bench-{concurrency}-{i}"}) for i in range(rollouts)]
    out = out_root / f"c{concurrency}"
    started = time.perf_counter()
    summary = CollectRunner(tasks, out, PiConfig(mode="transparent_proxy"), concurrency=concurrency, retries=0).run()
    wall = time.perf_counter() - started
    counts = summary.counts
    return {"concurrency": concurrency, "rollouts": counts["records"], "wall_s": round(wall, 3),
            "rollouts_per_min": round(counts["records"] / wall * 60, 2), "errors": counts["errors"],
            "mean_reward": counts["mean_reward"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calibrate", type=int, default=8, help="bare Pi runs for the CPU cost")
    parser.add_argument("--per-level", type=int, default=16, help="rollouts per concurrency level")
    parser.add_argument("--levels", default="1,2,4,8")
    parser.add_argument("--stress", type=int, default=32, help="concurrency (and rollouts) of the error check")
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    pi_cpu_s, pi_wall_s = pi_cpu_per_run(args.calibrate)
    ideal = cores * 60 / pi_cpu_s
    print(f"bare Pi: {pi_cpu_s:.3f} CPU s and {pi_wall_s:.3f} wall s per run; ideal on {cores} cores: "
          f"{ideal:.1f} rollouts/min; load average {os.getloadavg()[0]:.2f}")

    levels = []
    with tempfile.TemporaryDirectory(prefix="pi-env-collect-bench-") as tmp:
        for concurrency in (int(c) for c in args.levels.split(",")):
            level = collect(concurrency, args.per_level, Path(tmp))
            level["efficiency"] = round(level["rollouts_per_min"] / ideal, 3)
            levels.append(level)
            print(f"concurrency {concurrency:>2}: {level['rollouts_per_min']:>6.1f} rollouts/min "
                  f"({level['efficiency']:.2f} of ideal), errors {level['errors'] or 'none'}")
        stress = collect(args.stress, args.stress, Path(tmp))
        print(f"concurrency {args.stress}: {stress['rollouts']} rollouts, errors {stress['errors'] or 'none'}, "
              f"{stress['rollouts_per_min']:.1f} rollouts/min")

    best = max(levels, key=lambda level: level["efficiency"])
    print(json.dumps({"bench": "collect_throughput", "cores": cores, "pi_cpu_s_per_run": round(pi_cpu_s, 4),
                      "pi_wall_s_per_run": round(pi_wall_s, 4), "ideal_rollouts_per_min": round(ideal, 2),
                      "levels": levels, "best_concurrency": best["concurrency"],
                      "best_efficiency": best["efficiency"], "target_efficiency": 0.8,
                      "stress": stress, "stress_errors": sum(stress["errors"].values()),
                      "load_average_1m": round(os.getloadavg()[0], 2), "mode": "transparent_proxy",
                      "endpoint": "oracle"}))


if __name__ == "__main__":
    main()
