"""SIGTERM (what `timeout`, `kill` and schedulers send) cleans up like Ctrl-C: `pi-env run` and
`pi-env collect`, real subprocesses with a real agent, leave no sandbox dir, no gateway dir and no
sandbox process behind; a gateway dir whose process died anyway (SIGKILL) is swept by the next
gateway, as stale sandbox dirs are."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import processes_of_uid

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
HANGING_TASK = {"task_id": "hang", "instruction": "x", "verify": ["true"],
                "solution": [{"tool": "bash", "command": "touch started; sleep 600"}]}


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def tmp_path():
    """A short one: the gateway's Unix socket path must fit in 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="pi-env-t-", dir="/tmp"))
    path.chmod(0o711)  # sandbox uids must reach the sandbox root inside it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _environment(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tmp").mkdir()
    # TMPDIR: this run's gateway dir (and nobody else's) lands here; its own sandbox root too.
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PI_ENV_SANDBOX_ROOT": str(tmp_path / "sandboxes")}


@pytest.mark.parametrize("command", ["run", "collect"])
def test_sigterm_mid_rollout_leaves_nothing_behind(tmp_path, command):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(HANGING_TASK) + "\n")
    env = _environment(tmp_path)
    extra = ["--out", str(tmp_path / "out"), "--quiet", "--retries", "0"] if command == "collect" else []
    process = subprocess.Popen([sys.executable, "-m", "pi_env.cli", command, str(tasks), *extra], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sandboxes, tmp = tmp_path / "sandboxes", tmp_path / "tmp"
    try:
        home = _wait_for(lambda: next(iter(sandboxes.glob("sb-*/home/workdir/started")), None)
                         or (process.poll() is not None and pytest.fail(process.communicate()[1][-2000:])),
                         120, "the agent to start").parent.parent
        uid = home.stat().st_uid
        assert list(tmp.glob("pi-env-gateway-*")), "no gateway dir to clean up: the test proves nothing"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert [p.name for p in sandboxes.iterdir()] == []  # no sandbox dir, no lock file
    assert [p.name for p in tmp.iterdir() if p.name.startswith("pi-env-gateway-")] == []
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    if os.geteuid() == 0:
        assert processes_of_uid(uid) == []


def test_a_killed_process_gateway_dir_is_swept_by_the_next_gateway(tmp_path):
    env = _environment(tmp_path)
    tmp = tmp_path / "tmp"
    start = "from pi_env.proxy.gateway import get_gateway; print(get_gateway().socket_path, flush=True); input()"
    victim = subprocess.Popen([sys.executable, "-c", start], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    socket_path = Path(victim.stdout.readline().strip())
    victim.kill()  # SIGKILL: no clean-up at all
    victim.wait()
    stale = socket_path.parent
    assert stale.parent == tmp and stale.exists()
    lock = Path(str(stale) + ".lock")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # past the grace period for fresh dirs
    # One that still has a living owner is left alone.
    survivor = subprocess.Popen([sys.executable, "-c", start], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=ROOT)
    try:
        alive = Path(survivor.stdout.readline().strip()).parent
        os.utime(Path(str(alive) + ".lock"), (time.time() - 3600, time.time() - 3600))
        done = subprocess.run([sys.executable, "-c", start], env=env, input="\n", capture_output=True, text=True,
                              cwd=ROOT, timeout=60)
        assert done.returncode == 0, done.stderr
        assert not stale.exists() and not lock.exists()
        assert alive.exists()
    finally:
        survivor.stdin.close()
        survivor.wait(30)
    assert not alive.exists()  # closed cleanly at its exit
