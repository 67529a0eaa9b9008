"""The podman backend against real rootful podman: isolation, limits, cleanup by label, and a
real pi-env rollout in a container. The backend-independent contract is in
test_sandbox_contract.py. Skipped (with the reason) where podman or its image is missing;
`.ci/run` builds the image (scripts/podman_image.sh) and sets PI_ENV_REQUIRE_BACKENDS=podman, so
there a missing podman fails instead."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sandbox_backends import registered

from pi_env import PiConfig, load_tasks, run_rollout
from pi_env.sandbox import SandboxError, SandboxSpec, SandboxUnavailable
from pi_env.sandbox.podman import LABEL_SANDBOX, PodmanBackend

EXAMPLES = {task.task_id: task for directory in ("examples", "examples/harbor")
            for task in load_tasks(Path(__file__).parent.parent / directory)}


@pytest.fixture(scope="module")
def backend() -> PodmanBackend:
    return registered("podman")()


def containers(backend: PodmanBackend, sandbox_id: str) -> list[str]:
    """Every container (running or not) of one sandbox, found by its label."""
    out = subprocess.run([backend.podman, "ps", "--all", "--format", "{{.Names}} {{.State}}",
                          "--filter", f"label={LABEL_SANDBOX}={sandbox_id}"],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_isolation(backend):
    with tempfile.NamedTemporaryFile("w", dir="/root", prefix=".pi-env-podman-secret-") as secret:
        secret.write("TOP-SECRET")
        secret.flush()
        with backend.create(SandboxSpec()) as sb:
            result = sb.exec(f"cat {secret.name} /etc/shadow; ls -a /root; cat /proc/self/status; "
                             "touch /x /etc/x /usr/x; echo x > /tmp/x && echo x > /dev/shm/x && echo ok")
    assert "TOP-SECRET" not in result.stdout and ".pi-env-podman-secret" not in result.stdout
    fields = dict(line.split(":\t", 1) for line in result.stdout.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, cap
    assert fields["NoNewPrivs"].strip() == "1"
    assert result.stderr.count("Read-only file system") == 3 and result.stdout.endswith("ok\n")
    assert "Debian GNU/Linux 12" in sb_release(backend)  # the image's userland, not the host's


def sb_release(backend: PodmanBackend) -> str:
    with backend.create(SandboxSpec()) as sb:
        return sb.exec("cat /etc/os-release").stdout


def test_memory_and_pids_limits(backend):
    from pi_env.sandbox import SandboxLimits

    limits = SandboxLimits(max_memory_bytes=256 << 20, max_processes=50)
    with backend.create(SandboxSpec(limits=limits)) as sb:
        # More than the limit: the cgroup's OOM killer ends it (137), it is not swapped to death.
        result = sb.exec("python3 -c \"x = bytearray(600 << 20); x[::4096] = b'1' * len(x[::4096]); print('alive')\"",
                         timeout_s=120)
        assert result.exit_code != 0 and "alive" not in result.stdout
        assert sb.exec("python3 -c \"x = bytearray(64 << 20); print('fits')\"").stdout == "fits\n"
        result = sb.exec("for i in $(seq 80); do sleep 30 & done 2>&1 | grep -c 'Resource temporarily' ; true",
                         timeout_s=60)
        assert int(result.stdout.strip() or 0) > 0  # the 50-process cap was hit


def test_nothing_left_after_kill_and_close(backend):
    sb = backend.create(SandboxSpec())
    process = sb.start("sleep 1000")
    deadline = time.monotonic() + 60
    while not containers(backend, sb.id):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    process.kill()
    assert containers(backend, sb.id) == []
    sb.start("sleep 1000")
    sb.start("sleep 1001")
    time.sleep(1)
    sb.close()
    assert containers(backend, sb.id) == [] and not os.path.exists(sb.host_dir)


SANDBOX_OWNER = """
import sys, time
from pi_env.sandbox import SandboxSpec
from pi_env.sandbox.podman import PodmanBackend
sandbox = PodmanBackend(root=sys.argv[1]).create(SandboxSpec())
sandbox.start("sleep 300")
print(sandbox.host_dir, sandbox.id, flush=True)
time.sleep(300)
"""


def test_containers_of_a_killed_owner_are_swept(backend, monkeypatch):
    from pi_env.sandbox import owned_dirs

    root = tempfile.mkdtemp(prefix="pi-env-podman-sweep-")
    owner = subprocess.Popen([sys.executable, "-c", SANDBOX_OWNER, root], stdout=subprocess.PIPE, text=True)
    try:
        host_dir, sandbox_id = owner.stdout.readline().split()
        deadline = time.monotonic() + 60
        while not containers(backend, sandbox_id):  # its `sleep 300` container is up
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        owner.kill()  # SIGKILL: no close(), no cleanup
        owner.wait()
    assert containers(backend, sandbox_id) != [] and os.path.isdir(host_dir)
    live = PodmanBackend(root=root).create(SandboxSpec())
    try:
        monkeypatch.setattr(owned_dirs, "STALE_LOCK_AGE_S", 0.0)
        PodmanBackend(root=root)
        assert containers(backend, sandbox_id) == [] and not os.path.exists(host_dir)
        assert live.exec("echo alive").stdout == "alive\n"
    finally:
        live.close()
    assert os.listdir(root) == []
    os.rmdir(root)


def test_missing_podman_says_how_to_fix_it():
    with pytest.raises(SandboxUnavailable, match="apt-get install podman.*scripts/podman_image.sh"):
        PodmanBackend(podman="/nonexistent/podman")


def test_missing_image_says_how_to_build_it(backend):
    with pytest.raises(SandboxUnavailable, match=r"'localhost/pi-env-no-such:image' is missing: "
                                                 r"build it with `scripts/podman_image.sh`"):
        PodmanBackend(image="localhost/pi-env-no-such:image")


@pytest.mark.slow
@pytest.mark.parametrize("task_id", ["fizzbuzz", "word_count_hidden_tests", "fix-palindrome"])
def test_real_rollout_in_a_container(backend, task_id):
    """The real Pi CLI (the host's glibc Node, mounted read-only) runs in the Debian image and
    reaches the model only through the gateway socket."""
    result = run_rollout(EXAMPLES[task_id], PiConfig(sandbox={"backend": "podman"}))
    assert result.error_kind is None, (result.error, result.agent_log_tail)
    assert result.reward == 1.0 and result.synthetic and result.endpoint == "oracle"
    assert all(turn.upstream_status == 200 for turn in result.proxy_turns)
    assert containers(backend, result.sandbox_id) == []


def test_podman_failure_is_a_sandbox_error_not_an_exit_code(backend):
    source = tempfile.mkdtemp(prefix="pi-env-podman-mount-")
    with backend.create(SandboxSpec(ro_mounts={"/opt/x": source})) as sb:
        assert sb.exec("ls /opt/x").exit_code == 0
        os.rmdir(source)  # gone: podman cannot mount it any more
        with pytest.raises(SandboxError, match="podman could not run the command"):
            sb.exec("ls /opt/x")
