"""What verify costs per rollout, two source trees side by side (a change and the commit before it).

Each tree gets one worker process (its own `src/` first on sys.path, the same venv) that runs
rollouts of the given tasks on the oracle endpoint; rounds alternate which tree goes first, so
both see the same machine. Prints, per tree, the median of the verify phase (`timings["verify"]`)
and of the whole rollout over every rollout of the bundled examples, the difference of the
medians, the load average before and after, and ends with ONE JSON line.

    python bench/verify_cost.py --before HEAD~3 -n 6 examples/*.json   (a ref, or a tree's dir)
Target (issue 41): verify's added cost within +50 ms median per rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys
from pi_env import PiTask, run_rollout
for line in sys.stdin:
    task = PiTask.from_file(line.strip())
    result = run_rollout(task)
    print(json.dumps({"task": task.task_id, "verify_s": result.timings.get("verify", 0.0), "wall_s": result.wall_s,
                      "reward": result.reward, "error": result.error_kind}), flush=True)
"""


def worker(tree: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.abspath(tree), "src")}
    return subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=os.path.abspath(tree))


@contextmanager
def tree(ref_or_dir: str):
    """A source tree: the dir itself, or REF checked out in a temporary git worktree."""
    if os.path.isdir(ref_or_dir):
        yield ref_or_dir
        return
    with tempfile.TemporaryDirectory(prefix="verify-cost-") as scratch:
        path = os.path.join(scratch, "tree")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", path, ref_or_dir], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the tree without the change: a git ref or a dir")
    parser.add_argument("--after", default=str(ROOT), help="the tree with the change (default: this one)")
    parser.add_argument("-n", type=int, default=5, help="rounds (each runs every task once per tree)")
    parser.add_argument("tasks", nargs="+", help="task files (absolute, or relative to the cwd)")
    args = parser.parse_args()
    tasks = [os.path.abspath(path) for path in args.tasks]
    with tree(args.before) as before, tree(args.after) as after:
        measure(before, after, tasks, args.n)


def measure(before: str, after: str, tasks: list[str], rounds: int) -> None:
    load_before = os.getloadavg()
    workers = {"before": worker(before), "after": worker(after)}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for round_ in range(rounds):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for name in order:
            for task in tasks:
                process = workers[name]
                assert process.stdin is not None and process.stdout is not None
                process.stdin.write(task + "\n")
                process.stdin.flush()
                runs[name].append(json.loads(process.stdout.readline()))
    for process in workers.values():
        assert process.stdin is not None
        process.stdin.close()
        process.wait(60)
    load_after = os.getloadavg()
    summary = {}
    for name, rows in runs.items():
        bad = [row for row in rows if row["reward"] != 1.0]
        summary[name] = {
            "rollouts": len(rows),
            "verify_median_s": round(statistics.median(row["verify_s"] for row in rows), 4),
            "wall_median_s": round(statistics.median(row["wall_s"] for row in rows), 4),
            "not_1.0": len(bad),
        }
        print(f"{name:>6}: {summary[name]}")
        per_task = {}
        for row in rows:
            per_task.setdefault(row["task"], []).append(row["verify_s"])
        for task, values in sorted(per_task.items()):
            print(f"        {task:<28} verify median {statistics.median(values) * 1000:7.1f} ms")
    added = summary["after"]["verify_median_s"] - summary["before"]["verify_median_s"]
    print(f"verify added: {added * 1000:+.1f} ms median per rollout (target <= +50 ms); "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(json.dumps({"bench": "verify_cost", **summary, "verify_added_ms": round(added * 1000, 1),
                      "loadavg": {"before": load_before, "after": load_after}}))


if __name__ == "__main__":
    main()
