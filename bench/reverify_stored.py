"""`pi-env reverify` on N stored rollouts with an unchanged verifier: every reward reproduced?

Collects N rollouts (oracle endpoint, black_box, --keep-workdir) over N distinct tasks whose
rewards differ (pass, fail, half by pass rate, a reward file's fraction, a setup-made file the
agent edits, a planted unittest.py), then reverifies the dataset with the same tasks. Reports
the rewards that differ (target: 0 and 0 unscored), seconds per rollout for collect and for
reverify, and the load average. A dataset dir from an earlier run (--dataset) is reused.

Ends with ONE JSON line (with the load average before and after).

    .venv/bin/python bench/reverify_stored.py [--rollouts 200] [--concurrency 2] [--dataset DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pi_env import PiConfig, PiTask
from pi_env.collect import CollectRunner, reverify
from pi_env.collect.store import read_records


def task(i: int) -> PiTask:
    kind = i % 6
    common = {"task_id": f"t{i:04d}-{kind}", "instruction": f"task {i}"}
    if kind == 0:
        spec = {"verify": [f"grep -qx {i} n.txt"], "command": f"echo {i} > n.txt"}
    elif kind == 1:
        spec = {"verify": [f"grep -qx {i} n.txt"], "command": f"echo {i + 1} > n.txt"}
    elif kind == 2:
        spec = {"verify": ["test -f a.txt", "test -f b.txt", "test -f c.txt"], "command": "touch a.txt"}
    elif kind == 3:
        spec = {"verify": ["cp score /root/logs/verifier/reward.txt"], "command": f"echo 0.{i % 10} > score",
                "reward_file": True}
    elif kind == 4:
        spec = {"verify": ["grep -qx setup base.txt && grep -qx agent base.txt && test -x run.sh && test -L l"],
                "command": "echo agent >> base.txt; echo : > run.sh; chmod +x run.sh; ln -s /etc/hostname l",
                "setup": ["echo setup > base.txt"]}
    else:
        # (the runner is the sandbox's own unittest: a `python3 -m pytest` the image lacks is the task's error)
        spec = {"verify": ["python3 -m unittest -q test_it"],
                "command": "printf 'import os\\nos._exit(0)\\n' > unittest.py",
                "verify_files": {"test_it.py": "import unittest\n\nclass T(unittest.TestCase):\n"
                                               "    def test_it(self):\n        self.fail()\n"}}
    command = spec.pop("command")
    return PiTask(**common, **spec, solution=[{"tool": "bash", "command": command}])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--dataset", type=Path, default=None, help="collect into (or reuse) this dir")
    args = parser.parse_args()
    before = os.getloadavg()
    tasks = [task(i) for i in range(args.rollouts)]
    dataset = args.dataset or Path(tempfile.mkdtemp(prefix="pi-env-reverify-bench-"))
    config = PiConfig(mode="black_box", result={"keep_workdir": True})
    started = time.monotonic()
    collected = CollectRunner(tasks, dataset, config, concurrency=args.concurrency).run()
    collect_s = time.monotonic() - started
    started = time.monotonic()
    summary = reverify(dataset, tasks, concurrency=args.concurrency)
    reverify_s = time.monotonic() - started
    old = {r["id"]: r["reward"] for r in read_records(dataset, kept_only=False)}
    new = {line["id"]: line for line in map(json.loads, summary.out.read_text().splitlines())}
    differ = sorted(i for i in old if new[i]["new_reward"] != old[i])
    rewards = sorted({r for r in old.values() if r is not None})
    report = {
        "rollouts": len(old),
        "distinct_rewards": rewards,
        "reproduced": len(old) - len(differ),
        "differ": differ[:20],
        "same": summary.same,
        "changed": summary.changed,
        "unscored": summary.unscored_kinds,
        "collect_s_per_rollout": round(collect_s / max(collected.ran, 1), 4),
        "reverify_s_per_rollout": round(reverify_s / max(summary.ran, 1), 4),
        "reverify_wall_s": round(reverify_s, 2),
        "kept_bytes_total": sum(p.stat().st_size for p in (dataset / "workdirs").glob("*.tar.gz")),
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "loadavg": {"before": before, "after": os.getloadavg()},
    }
    print(json.dumps(report))
    return 0 if not differ and not summary.unscored else 1


if __name__ == "__main__":
    sys.exit(main())
