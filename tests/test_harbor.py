"""Harbor task directories: loading (task.toml, the path map, what the local backend cannot
honour) and real rollouts of the two bundled Harbor examples (oracle = solution/solve.sh;
scripted agents for the other cases)."""

import json
import logging
from pathlib import Path

import pytest

from helpers import bash, scripted_config
from pi_env import PiSessionFactory, TaskError, load_tasks, run_rollout
from pi_env.cli import main
from pi_env.collect import CollectRunner
from pi_env.collect.store import read_records
from pi_env.harbor import load_harbor_task, unsupported_reasons
from pi_env.scripted import ScriptedTurn

ROOT = Path(__file__).parent.parent
HARBOR = ROOT / "examples" / "harbor"


def harbor_task(tmp_path: Path, *, toml: str = "", dockerfile: str = "FROM ubuntu:24.04\nWORKDIR /app\n",
                test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", name: str = "t") -> Path:
    task = tmp_path / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "instruction.md").write_text("Create /app/hello.txt.\n")
    (task / "task.toml").write_text(toml)
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "tests" / "test.sh").write_text(test_sh)
    return task


def test_examples_load_with_harbor_semantics():
    tasks = {t.task_id: t for t in load_tasks(HARBOR)}
    assert set(tasks) == {"csv-total", "fix-palindrome"}
    csv = tasks["csv-total"]
    assert (csv.timeouts.agent_s, csv.timeouts.verify_s, csv.timeouts.setup_s) == (300.0, 60.0, 120.0)
    assert csv.files == {"sales.csv": (HARBOR / "csv-total/environment/sales.csv").read_text()}  # COPY'd
    assert set(csv.verify_files) == {".harbor/tests/test.sh", ".harbor/tests/test_total.py"}  # after the agent
    assert "/root/workdir/total.py" in csv.instruction and "/app" not in csv.instruction
    assert "/root/logs/verifier/reward.txt" in csv.verify_files[".harbor/tests/test.sh"]
    assert csv.metadata["harbor"]["unsupported"] == [] and csv.metadata["difficulty"] == "easy"
    assert not csv.verify_network  # Harbor's default network for the verifier is not granted silently
    assert any("verifier runs offline" in note for note in csv.metadata["harbor"]["notes"])
    assert tasks["fix-palindrome"].files == {"palindrome.py": (HARBOR / "fix-palindrome/environment/palindrome.py").read_text()}
    assert load_tasks(HARBOR / "csv-total")[0].task_id == "csv-total"  # one task dir works too


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_examples_end_to_end_with_the_oracle(tmp_path):
    summary = CollectRunner(HARBOR, tmp_path, concurrency=2).run()
    assert summary.complete and summary.counts["scored"] == 2 and not summary.skipped_tasks
    records = {r["task_id"]: r for r in read_records(tmp_path)}
    assert records["csv-total"]["reward"] == 1.0 and records["fix-palindrome"]["reward"] == 1.0
    assert "expected 500.50, got '500.50'" in records["csv-total"]["verify"][0]["output_tail"]
    assert 'reward.json: {"reward": 1.0, "passed": 7, "total": 7}' in records["fix-palindrome"]["verify"][0]["output_tail"]
    solve = (HARBOR / "csv-total" / "solution" / "solve.sh").read_text().replace("/app", "/root/workdir")
    call = next(m for m in records["csv-total"]["messages"] if m.get("tool_calls"))["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"command": solve}  # the oracle ran solve.sh


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_an_agent_that_does_nothing_scores_what_the_tests_say(server):
    key = server.add_script([ScriptedTurn(text="I did nothing.")])
    by_id = {t.task_id: t for t in load_tasks(HARBOR)}
    csv = run_rollout(by_id["csv-total"], scripted_config(server, key))
    palindrome = run_rollout(by_id["fix-palindrome"], scripted_config(server, key))
    assert csv.reward == 0.0 and csv.reward_source == "reward_file"  # reward.txt: 0
    assert palindrome.reward == pytest.approx(5 / 7)  # reward.json's "reward": the buggy code passes 5 of 7


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_the_agent_never_sees_the_tests_and_cannot_forge_reward_json(tmp_path, server):
    task = load_harbor_task(harbor_task(tmp_path, test_sh="echo 'no reward written'\n"))
    key = server.add_script([
        bash("ls -a; ls /root/tests /root/workdir/.harbor 2>&1; cat /root/tests/test.sh 2>&1"),
        bash("mkdir -p /root/logs/verifier && echo '{\"reward\": 1.0}' > /root/logs/verifier/reward.json"),
        ScriptedTurn(text="done")])
    with PiSessionFactory(scripted_config(server, key)).create(task) as session:
        result = session.wait_for_completion()
    seen = next(m for m in result.messages if m.get("role") == "toolResult")["content"][0]["text"]
    assert "No such file or directory" in seen and "no reward written" not in seen
    assert result.reward is None and result.error_kind == "invalid_reward"  # unscored, never 0
    assert "no reward file" in result.error
    assert "no reward written" in result.verify_results[0].stdout  # test.sh did run, after the agent


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_unsupported_environments_are_reported_per_task_and_skipped_by_collect(tmp_path, caplog, server):
    harbor_task(tmp_path, name="plain")
    harbor_task(tmp_path, name="needs-apt",
                dockerfile="FROM ubuntu:24.04\nRUN apt-get update && \\\n    apt-get install -y jq\nWORKDIR /app\n"
                           "COPY data.bin /opt/data.bin\n",
                toml="[environment]\ngpus = 1\n")
    (tmp_path / "needs-apt" / "environment" / "data.bin").write_bytes(b"\x00\xff")
    with caplog.at_level(logging.WARNING, logger="pi_env.harbor"):
        tasks = {t.task_id: t for t in load_tasks(tmp_path)}
    why = unsupported_reasons(tasks["needs-apt"])
    assert any(w.startswith("environment/Dockerfile:2: RUN apt-get update && apt-get install -y jq") for w in why)
    assert any("outside the work dir" in w for w in why) and any("gpus = 1" in w for w in why)
    assert unsupported_reasons(tasks["plain"]) == []
    assert "needs-apt" in caplog.text and "RUN apt-get" in caplog.text

    key = server.add_script([bash("echo hi > hello.txt"), ScriptedTurn(text="done")])
    summary = CollectRunner(list(tasks.values()), tmp_path / "out", scripted_config(server, key)).run()
    assert [r["task_id"] for r in read_records(tmp_path / "out")] == ["plain"]
    assert summary.skipped_tasks == {"needs-apt": why}
    metadata = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert metadata["skipped_tasks"] == {"needs-apt": why}
    assert CollectRunner(list(tasks.values()), tmp_path / "all", scripted_config(server, key),
                         include_unsupported=True).run().ran == 2


@pytest.mark.parametrize("toml, message", [
    ("[agent]\ntimeout_sec = -5\n", "timeout_sec = -5; give a positive number of seconds"),
    ("agent = 3\n", r"\[agent\] must be a table"),
    ("[verifier\n", "not valid TOML"),
    ("[verifier]\nenv = { \"1BAD\" = \"x\" }\n", "'1BAD' is not a valid variable name"),
    ("[environment]\nmemory_mb = 1.5\n", "memory_mb = 1.5; give a positive whole number of MB"),
    ("[environment]\nstorage = \"lots\"\n", "storage = 'lots'; give a size such as"),
])
def test_bad_task_toml_names_what_to_fix(tmp_path, toml, message):
    with pytest.raises(TaskError, match=message):
        load_harbor_task(harbor_task(tmp_path, toml=toml))


@pytest.mark.parametrize("environment, limits", [
    ("memory_mb = 512\nstorage_mb = 20480\n", {"memory_mb": 512, "storage_mb": 20480}),
    ("memory = \"2G\"\nstorage = \"512Mi\"\n", {"memory_mb": 2048, "storage_mb": 512}),
    ("cpus = 2\n", {"memory_mb": None, "storage_mb": None}),
])
def test_memory_and_storage_become_the_sandbox_totals(tmp_path, environment, limits):
    task = load_harbor_task(harbor_task(tmp_path, toml=f"[environment]\n{environment}"))
    assert task.limits.model_dump() == limits


def test_missing_test_sh_and_empty_directories_are_clear_errors(tmp_path):
    task = harbor_task(tmp_path)
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match="tests/test.sh is missing"):
        load_harbor_task(task)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="no \\*.json task files and no Harbor task"):
        load_tasks(tmp_path / "empty")


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_pi_env_run_takes_a_harbor_directory(capsys):
    assert main(["run", str(HARBOR / "fix-palindrome"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["task_id"] == "fix-palindrome" and result["reward"] == 1.0
