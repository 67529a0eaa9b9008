"""Harbor task directories: loading (task.toml, the path map, what the local backend cannot
honour) and real rollouts of the two bundled Harbor examples (oracle = solution/solve.sh;
scripted agents for the other cases)."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from helpers import bash, scripted_config
from pi_env import PiConfig, PiSessionFactory, TaskError, load_tasks, run_rollout
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
    assert {"csv-total", "fix-palindrome", "column-stats", "locked-tests"} <= set(tasks)
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
    summary = CollectRunner([t for t in load_tasks(HARBOR) if t.task_id in ("csv-total", "fix-palindrome")],
                            tmp_path, concurrency=2).run()
    assert summary.complete and summary.counts["scored"] == 2 and not summary.skipped_tasks
    records = {r["task_id"]: r for r in read_records(tmp_path)}
    assert records["csv-total"]["reward"] == 1.0 and records["fix-palindrome"]["reward"] == 1.0
    assert "expected 500.50, got '500.50'" in records["csv-total"]["verify"][0]["output_tail"]
    assert 'reward.json: {"reward": 1.0, "passed": 7, "total": 7}' in records["fix-palindrome"]["verify_notes"]
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
    seen = json.dumps(next(m for m in result.messages if m.get("role") == "tool")["content"])
    assert "No such file or directory" in seen and "no reward written" not in seen
    # No reward file: a 0.0 with the reason (the agent's code, run by test.sh, could cause it), never unscored.
    assert result.reward == 0.0 and result.error_kind is None and result.reward_source == "reward_file"
    assert "missing" in result.verify_notes[-1], result.verify_notes
    assert "no reward written" in result.verify_results[0].stdout  # test.sh did run, after the agent


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_unsupported_environments_are_reported_per_task_and_skipped_by_collect(tmp_path, caplog, server):
    harbor_task(tmp_path, name="plain")
    harbor_task(tmp_path, name="needs-apk", dockerfile="FROM alpine:3.20\nRUN apk add --no-cache jq\nWORKDIR /app\n",
                toml="[environment]\ngpus = 1\n")
    harbor_task(tmp_path, name="needs-apt", dockerfile="FROM ubuntu:24.04\nRUN apt-get update && \\\n"
                                                         "    apt-get install -y jq\nWORKDIR /app\n")
    with caplog.at_level(logging.WARNING, logger="pi_env.harbor"):
        tasks = {t.task_id: t for t in load_tasks(tmp_path)}
    why = unsupported_reasons(tasks["needs-apk"], "local")
    assert any("FROM alpine:3.20: another distribution" in w for w in why)
    assert any("another package manager" in w for w in why) and any("gpus = 1" in w for w in why)
    assert unsupported_reasons(tasks["plain"]) == []
    assert unsupported_reasons(tasks["needs-apt"], "local") == []  # built into a layer
    assert unsupported_reasons(tasks["needs-apt"], "unsafe-local") == [
        "environment/Dockerfile:2: RUN apt-get update && apt-get install -y jq: the unsafe-local backend does not "
        "build environments"]
    assert "needs-apk" in caplog.text and "gpus = 1" in caplog.text

    key = server.add_script([bash("echo hi > hello.txt"), ScriptedTurn(text="done")])
    runnable = [tasks["plain"], tasks["needs-apk"]]
    summary = CollectRunner(runnable, tmp_path / "out", scripted_config(server, key)).run()
    assert [r["task_id"] for r in read_records(tmp_path / "out")] == ["plain"]
    assert summary.skipped_tasks == {"needs-apk": why}
    metadata = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert metadata["skipped_tasks"] == {"needs-apk": why}
    forced = CollectRunner(runnable, tmp_path / "all", scripted_config(server, key), include_unsupported=True)
    assert forced.run().ran == 2
    records = {r["task_id"]: r for r in read_records(tmp_path / "all")}
    assert records["plain"]["reward"] == 1.0
    # forced, an environment not honoured is never scored (and never 0)
    assert records["needs-apk"]["reward"] is None and records["needs-apk"]["error_kind"] == "environment_unsupported"


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_a_forced_rollout_whose_environment_was_not_honoured_is_unscored_even_when_its_tests_pass(tmp_path, server):
    # Nothing stops the sandbox (no build is needed), test.sh writes 1: still no score.
    task = load_harbor_task(harbor_task(tmp_path, name="needs-gpu", toml="[environment]\ngpus = 1\n"))
    key = server.add_script([bash("echo hi > hello.txt"), ScriptedTurn(text="done")])
    result = run_rollout(task, scripted_config(server, key))
    assert result.verify_results[0].passed  # test.sh ran and wrote reward.txt = 1
    assert result.reward is None and result.error_kind == "environment_unsupported" and "gpus = 1" in result.error


@pytest.mark.needs_bwrap
def test_pi_env_run_refuses_an_environment_it_cannot_honour(tmp_path, capsys):
    harbor_task(tmp_path, name="needs-apk", dockerfile="FROM alpine:3.20\nRUN apk add --no-cache jq\nWORKDIR /app\n")
    assert main(["run", str(tmp_path / "needs-apk")]) == 2
    err = capsys.readouterr().err
    assert "cannot honour the environment of 1 task(s)" in err and "RUN apk add --no-cache jq" in err
    assert "--backend podman" in err and "--include-unsupported" in err


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


def test_task_toml_1_4_network_healthcheck_artifacts_and_what_is_refused(tmp_path):
    toml = """schema_version = "1.4"
artifacts = ["/app/out.txt", { source = "/logs/agent", exclude = ["*.tmp"] }]

[environment]
network_mode = "no-network"
os = "windows"

[environment.healthcheck]
command = "test -f /app/ready"
retries = 2

[verifier]
network_mode = "public"
environment_mode = "separate"

[[verifier.collect]]
command = "cp /app/state.db /logs/artifacts/"

[[verifier.collect]]
command = "dump"
service = "db"
"""
    task = load_harbor_task(harbor_task(tmp_path, toml=toml))
    assert not task.setup_network and task.verify_network  # baseline no-network, verifier's own override
    assert task.metadata["harbor"]["artifacts"] == ["/root/workdir/out.txt", "/root/logs/agent"]
    assert "test -f /root/workdir/ready" in task.setup[0]  # Harbor's paths, mapped as everywhere else
    assert task.verify[0].startswith("timeout 60 bash -c 'cp /root/workdir/state.db /root/logs/artifacts/'")
    why = unsupported_reasons(task, "local")
    assert any("os = 'windows'" in w for w in why)
    assert any("separate verifier environment" in w for w in why)
    assert any("service = 'db'" in w for w in why)
    with pytest.raises(TaskError, match="healthcheck needs a command"):
        load_harbor_task(harbor_task(tmp_path, name="bad", toml="[environment.healthcheck]\nretries = 2\n"))


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_a_multi_step_task_runs_each_step_and_combines_the_rewards(server):
    task = load_harbor_task(HARBOR / "text-tool")
    assert "/root/workdir/textstat.py" in task.instruction and "count_lines" in task.instruction
    oracle = run_rollout(task, PiConfig(endpoint="oracle"))
    assert oracle.error_kind is None, oracle.error
    assert oracle.reward == 1.0 and oracle.step_rewards == [1.0, 1.0]  # each step's own solution, then its tests
    assert [v.stdout.split("\n")[0] for v in oracle.verify_results] == ["lines: [True, True, True]",
                                                                       "words: [True, True, True]"]
    # Each step's own workdir/ (step two's setup.sh runs in it, then its healthcheck) and its
    # artifacts, collected after that step: step one's module has no count_words yet.
    assert "NOTES.md" in task.files and "sample.txt" not in task.files  # step two's arrive before its agent
    assert oracle.artifacts["steps/lines/root/workdir/textstat.py"].count("def ") == 1
    assert "def count_words" in oracle.artifacts["steps/words/root/workdir/textstat.py"]
    assert oracle.artifacts["steps/words/root/workdir/sample.txt"] == "the quick brown fox\njumps over\nthe lazy dog\n"
    assert [r.cmd.split(";")[0] for r in oracle.setup_results[-2:]] == ["bash setup.sh", "sleep 0"]
    assert all(r.passed for r in oracle.setup_results)
    assert not unsupported_reasons(task, "local")
    # A wrong first step scores 0 and, below its min_reward, ends the run: step two never starts.
    key = server.add_script([bash("printf 'def count_lines(text):\\n    return -1\\n' > textstat.py"),
                             ScriptedTurn(text="done")])
    wrong = run_rollout(task, scripted_config(server, key))
    assert wrong.error_kind is None and wrong.reward == 0.0 and wrong.step_rewards == [0.0]
    assert "below its min_reward 1.0: later steps skipped" in wrong.agent_log_tail


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_a_step_whose_setup_fails_ends_the_run_there(tmp_path):
    """As in Harbor: step two's setup.sh fails, so its agent never starts; the reward is step
    one's (the steps that ran), and the record says why."""
    task_dir = tmp_path / "text-tool"
    shutil.copytree(HARBOR / "text-tool", task_dir)
    (task_dir / "steps" / "words" / "workdir" / "setup.sh").write_text("echo 'no sample today' >&2\nexit 3\n")
    result = run_rollout(load_harbor_task(task_dir), PiConfig(endpoint="oracle"))
    assert result.error_kind is None, result.error
    assert result.step_rewards == [1.0] and result.reward == 1.0
    assert "step 'words': setup command 'bash setup.sh' exited 3: no sample today" in result.agent_log_tail
    assert not result.setup_results[-1].passed and "steps/words/root/workdir/textstat.py" not in result.artifacts


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_artifacts_are_read_within_the_rollouts_read_budget_and_binary_is_named_not_decoded(tmp_path, server):
    # 200 x 256 KiB of binary data in an artifact folder once made a 157 MB result (RSS 622 MB).
    task = load_harbor_task(harbor_task(tmp_path, toml='artifacts = ["/app/out"]\n'))
    key = server.add_script([
        bash("mkdir -p out && echo 'text kept' > out/a.txt && for i in $(seq 200); do "
             "head -c 262144 /dev/urandom > out/b$i.bin; done"), ScriptedTurn(text="done")])
    result = run_rollout(task, scripted_config(server, key, limits={"max_read_bytes": 8 << 20}))
    assert result.error_kind is None and result.reward == 1.0, result.error
    artifacts = {k.removeprefix("/root/workdir/out/"): v for k, v in result.artifacts.items()}
    assert artifacts["a.txt"] == "text kept\n"
    binary = [v for k, v in artifacts.items() if k.endswith(".bin")]
    assert binary and all(v == "<not collected: binary, 262144 bytes>" for v in binary)
    assert len(binary) <= 32 and len(result.model_dump_json()) < 1 << 20  # 8 MiB read at most, stored as names
