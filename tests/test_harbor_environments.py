"""Harbor tasks whose environment needs a build (apt and pip RUN steps, a user added, files
outside the work dir) and a verifier that expects root of a container (it locks /tests and runs
the agent's program as nobody): real rollouts on the local backend (layers) with the oracle
(reward 1.0), with a wrong solution (0.0) and with an environment that cannot be built (never 0)."""

import os
from pathlib import Path

import pytest

from helpers import scripted_config
from pi_env import PiConfig, run_rollout
from pi_env.harbor import load_harbor_task
from pi_env.testing import ScriptedToolCall, ScriptedTurn

HARBOR = Path(__file__).parent.parent / "examples" / "harbor"
pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="environment layers need root (overlay mounts)")]


def bash(command: str) -> ScriptedTurn:
    return ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": command})])


@pytest.mark.parametrize("name", ["column-stats", "locked-tests"])
def test_built_environments_with_the_oracle_score_1(name):
    result = run_rollout(load_harbor_task(HARBOR / name), PiConfig(endpoint="oracle"))
    assert result.error_kind is None, result.error
    assert result.reward == 1.0, [v.stdout[-800:] for v in result.verify_results]
    assert result.environment["layer"] and "approximated by the host's userland" in result.environment["approximated"][0]
    if name == "locked-tests":  # its artifacts, collected after the verifier
        assert "Counter" in result.artifacts["/root/workdir/wordfreq.py"]
        assert '"isolated": true' in result.artifacts["/root/logs/verifier/reward.json"]
    if name == "column-stats":  # its healthcheck ran as setup, in the built environment
        assert "datamash" in result.setup_results[0].cmd and result.setup_results[0].passed


def test_a_wrong_solution_scores_0_in_a_built_environment(server):
    # Prints the mean where the sum belongs: the environment works (datamash, pytest), the answer is wrong.
    key = server.add_script([bash("printf '#!/bin/bash\\ndatamash -t, mean 2 mean 2 max 2 < \"$1\" | tr , \"\\\\n\"\\n' "
                                  "> /root/workdir/stats.sh"), ScriptedTurn(text="done")])
    result = run_rollout(load_harbor_task(HARBOR / "column-stats"), scripted_config(server, key))
    assert result.error_kind is None, result.error
    assert result.reward == 0.0
    assert "passed" in result.verify_results[0].stdout or "failed" in result.verify_results[0].stdout


def test_a_program_that_reads_the_locked_tests_scores_0(server):
    # The program under test tries to read the verifier's answers: as nobody it cannot.
    cheat = ("import sys\\nsys.stdout.write(open('/root/tests/check.py').read()[:0])\\n"
             "print('the 3')\\nprint('and 2')\\nprint('bat 1')\\n")
    key = server.add_script([bash(f"printf '{cheat}' > /root/workdir/wordfreq.py"), ScriptedTurn(text="done")])
    result = run_rollout(load_harbor_task(HARBOR / "locked-tests"), scripted_config(server, key))
    assert result.error_kind is None, result.error
    assert result.reward == 0.0
    assert "passed 0 of 2 isolated True" in result.verify_results[0].stdout


def test_the_agent_never_gets_the_verifiers_capabilities(server):
    key = server.add_script([bash("grep CapEff /proc/self/status; python3 -c 'import os; os.setuid(65534)'; "
                                  "chown 65534 /root/workdir 2>&1; echo end; "
                                  "cat /etc/shadow /etc/machine-id /etc/pip.conf /etc/ssl/private/* 2>&1 | grep -c 'No such file'; "
                                  "ls /etc/passwd /etc/apt >/dev/null && echo layer-etc-visible"),
                             ScriptedTurn(text="done")])
    result = run_rollout(load_harbor_task(HARBOR / "locked-tests"), scripted_config(server, key))
    seen = next(m for m in result.messages if m.get("role") == "tool")["content"]  # as the model was sent it
    seen = seen if isinstance(seen, str) else "".join(part.get("text", "") for part in seen)
    assert "CapEff:\t0000000000000000" in seen
    # The layer's /etc is a pruned copy: no host secret reaches the agent through it.
    assert "layer-etc-visible" in seen and "\n4\n" in seen  # all four missing
    assert "Errno 22" in seen or "Operation not permitted" in seen or "Invalid argument" in seen


def test_an_unbuildable_environment_is_never_scored(tmp_path):
    task = tmp_path / "broken"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Anything.\n")
    (task / "task.toml").write_text("")
    (task / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:24.04\nRUN echo building && no-such-tool --install everything\nWORKDIR /app\n")
    (task / "tests" / "test.sh").write_text("echo 0 > /logs/verifier/reward.txt\n")
    (task / "solution" / "solve.sh").write_text("true\n")
    result = run_rollout(load_harbor_task(task), PiConfig(endpoint="oracle"))
    assert result.reward is None and result.error_kind == "environment_build_failed"
    assert "environment/Dockerfile:2" in result.error and "no-such-tool: not found" in result.error


# -- podman: the same tasks built from the local base image (no image registry here) ---------
PODMAN_BASE = "localhost/pi-env-base:bookworm"


def podman_ready() -> bool:
    import shutil
    import subprocess

    return os.geteuid() == 0 and shutil.which("podman") is not None and subprocess.run(
        ["podman", "image", "exists", PODMAN_BASE], capture_output=True).returncode == 0


needs_podman = pytest.mark.skipif(not podman_ready(), reason=f"needs rootful podman and {PODMAN_BASE} "
                                                             "(scripts/podman_image.sh)")


def on_local_base(tmp_path: Path, name: str) -> Path:
    """The example with its FROM pointed at the locally built base image."""
    import re
    import shutil

    task = tmp_path / name
    shutil.copytree(HARBOR / name, task)
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text(re.sub(r"(?m)^FROM \S+", f"FROM {PODMAN_BASE}", dockerfile.read_text()))
    return task


@needs_podman
@pytest.mark.parametrize("name", ["column-stats", "locked-tests"])
def test_podman_builds_the_dockerfile_and_the_oracle_scores_1(tmp_path, name):
    result = run_rollout(load_harbor_task(on_local_base(tmp_path, name)), PiConfig(endpoint="oracle"), "podman")
    assert result.error_kind is None, result.error
    assert result.reward == 1.0, [v.stdout[-800:] for v in result.verify_results]
    assert result.environment["image"].startswith("localhost/pi-env-env:")


@needs_podman
def test_podman_a_wrong_solution_scores_0(tmp_path, server):
    cheat = "print('the 3')\\nprint('and 2')\\nprint('bat 1')\\n"
    key = server.add_script([bash(f"printf \"{cheat}\" > /root/workdir/wordfreq.py"), ScriptedTurn(text="done")])
    result = run_rollout(load_harbor_task(on_local_base(tmp_path, "locked-tests")), scripted_config(server, key),
                         "podman")
    assert result.error_kind is None, result.error
    assert result.reward == 0.0 and "passed 1 of 2" in result.verify_results[0].stdout


@needs_podman
def test_podman_names_a_base_image_it_cannot_pull(tmp_path):
    task = on_local_base(tmp_path, "locked-tests")
    (task / "environment" / "Dockerfile").write_text("FROM pi-env-test/no-such-image:1.0\nWORKDIR /app\nRUN true\n")
    result = run_rollout(load_harbor_task(task), PiConfig(endpoint="oracle"), "podman")
    assert result.reward is None and result.error_kind == "environment_build_failed"
    assert "base image 'pi-env-test/no-such-image:1.0' (FROM) is not a local image and cannot be pulled" in result.error
