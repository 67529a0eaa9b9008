"""Every bench/*.py runs, at tiny sizes, in the default suite: none can rot unnoticed. Each must
exit 0 and end with ONE JSON line that carries the load average. (The figures come from full
runs: docs/benchmarks.md.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
TINY = {
    "against.py": ["HEAD", "--rounds", "1", "--", "sandbox_overhead.py", "2"],
    "collect_throughput.py": ["--levels", "1", "--per-level", "1", "--rounds", "1", "--stress", "2"],
    "gate_overhead.py": ["--calls", "4", "--sessions", "1", "2", "--generate-ms", "1"],
    # 100 tokens with top-5 logprobs is ~75 KB: past OFFLOAD_MIN_BYTES, so the capture worker works
    "proxy_overhead.py": ["--n", "4", "--tokens", "100", "--concurrency", "1", "2", "--capture-workers", "1", "2",
                          "--held-sessions", "4", "--engine-delay-ms", "0.05", "--c-relay"],
    "replica_failover.py": ["--rollouts", "2", "--concurrency", "2"],
    "rollout_overhead.py": ["-n", "1"],
    "reverify_stored.py": ["--rollouts", "6"],
    "sandbox_overhead.py": ["2"],
    "scripted_memory.py": ["--requests", "20", "--turn-bytes", "200"],
    "token_in_overhead.py": ["--tokens", "2000", "--turns", "3", "--sessions", "2"],
    "token_in_hostile.py": ["--sizes", "256", "--classes", "tool_call_loop", "nested_json"],
    "server_throughput.py": ["--rollouts", "1", "--concurrency", "1", "--rounds", "1", "--fixed-calls", "2"],
    "verify_cost.py": ["--before", "HEAD", "-n", "1", "examples/fizzbuzz.json"],
    "workspace_steps.py": ["--calls", "5", "--runs", "2", "--episodes", "1"],
}


def test_every_bench_has_tiny_sizes():
    assert sorted(TINY) == sorted(p.name for p in BENCH.glob("*.py") if p.name != "common.py")  # common: shared code


@pytest.mark.needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TINY))
def test_bench_runs_and_ends_with_one_json_line(script):
    done = subprocess.run([sys.executable, str(BENCH / script), *TINY[script]], capture_output=True, text=True,
                          timeout=280, cwd=BENCH.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["loadavg"]["before"]) == 3 and len(report["loadavg"]["after"]) == 3
    if script == "proxy_overhead.py":
        capture = [level for level in report["levels"] if level["mode"] == "transparent_proxy"]
        assert capture and all(level["answers_parsed_in_worker"] == level["calls"] for level in capture), capture
        assert {level["capture_workers"] for level in capture} == {1, 2}
        assert report["engine_delay_ms"] == 0.05
        assert all(0 < level[path]["cores_busy"] <= report["cpus"] * 1.2 for level in report["levels"]
                   for path in ("direct", "relay", "c_relay", "gateway"))  # fmt: skip
        assert all(level["relay_floor_ratio"] > 0 and level["relay"]["median_ms"] > 0
                   and level["c_relay_floor_ratio"] > 0 and level["c_relay"]["median_ms"] > 0
                   and 0 < level["throughput_ratio_range"][0] <= level["throughput_ratio_range"][1]
                   for level in report["levels"])  # fmt: skip
        assert report["held_sessions"]["sessions"] == 4 and report["held_sessions"]["record_mb"] > 0
