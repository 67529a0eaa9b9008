"""What pi-env costs on top of Pi itself.

Side by side in one run, interleaved, N times each:
  bare    - the same Pi runtime with the same hermetic flags and settings, run as a plain process
            against the same scripted server (no sandbox, no gateway, no verify);
  pi-env  - a full rollout of the same 2-turn task (oracle: one write, then the final text;
            1 verify command) through the sandbox and the gateway.
Prints medians, the ratio and the per-phase split, and ends with ONE JSON line.
Target: ratio <= 1.15.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from pi_env import PiConfig, PiSessionFactory, PiTask
from pi_env.agent.pi import HERMETIC_SETTINGS
from pi_env.agent.runtime import ensure_runtime
from pi_env.endpoints import OPEN_SERVER_COMPAT
from pi_env.oracle import solution_turns
from pi_env.scripted import ScriptedServer

TASK = PiTask(task_id="bench-hello", instruction="Create hello.txt containing hello.",
              verify=["test -f hello.txt"], solution=[{"tool": "write", "path": "hello.txt", "content": "hello\n"}])


def bare_pi_run(runtime, server: ScriptedServer, key: str, config: PiConfig) -> float:
    """One run of Pi exactly as pi-env configures it, minus the sandbox and gateway."""
    root = tempfile.mkdtemp(prefix="pi-bare-")
    try:
        home, work, agent = f"{root}/home", f"{root}/work", f"{root}/home/.pi/agent"
        os.makedirs(agent)
        os.makedirs(work)
        models = {"providers": {config.provider_name: {
            "baseUrl": server.base_url, "api": "openai-completions", "apiKey": key, "compat": OPEN_SERVER_COMPAT,
            "models": [{"id": "pi-env-oracle", "reasoning": False, "input": ["text"], "contextWindow": config.context_window,
                        "maxTokens": config.max_tokens, "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}]}}}
        with open(f"{agent}/models.json", "w") as f:
            json.dump(models, f)
        with open(f"{agent}/settings.json", "w") as f:
            json.dump(HERMETIC_SETTINGS, f)
        with open(f"{root}/prompt.md", "w") as f:
            f.write(TASK.instruction)
        command = [runtime.host_node, runtime.host_cli, "-p", "--model", f"{config.provider_name}/pi-env-oracle",
                   "--session-dir", f"{root}/session", "--tools", "read,bash,edit,write",
                   "-ne", "-nc", "-ns", "-np", "--no-themes"]
        command += [flag for flag in ("-na", "--no-mcp") if runtime.supports(flag)]
        env = {"HOME": home, "TMPDIR": root, "PATH": "/usr/local/bin:/usr/bin:/bin", "PI_CODING_AGENT_DIR": agent,
               "PI_OFFLINE": "1", "PI_TELEMETRY": "0", "PI_SKIP_VERSION_CHECK": "1", "NO_COLOR": "1", "LANG": "C.UTF-8"}
        started = time.perf_counter()
        with open(f"{root}/prompt.md") as prompt:
            done = subprocess.run(command, stdin=prompt, capture_output=True, cwd=work, env=env, timeout=120)
        wall = time.perf_counter() - started
        if done.returncode != 0 or not os.path.exists(f"{work}/hello.txt"):
            raise SystemExit(f"bare Pi run failed: {done.stderr.decode()[-2000:]}")
        return wall
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=12)
    args = parser.parse_args()

    load_before = os.getloadavg()
    config = PiConfig()
    runtime = ensure_runtime(config.pi_package, config.pi_version, config.node_version, config.runtime_cache_dir)
    factory = PiSessionFactory(config)
    server = ScriptedServer().start()
    key = server.add_script(solution_turns(TASK))

    bare_pi_run(runtime, server, key, config)  # warm page cache and both paths once
    with factory.create(TASK) as session:
        session.wait_for_completion()

    bare, full, phases = [], [], []
    for _ in range(args.n):
        bare.append(bare_pi_run(runtime, server, key, config))
        started = time.perf_counter()
        with factory.create(TASK) as session:
            result = session.wait_for_completion()
        full.append(time.perf_counter() - started)  # includes close(): sandbox teardown
        if result.reward != 1.0:
            raise SystemExit(f"rollout failed: {result.error_kind} {result.error}")
        phases.append(result.timings)
    server.stop()

    bare_median, full_median = statistics.median(bare), statistics.median(full)
    phase_medians = {name: round(statistics.median(p.get(name, 0.0) for p in phases) * 1000, 1)
                     for name in phases[0]}
    print(f"{'path':<8} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, values in (("bare", bare), ("pi-env", full)):
        print(f"{name:<8} {statistics.median(values):>9.3f} {min(values):>7.3f} {max(values):>7.3f}")
    print("pi-env phase medians (ms):", phase_medians)
    print(f"ratio pi-env / bare: {full_median / bare_median:.3f} (target <= 1.15)")
    print(json.dumps({"bench": "rollout_overhead", "n": args.n, "pi_version": runtime.pi_version,
                      "node_version": runtime.node_version, "bare_median_s": round(bare_median, 4),
                      "rollout_median_s": round(full_median, 4), "ratio": round(full_median / bare_median, 4),
                      "overhead_ms": round((full_median - bare_median) * 1000, 1), "phase_medians_ms": phase_medians,
                      "runtime_first_install_s": runtime.install_s, "target_ratio": 1.15,
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))


if __name__ == "__main__":
    main()
