"""What pi-env costs on top of the agent itself (Pi by default; `--agent NAME` for any agent).

Side by side in one run, interleaved, N times each:
  bare    - the same agent install with the same configuration and command line, run as a plain
            process against the same oracle server (no sandbox, no gateway, no forwarder, no verify);
  pi-env  - a full rollout of the same task (oracle: one write through the agent's own tool, then
            its end; 1 verify command) through the sandbox and the gateway.
Prints medians (wall, and CPU of the agent's processes), the ratio and the per-phase split, and ends
with ONE JSON line. Target: ratio <= 1.15.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time

from pi_env import PiConfig, PiSessionFactory, PiTask
from pi_env.agent.base import AGENT_ROOT, FORWARDER_PATH, LAUNCHER_PATH, AgentRun
from pi_env.oracle import oracle_endpoint
from pi_env.sandbox import SANDBOX_HOME, SANDBOX_WORKDIR, ExecResult

TASK = PiTask(task_id="bench-hello", instruction="Create hello.txt containing hello.",
              verify=["test -f hello.txt"], solution=[{"tool": "write", "path": "hello.txt", "content": "hello\n"}])


class BareHost:
    """What an agent's `prepare` asks of a sandbox (write a file, remove a path, run a command), on
    the host: the run's home is a host dir that the bare run binds at the sandbox's home, and the
    install is bound at the sandbox's path for it, so every path the agent is given (its config's,
    the absolute ones its tools ask for) is the same in both runs. A mount namespace, a few ms;
    no other isolation: the host's network, this user."""

    def __init__(self, home: str, install_root: str):
        self.home, self.install_root = home, install_root

    def path(self, sandbox_path: str) -> str:
        return self.home + sandbox_path[len(SANDBOX_HOME):] if sandbox_path.startswith(SANDBOX_HOME) else sandbox_path

    def wrap(self, argv: list[str]) -> list[str]:
        return ["bwrap", "--dev-bind", "/", "/", "--bind", self.home, SANDBOX_HOME, "--tmpfs", "/opt",
                "--ro-bind", self.install_root, AGENT_ROOT, "--chdir", SANDBOX_WORKDIR, "--", *argv]

    def write_file(self, path: str, content, mode: int | None = None) -> None:
        host = self.path(path)
        os.makedirs(os.path.dirname(host), exist_ok=True)
        with open(host, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)

    def remove(self, path: str) -> None:
        host = self.path(path)
        if os.path.islink(host) or os.path.isfile(host):
            os.unlink(host)
        else:
            shutil.rmtree(host, ignore_errors=True)

    def exec(self, command, timeout_s: float = 60, **_) -> ExecResult:
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        done = subprocess.run(self.wrap(argv), capture_output=True, text=True, timeout=timeout_s,
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SANDBOX_HOME})
        return ExecResult(done.returncode, done.stdout, done.stderr, 0.0)


def cpu_now() -> float:
    """CPU s of this process and every child it has waited for (a sandbox's processes included)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bare(argv: list[str]) -> list[str]:
    """The agent's own command: without the forwarder preload or the launcher in front of it."""
    if len(argv) > 1 and argv[1] == LAUNCHER_PATH:
        argv = argv[2:]
    if "--import" in argv and argv[argv.index("--import") + 1] == FORWARDER_PATH:
        at = argv.index("--import")
        argv = argv[:at] + argv[at + 2:]
    return argv


def bare_run(agent, installed, endpoint, config: PiConfig) -> tuple[float, float]:
    """One run of the agent exactly as pi-env configures it, minus the sandbox and gateway:
    (wall s, CPU s of its processes)."""
    root = tempfile.mkdtemp(prefix="agent-bare-")
    try:
        files = BareHost(f"{root}/home", installed.root)
        work = files.path(SANDBOX_WORKDIR)
        os.makedirs(work)
        run = AgentRun(config, endpoint, endpoint.api_key, TASK.instruction, base_url=endpoint.base_url)
        agent.prepare(files, installed, run)
        argv, env, stdin_path = agent.command(installed, run)

        # No sandbox, gateway or forwarder: the agent's own command against the server (BareHost).
        command = files.wrap(bare(argv))
        env = {"TMPDIR": "/tmp", "LANG": "C.UTF-8", **env, "HOME": SANDBOX_HOME}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        with open(files.path(stdin_path) if stdin_path else os.devnull) as stdin:
            done = subprocess.run(command, stdin=stdin, capture_output=True, env=env, timeout=300)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if not os.path.exists(f"{work}/hello.txt"):
            raise SystemExit(f"bare {agent.name} run failed ({done.returncode}): {command} {(done.stdout + done.stderr).decode()[-2000:]}")
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=12)
    parser.add_argument("--agent", default="pi", help="the agent to measure (pi_env.agent.agent_names())")
    args = parser.parse_args()

    load_before = os.getloadavg()
    config = PiConfig(agent=args.agent)
    factory = PiSessionFactory(config)
    agent, runtime = factory.agent, factory.runtime
    endpoint = oracle_endpoint(TASK, submit_command=agent.submit_command)

    bare_run(agent, runtime, endpoint, config)  # warm page cache and both paths once
    with factory.create(TASK) as session:
        session.wait_for_completion()

    bare_runs, full, full_cpu, phases = [], [], [], []
    for _ in range(args.n):
        bare_runs.append(bare_run(agent, runtime, endpoint, config))
        before = cpu_now()
        started = time.perf_counter()
        with factory.create(TASK) as session:
            result = session.wait_for_completion()
        full.append(time.perf_counter() - started)  # includes close(): sandbox teardown
        full_cpu.append(cpu_now() - before)  # the sandbox's processes and this process (the gateway, verify)
        if result.reward != 1.0:
            raise SystemExit(f"rollout failed: {result.error_kind} {result.error}")
        phases.append(result.timings)
    bare = [wall for wall, _ in bare_runs]
    bare_cpu = statistics.median(cpu for _, cpu in bare_runs)

    bare_median, full_median = statistics.median(bare), statistics.median(full)
    phase_medians = {name: round(statistics.median(p.get(name, 0.0) for p in phases) * 1000, 1)
                     for name in phases[0]}
    print(f"{'path':<8} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, values in (("bare", bare), ("pi-env", full)):
        print(f"{name:<8} {statistics.median(values):>9.3f} {min(values):>7.3f} {max(values):>7.3f}")
    print("pi-env phase medians (ms):", phase_medians)
    print(f"CPU s per run (median): bare {agent.name} {bare_cpu:.3f}, pi-env rollout {statistics.median(full_cpu):.3f}")
    print(f"ratio pi-env / bare: {full_median / bare_median:.3f} (target <= 1.15)")
    print(json.dumps({"bench": "rollout_overhead", "n": args.n, "agent": agent.name, "agent_version": runtime.version,
                      "bare_cpu_median_s": round(bare_cpu, 3),
                      "rollout_cpu_median_s": round(statistics.median(full_cpu), 3), "bare_median_s": round(bare_median, 4),
                      "rollout_median_s": round(full_median, 4), "ratio": round(full_median / bare_median, 4),
                      "overhead_ms": round((full_median - bare_median) * 1000, 1), "phase_medians_ms": phase_medians,
                      "runtime_first_install_s": runtime.install_s, "target_ratio": 1.15,
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))


if __name__ == "__main__":
    main()
