"""One bench, this tree against an earlier commit, side by side in one run.

    python bench/against.py REF [--rounds R] -- proxy_overhead.py --n 100

Checks REF out in a temporary git worktree, then runs the bench R times in each tree,
alternating (base, head, base, head, ...) so that both see the same machine, each against its
own source (PYTHONPATH=<tree>/src, the bench script of that tree). Every bench ends with one
JSON line; its numbers are compared: per figure the median over the rounds of base and head, and
head / base. The load average is printed before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABEL_KEYS = ("mode", "concurrency", "c", "capture_workers", "k", "name", "path")


def flatten(value, prefix: str = "") -> dict[str, float]:
    """Numeric leaves by path; a list item is named by its identifying fields when it has them."""
    found: dict[str, float] = {}
    if isinstance(value, bool):
        return found
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    if isinstance(value, dict):
        for key, item in value.items():
            if key != "loadavg":
                found |= flatten(item, f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            label = str(index)
            if isinstance(item, dict) and any(k in item for k in LABEL_KEYS):
                label = ",".join(f"{k}={item[k]}" for k in LABEL_KEYS if k in item)
            found |= flatten(item, f"{prefix}[{label}]")
    return found


def run(tree: Path, bench: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    load = os.getloadavg()
    done = subprocess.run([sys.executable, str(tree / "bench" / bench[0]), *bench[1:]], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{bench[0]} failed in {tree}:\n{done.stderr[-3000:]}")
    line = [text for text in done.stdout.splitlines() if text.startswith("{")][-1]
    print(f"  {tree.name:<6} load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the earlier commit (base)")
    parser.add_argument("--rounds", type=int, default=2)
    ours, bench = sys.argv[1:], []
    if "--" in ours:
        ours, bench = ours[: ours.index("--")], ours[ours.index("--") + 1 :]
    args = parser.parse_args(ours)
    load_before = os.getloadavg()
    if not bench:
        parser.error("name the bench after --, e.g. against.py REF -- proxy_overhead.py --n 100")
    with tempfile.TemporaryDirectory(prefix="pi-env-against-") as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.ref], check=True)
        head = Path(scratch) / "head"
        head.symlink_to(ROOT)
        try:
            results: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}/{args.rounds}", flush=True)
                for name, tree in (("base", base), ("head", head)):
                    results[name].append(flatten(run(tree, bench)))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    keys = sorted(set(results["base"][0]) & set(results["head"][0]))
    report = {}
    print(f"\n{'figure':<70} {'base':>12} {'head':>12} {'head/base':>10}")
    for key in keys:
        old = statistics.median(r[key] for r in results["base"] if key in r)
        new = statistics.median(r[key] for r in results["head"] if key in r)
        ratio = new / old if old else None
        report[key] = {"base": old, "head": new, "ratio": ratio}
        print(f"{key:<70} {old:>12.4g} {new:>12.4g} {ratio if ratio is not None else float('nan'):>10.3f}")
    print(json.dumps({"bench": "against", "ref": args.ref, "rounds": args.rounds, "run": bench, "figures": report,
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))


if __name__ == "__main__":
    main()
