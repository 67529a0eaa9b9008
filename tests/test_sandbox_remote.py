"""What the remote backends add to the sandbox contract (which test_sandbox_contract.py runs
through them): retries on transient transport errors only, the hard lifetime, labels, no leak
on a failed setup, the cached runtime archive. The services are the loopback stand-ins of
pi_env.testing (test doubles) driven by the real SDK clients."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest

from pi_env.sandbox import SandboxError, SandboxSpec
from pi_env.sandbox.remote import JOBS_DIR, LABEL, Retrying, directory_archive

if not (shutil.which("bwrap") and shutil.which("nsenter")):
    pytest.skip("the loopback stand-ins run commands in bubblewrap (and nsenter)", allow_module_level=True)


@pytest.fixture(scope="module")
def fake():
    hub = pytest.importorskip("huggingface_hub")
    pytest.importorskip("huggingface_hub._sandbox")
    from pi_env.testing.fake_hf_sandbox import FakeHfJobs

    with pytest.MonkeyPatch.context() as patch, FakeHfJobs() as jobs:
        patch.setattr(hub.constants, "ENDPOINT", jobs.endpoint)
        yield jobs


def hf_backend(**options):
    from pi_env.sandbox.hf import HfSandboxBackend, transient

    fast = Retrying(transient, attempts=4, base_s=0.05, cap_s=0.2)
    return HfSandboxBackend(token="hf_pi_env_fake", namespace="pi-env-test", retrying=fast, **options)


@pytest.fixture(scope="module")
def fake_e2b():
    pytest.importorskip("e2b")
    from pi_env.testing.fake_e2b import FakeE2B

    with FakeE2B() as fake:
        yield fake


def e2b_backend(fake, **options):
    from pi_env.sandbox.e2b import E2BSandboxBackend, transient

    fast = Retrying(transient, attempts=4, base_s=0.05, cap_s=0.2)
    return E2BSandboxBackend(api_key=fake.api_key, api_url=fake.url, sandbox_url=fake.url, http_version="1.1",
                             retrying=fast, **options)


def test_create_sets_labels_idle_timeout_and_image(fake):
    backend = hf_backend(image="python:3.12", labels={"run": "r1"}, idle_timeout_s=120)
    with backend.create(SandboxSpec()) as sb:
        job = fake.jobs[sb.id]
        labels = job.spec["labels"]
        assert labels[LABEL] == "1" and labels[f"{LABEL}-sandbox"] and labels["run"] == "r1"
        assert job.spec["environment"]["SBX_IDLE_TIMEOUT"] == "120"  # the service stops it when idle
        assert job.spec["dockerImage"] == "python:3.12" and job.spec["flavor"] == "cpu-basic"
        assert "hf_pi_env_fake" not in str(job.spec)  # the HF token never enters the sandbox
        # Commands see none of the sandbox server's environment (its token included).
        assert "SBX_" not in sb.exec("env").stdout
    assert fake.jobs[sb.id].stage == "CANCELED"


def test_transient_errors_are_retried_and_a_command_runs_once(fake, caplog):
    with hf_backend().create(SandboxSpec()) as sb:
        fake.fail_sandbox_requests(sb.id, 503, 3)
        with caplog.at_level(logging.WARNING, logger="pi_env.sandbox.remote"):
            result = sb.exec("echo run >> runs.txt; exit 7")
        assert result.exit_code == 7  # a command's failure is its result, never retried
        assert sb.read_file("runs.txt") == b"run\n"
        assert sum("failed transiently" in r.message for r in caplog.records) == 3

        fake.fail_sandbox_requests(sb.id, 500, 1)  # not transient: an infrastructure error at once
        with pytest.raises(SandboxError, match="500"):
            sb.exec("true")
        fake.fail_sandbox_requests(sb.id, 429, 10)  # transient, but not forever
        with pytest.raises(SandboxError, match="still failing after 4 attempts"):
            sb.exec("true")
        fake.fail_sandbox_requests(sb.id, 429, 0)
        assert sb.exec("echo ok").stdout == "ok\n"


def test_create_retries_the_jobs_api(fake):
    fake.fail_jobs_api[:] = [503, 502]
    with hf_backend().create(SandboxSpec()) as sb:
        assert sb.exec("echo up").stdout == "up\n"
    assert fake.fail_jobs_api == []


def test_lifetime_watchdog_kills_every_command(fake):
    with hf_backend(lifetime_s=3).create(SandboxSpec()) as sb:
        assert sb.exec(f"test -e {JOBS_DIR}/watchdog.sh").exit_code == 0
        process = sb.start("while :; do date +%s%N > beat; sleep 0.1; done")
        result = process.wait(60)  # ended by the watchdog, not by us: killed, exit code unknown
        assert result.exit_code != 0 and not result.timed_out
        first = sb.read_file("beat")
        time.sleep(0.5)
        assert sb.read_file("beat") == first


def test_failed_setup_leaves_no_sandbox_running(fake, tmp_path):
    before = {job.id for job in fake.running()}
    with pytest.raises(FileNotFoundError):
        hf_backend().create(SandboxSpec(ro_mounts={"/opt/x": str(tmp_path / "missing")}))
    assert {job.id for job in fake.running()} == before


def test_runtime_directory_is_one_cached_archive(fake, tmp_path):
    runtime = tmp_path / "runtime"
    (runtime / "bin").mkdir(parents=True)
    (runtime / "bin" / "tool").write_text("#!/bin/sh\necho tool-ok\n")
    os.chmod(runtime / "bin" / "tool", 0o755)
    cache = tmp_path / "cache"
    first = directory_archive(str(runtime), cache)
    assert directory_archive(str(runtime), cache) == first and len(os.listdir(cache)) == 1
    (runtime / "bin" / "tool").write_text("#!/bin/sh\necho tool-v2\n")
    assert directory_archive(str(runtime), cache) != first  # a changed tree is a new archive

    (runtime / "bin" / "tool").write_text("#!/bin/sh\necho tool-v3\n")
    spec = SandboxSpec(ro_mounts={"/opt/pi-env/runtime": str(runtime)}, archive_dir=str(cache))
    with hf_backend().create(spec) as sb:
        assert sb.exec("/opt/pi-env/runtime/bin/tool").stdout == "tool-v3\n"
        assert sb.exec("echo x > /opt/pi-env/runtime/new").exit_code != 0  # read-only for commands
    assert len(os.listdir(cache)) == 3  # the sandbox kept its archive in the spec's archive_dir


def test_e2b_lifetime_is_the_service_timeout_and_metadata_labels_it(fake_e2b):
    backend = e2b_backend(fake_e2b, lifetime_s=900, labels={"run": "r1"}, template="pi-env-runtime")
    with backend.create(SandboxSpec(env={"FROM_SPEC": "1"})) as sb:
        request = fake_e2b.requests[sb.id]
        assert request["timeout"] == 900 and request["templateID"] == "pi-env-runtime"
        assert request["metadata"][LABEL] == "1" and request["metadata"]["run"] == "r1"
        assert request["envVars"] == {}  # spec.env reaches commands only, not the sandbox's envd
        assert sb.exec("echo $FROM_SPEC").stdout == "1\n"
        # No watchdog: E2B ends the sandbox itself at its timeout.
        assert sb.exec(f"test -e {JOBS_DIR}/watchdog.sh").exit_code == 1
    assert sb.id in fake_e2b.killed and sb.id not in fake_e2b.running()


def test_e2b_create_retries_rate_limits_only(fake_e2b):
    fake_e2b.fail_api[:] = [429, 503]
    with e2b_backend(fake_e2b).create(SandboxSpec()) as sb:
        assert sb.exec("echo up").stdout == "up\n"
    fake_e2b.fail_api[:] = [400]
    with pytest.raises(SandboxError, match="400"):
        e2b_backend(fake_e2b).create(SandboxSpec())
    assert fake_e2b.fail_api == []


def test_remote_rollout_reaches_the_host_gateway_by_url(fake, monkeypatch):
    """A whole rollout in an hf sandbox: the Pi runtime arrives as one archive, the agent's
    forwarder reaches the host gateway by URL (the stand-in shares this host's network), the
    gateway records the turns as for any sandbox. Without a gateway URL: unscored, never 0."""
    from pi_env import PiTask, run_rollout
    from pi_env.proxy.gateway import get_gateway

    monkeypatch.delenv("PI_ENV_GATEWAY_URL", raising=False)
    task = PiTask(task_id="remote", instruction="write x", verify=["grep -q hi x.txt"],
                  solution=[{"tool": "write", "path": "x.txt", "content": "hi\n"}])
    refused = run_rollout(task, sandbox_backend=hf_backend())
    assert refused.reward is None and refused.error_kind and "PI_ENV_GATEWAY_URL" in refused.error
    assert fake.running() == []  # closed with the rollout

    url = get_gateway().tcp_base_url.removesuffix("/v1")
    result = run_rollout(task, sandbox_backend=hf_backend(gateway_url=url))
    assert result.error_kind is None, (result.error, result.agent_log_tail)
    assert result.reward == 1.0 and result.stop_reason == "stop"
    assert len(result.proxy_turns) == 2 and all(t.upstream_status == 200 for t in result.proxy_turns)
    assert fake.running() == []
