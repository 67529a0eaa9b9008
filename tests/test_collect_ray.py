"""`--executor ray` against a real single-node Ray cluster on 127.0.0.1 (started here with
`ray start --head --block`, stopped by its PID): the same oracle task set gives the same
records as the local executor, made in Ray worker processes, written by the driver alone."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import free_port

from pi_env.collect import CollectRunner
from pi_env.collect.store import read_records

# Read by ray at import: without it a driver turns 127.0.0.1 into the machine's public address,
# where this loopback-only cluster is not listening.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
if ray._private.ray_constants.ENABLE_RAY_CLUSTER:
    pytest.skip("ray was imported before this module could keep its cluster on loopback", allow_module_level=True)
pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).parent.parent
RAY = str(Path(sys.executable).with_name("ray"))


RAY_WORKER_PORTS = range(10002, 20000)  # ports Ray hands its workers: never pick one for a head service


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port(RAY_WORKER_PORTS)
    temp = tmp_path_factory.mktemp("ray")
    log = (temp / "ray-start.log").open("w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
         "--num-cpus", "2", "--include-dashboard", "false", "--dashboard-port", str(free_port(RAY_WORKER_PORTS)),
         "--ray-client-server-port", str(free_port(RAY_WORKER_PORTS)), "--dashboard-agent-listen-port", str(free_port(RAY_WORKER_PORTS)),
         "--temp-dir", str(temp), "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert head.poll() is None, (temp / "ray-start.log").read_text()[-3000:]
            ready = subprocess.run([RAY, "status", "--address", address], env=env, capture_output=True, text=True)
            if ready.returncode == 0 and "CPU" in ready.stdout:
                break
            assert time.monotonic() < deadline, ready.stdout + ready.stderr
            time.sleep(1)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops what it started
        try:
            head.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # its own session: only this cluster's processes
            head.wait(30)
        log.close()


def comparable(record: dict) -> dict:
    keep = ("id", "task_id", "group_id", "group_index", "attempt", "reward", "reward_source", "error_kind",
            "stop_reason", "messages", "tools", "training", "endpoint", "model", "mode", "pi_version", "synthetic")
    out = {k: record[k] for k in keep}
    out["turns"] = [{k: t[k] for k in ("completion_token_ids", "logprobs", "prompt_length", "finish_reason")}
                    for t in record["turns"]]
    return out


def test_ray_executor_gives_the_local_executors_records(ray_cluster, tmp_path):
    tasks = ROOT / "examples"
    local = CollectRunner(tasks, tmp_path / "local", group_size=2, concurrency=2).run()
    remote = CollectRunner(tasks, tmp_path / "ray", group_size=2, concurrency=2, executor="ray",
                           ray_address=ray_cluster).run()
    assert local.complete and remote.complete and remote.ran == local.ran == 8
    local_records = sorted(read_records(tmp_path / "local"), key=lambda r: r["id"])
    ray_records = sorted(read_records(tmp_path / "ray"), key=lambda r: r["id"])
    assert [comparable(r) for r in ray_records] == [comparable(r) for r in local_records]
    assert all(r["reward"] == 1.0 and r["training"]["segments"] for r in ray_records)
    # Made in Ray's worker processes (each with its own gateway), stored by this process alone.
    workers = {r["worker"] for r in ray_records}
    assert all(w.rsplit(":", 1)[1] != str(os.getpid()) for w in workers)
    assert {r["worker"] for r in local_records} == {f"{socket.gethostname()}:{os.getpid()}"}
    metadata = json.loads((tmp_path / "ray" / "metadata.json").read_text())
    assert metadata["runs"][-1]["executor"] == "ray" and metadata["counts"]["records"] == 8


def test_ray_collect_from_the_command_line_resumes_like_local(ray_cluster, tmp_path):
    out = tmp_path / "ds"
    command = [sys.executable, "-m", "pi_env.cli", "collect", str(ROOT / "examples" / "harbor"), "--out", str(out),
               "--executor", "ray", "--ray-address", ray_cluster, "--quiet"]
    first = subprocess.run([*command, "--limit", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    records = list(read_records(out))
    assert sorted(r["id"] for r in records) == sorted(f"{task.name}#0" for task in (ROOT / "examples" / "harbor").iterdir()
                                                     if task.is_dir())
    assert all(r["reward"] == 1.0 for r in records)
