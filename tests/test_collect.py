"""pi-env collect / export: real Pi, real bubblewrap, the oracle or the scripted server as the
model. The store is checked after a real SIGKILL of a real `pi-env collect` process; exports
are loaded with the real `datasets`; the Hub push goes through huggingface_hub's real client to
a loopback stand-in for the Hub's HTTP API."""

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers import scripted_config
from pi_env import PiConfig, PiTask
from pi_env.collect import CollectError, CollectRunner, KeepFilter
from pi_env.collect.card import front_matter
from pi_env.collect.export import export
from pi_env.collect.records import sft_messages
from pi_env.collect.store import ResultStore, StoreError, read_records
from pi_env.scripted import Fault, ScriptedToolCall, ScriptedTurn
from pi_env.testing.fake_hf_sandbox import QuietJsonHandler

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
PI_ENV = [sys.executable, "-m", "pi_env.cli"]


def slow_tasks(n: int, sleep_s: float = 1.0) -> list[dict]:
    """Oracle tasks that take a little while (so a run can be killed mid-way)."""
    return [{"task_id": f"slow-{i}", "instruction": f"write n{i}.txt",
             "verify": [f"grep -qx {i} n{i}.txt"],
             "solution": [{"tool": "bash", "command": f"sleep {sleep_s}; echo {i} > n{i}.txt"}]} for i in range(n)]


def write_jsonl(path: Path, tasks: list[dict]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def ids(out: Path, kept_only=False) -> list[str]:
    return [r["id"] for r in read_records(out, kept_only=kept_only)]


def test_sigkill_mid_run_then_resume_gives_exactly_one_record_per_task_and_group_index(tmp_path):
    tasks = write_jsonl(tmp_path / "tasks.jsonl", slow_tasks(6))
    out = tmp_path / "ds"
    command = [*PI_ENV, "collect", str(tasks), "--out", str(out), "--group-size", "2", "--concurrency", "2", "--quiet"]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(ids(out)) < 3:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "no records after 120 s"
            time.sleep(0.05)
    finally:
        os.kill(first.pid, signal.SIGKILL)  # by its PID, mid-run: rollouts in flight are lost
        first.wait(30)
    assert first.returncode == -signal.SIGKILL
    stored = ids(out)
    assert 3 <= len(stored) < 12 and len(set(stored)) == len(stored)
    with (out / "results.jsonl").open("ab") as handle:  # what a write cut by a crash leaves
        handle.write(b'{"id": "slow-5#1", "task_id": "slow-5", "rew')

    second = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    records = list(read_records(out))
    keys = sorted((r["task_id"], r["group_index"]) for r in records)
    assert keys == sorted((f"slow-{i}", g) for i in range(6) for g in range(2))  # exact, no duplicates
    assert all(r["reward"] == 1.0 and r["attempt"] == 1 for r in records)
    assert (out / "results.jsonl").read_bytes().endswith(b"\n")
    assert all(line.strip() for line in (out / "results.jsonl").read_text().splitlines())  # no torn line left
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["status"] == "complete" and metadata["counts"]["records"] == 12
    assert metadata["repaired_on_open"] == {"results.jsonl": len(b'{"id": "slow-5#1", "task_id": "slow-5", "rew')}
    assert metadata["runs"][-1]["already_stored"] == len(stored) and metadata["runs"][-1]["ran"] == 12 - len(stored)
    assert "torn tail repaired" in second.stdout


def test_store_refuses_a_second_writer_and_a_damaged_line(tmp_path):
    with ResultStore(tmp_path) as store:
        store.append({"id": "a#0", "x": 1})
        with pytest.raises(StoreError, match="another pi-env collect"):
            ResultStore(tmp_path)
        with pytest.raises(StoreError, match="already stored"):
            store.append({"id": "a#0"})
    (tmp_path / "results.jsonl").write_text('{"id": "a#0"}\nnot json\n{"id": "b#0"}\n')
    with pytest.raises(StoreError, match=r"results.jsonl:2: not a JSON record"):
        ResultStore(tmp_path)


def test_infra_failures_are_retried_and_recorded_low_rewards_are_not(tmp_path, server):
    turns = [ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "echo ok > ok.txt"})]),
             ScriptedTurn(text="done")]
    key = server.add_script([ScriptedTurn(text="x", fault=Fault(http_status=503))])
    tasks = [PiTask(task_id="flaky", instruction="make ok.txt", verify=["test -f ok.txt"]),
             PiTask(task_id="hard", instruction="make missing.txt", verify=["test -f missing.txt"])]

    def heal_after_first_failure():  # the endpoint recovers once the first attempts have failed
        deadline = time.monotonic() + 60
        while len(server.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.add_script(turns, api_key=key)

    healer = threading.Thread(target=heal_after_first_failure)
    healer.start()
    summary = CollectRunner(tasks, tmp_path, scripted_config(server, key, mode="transparent_proxy"), retries=2,
                            concurrency=2, retry_backoff_s=[1.5]).run()
    healer.join()
    records = {r["task_id"]: r for r in read_records(tmp_path)}
    flaky, hard = records["flaky"], records["hard"]
    assert flaky["reward"] == 1.0 and flaky["attempt"] == 2
    assert [a["error_kind"] for a in flaky["failed_attempts"]] == ["endpoint_error"]
    assert hard["reward"] == 0.0 and hard["scored"]  # a low reward is a result, never retried...
    assert hard["attempt"] == 2 and hard["failed_attempts"][0]["error_kind"] == "endpoint_error"  # ...infra was
    assert summary.retried == 2 and summary.counts["retried_attempts"] == 2


def test_infra_failure_past_the_retries_is_stored_unscored_and_masked(tmp_path, server):
    key = server.add_script([ScriptedTurn(text="x", fault=Fault(http_status=502))])
    task = PiTask(task_id="down", instruction="x", verify=["true"])
    summary = CollectRunner([task], tmp_path, scripted_config(server, key), retries=1, retry_backoff_s=[0]).run()
    (record,) = read_records(tmp_path)
    assert record["reward"] is None and not record["scored"] and record["error_kind"] == "endpoint_error"
    assert record["attempt"] == 2 and len(record["failed_attempts"]) == 1
    assert summary.counts["errors"] == {"endpoint_error": 1} and summary.counts["scored"] == 0
    assert export(tmp_path, "sft")[1] == 0  # masked by default
    assert export(tmp_path, "grpo", keep="all")[1] == 0  # never a GRPO sample, whatever the filter


def test_keep_filters_split_results_and_discarded_and_resume_checks_the_settings(tmp_path):
    tasks = [{"task_id": "pass", "instruction": "x", "verify": ["true"], "solution": [{"tool": "bash", "command": "true"}]},
             {"task_id": "half", "instruction": "x", "verify": ["true", "false"],
              "solution": [{"tool": "bash", "command": "true"}]}]
    config = PiConfig(mode="black_box")
    summary = CollectRunner(tasks, tmp_path, config, keep="reward>=1", concurrency=2).run()
    assert ids(tmp_path, kept_only=True) == ["pass#0"]
    assert sorted(ids(tmp_path)) == ["half#0", "pass#0"]  # the filtered one is kept aside, not rerun
    assert summary.counts["kept"] == 1 and summary.counts["records"] == 2
    again = CollectRunner(tasks, tmp_path, config, keep="reward>=1").run()
    assert again.ran == 0 and again.already_stored == 2
    with pytest.raises(CollectError, match="other settings"):
        CollectRunner(tasks, tmp_path, config, keep="all").run()
    with pytest.raises(CollectError, match="already holds 2 records"):
        CollectRunner(tasks, tmp_path, config, keep="reward>=1", resume=False).run()
    with pytest.raises(CollectError, match="--keep 'best'"):
        KeepFilter.parse("best")
    assert KeepFilter.parse("scored")({"reward": 0.0}) and not KeepFilter.parse("scored")({"reward": None})


def test_groups_exports_load_with_datasets_and_the_card_names_the_splits(tmp_path):
    from datasets import load_dataset

    out = tmp_path / "ds"
    summary = CollectRunner(ROOT / "examples", out, group_size=2, concurrency=4).run()  # transparent_proxy
    assert summary.complete and summary.counts["records"] == 8 and summary.counts["mean_reward"] == 1.0
    records = list(read_records(out))
    assert sorted({r["group_index"] for r in records}) == [0, 1]
    assert all(r["group_id"] == r["task_id"] and r["synthetic"] and r["training"] for r in records)

    results = load_dataset("json", data_files=str(out / "results.jsonl"), split="train")
    assert results.num_rows == 8 and set(results["id"]) == {r["id"] for r in records}
    for fmt, rows in (("sft", 8), ("grpo", 8), ("atif", 8)):
        path, written, _ = export(out, fmt)
        assert written == rows
        loaded = load_dataset("json", data_files=str(path), split="train")
        assert loaded.num_rows == rows

    sft = [json.loads(line) for line in (out / "exports" / "sft.jsonl").open()]
    fizz = next(row for row in sft if row["id"] == "fizzbuzz#0")
    roles = [m["role"] for m in fizz["messages"]]
    assert roles[:2] == ["system", "user"] and roles[-1] == "assistant" and "tool" in roles
    call = next(m for m in fizz["messages"] if m.get("tool_calls"))["tool_calls"][0]
    assert call["type"] == "function" and isinstance(json.loads(call["function"]["arguments"]), dict)
    result = next(m for m in fizz["messages"] if m["role"] == "tool")
    assert result["tool_call_id"] == call["id"]
    assert {t["function"]["name"] for t in json.loads(fizz["tools"])} == {"read", "bash", "edit", "write"}

    grpo = [json.loads(line) for line in (out / "exports" / "grpo.jsonl").open()]
    for row in grpo:
        assert len(row["completion_ids"]) == len(row["logprobs"]) == len(row["loss_mask"])
        assert row["loss_mask"][0] == 1 and 0 in row["loss_mask"]  # tool results inside are masked
        assert all(lp is not None for lp, m in zip(row["logprobs"], row["loss_mask"]) if m)
    assert {(row["group_id"], row["group_index"]) for row in grpo} == {(r["task_id"], r["group_index"]) for r in records}

    atif = [json.loads(line) for line in (out / "exports" / "atif.jsonl").open()]
    trajectory = next(t for t in atif if t["session_id"] == "fizzbuzz#0")
    assert trajectory["schema_version"] == "ATIF-v1.8" and trajectory["agent"]["name"] == "pi"
    agent_steps = [s for s in trajectory["steps"] if s["source"] == "agent"]
    record = next(r for r in records if r["id"] == "fizzbuzz#0")
    segment = record["training"]["segments"][0]
    for step, turn in zip(agent_steps, record["turns"]):
        assert step["metrics"]["completion_token_ids"] == turn["completion_token_ids"]
        prompt = step["metrics"]["prompt_token_ids"]
        assert len(prompt) == turn["prompt_length"] and segment["token_ids"][:len(prompt)] == prompt
    assert agent_steps[0]["observation"]["results"][0]["source_call_id"] == agent_steps[0]["tool_calls"][0]["tool_call_id"]

    card = (out / "README.md").read_text()
    import yaml

    meta = yaml.safe_load(card.split("---")[1])
    configs = {c["config_name"]: c["data_files"] for c in meta["configs"]}
    assert configs["default"] == [{"split": "train", "path": "results.jsonl"}]
    assert configs["sft"] == [{"split": "train", "path": "exports/sft.jsonl"}]
    assert set(configs) == {"default", "sft", "grpo", "atif"}
    assert "synthetic" in card
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_store_with_unscored_records_still_loads_with_datasets(tmp_path, server):
    from datasets import load_dataset

    good = server.add_script([ScriptedTurn(text="done")])
    down = server.add_script([ScriptedTurn(text="x", fault=Fault(http_status=500))])
    CollectRunner([PiTask(task_id="ok", instruction="x", verify=["true"])], tmp_path,
                  scripted_config(server, good, mode="transparent_proxy")).run()
    CollectRunner([PiTask(task_id="down", instruction="x", verify=["true"])], tmp_path,
                  scripted_config(server, down, mode="transparent_proxy"), retries=0).run()
    loaded = load_dataset("json", data_files=str(tmp_path / "results.jsonl"), split="train")
    assert sorted(zip(loaded["id"], loaded["scored"])) == [("down#0", False), ("ok#0", True)]


def test_collect_runner_works_inside_a_running_event_loop(tmp_path):
    tasks = slow_tasks(2, sleep_s=0)
    seen = []

    async def main():
        first = CollectRunner(tasks[:1], tmp_path / "a", progress=lambda record, stats: seen.append(record["id"])).run()
        second = await CollectRunner(tasks, tmp_path / "b").arun()
        return first, second

    first, second = asyncio.run(main())
    assert first.ran == 1 and seen == ["slow-0#0"] and second.ran == 2


def test_oracle_skips_tasks_without_a_solution_and_bad_input_exits_2(tmp_path):
    tasks = write_jsonl(tmp_path / "t.jsonl", [{"task_id": "nosol", "instruction": "x", "verify": ["true"]}])
    done = subprocess.run([*PI_ENV, "collect", str(tasks), "--out", str(tmp_path / "o"), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "skipped nosol: no solution" in done.stdout.replace("\n", " ")
    bad = subprocess.run([*PI_ENV, "collect", str(tasks), "--out", str(tmp_path / "p"), "--keep", "best"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--keep 'best'" in bad.stderr


def test_sft_messages_from_the_gateway_conversation():
    sent = [{"role": "system", "content": "You are Pi."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok ", "reasoning_content": "hmm",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
            {"role": "assistant", "content": "done"}]
    tools = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}}}]
    messages, schemas = sft_messages(sent, tools)
    assert messages == [
        {"role": "system", "content": "You are Pi."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok ", "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "bash", "content": "a.txt"},
        {"role": "assistant", "content": "done"}]
    assert schemas == tools


class _FakeHub(QuietJsonHandler):
    """The Hub's HTTP API as huggingface_hub's client uses it to create a dataset repo and
    commit files (regular uploads): enough to see exactly what would be uploaded."""

    calls: list = []
    files: dict = {}

    @property
    def base(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.calls.append((self.path, self.headers.get("Authorization"), body))
        if self.path == "/api/repos/create":
            request = json.loads(body)
            return self._send(200, {"url": f"{self.base}/datasets/{request['organization']}/{request['name']}"})
        if self.path == "/api/validate-yaml":  # the Hub checks the card's metadata before the commit
            import yaml

            request = json.loads(body)
            meta = yaml.safe_load(request["content"].split("---")[1])
            ok = request["repoType"] == "dataset" and isinstance(meta, dict) and isinstance(meta.get("configs"), list)
            return self._send(200 if ok else 400, {} if ok else {"errors": [{"message": "bad card metadata"}]})
        if "/preupload/" in self.path:
            paths = [f["path"] for f in json.loads(body)["files"]]
            return self._send(200, {"files": [{"path": p, "uploadMode": "regular", "shouldIgnore": False} for p in paths]})
        if "/commit/" in self.path:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self._send(200, {"commitUrl": f"{self.base}/datasets/me/pi-data/commit/abc123", "commitOid": "abc123",
                                    "pullRequestUrl": None})
        return self._send(404, {"error": f"stand-in: no route for POST {self.path}"})

    def do_GET(self):
        self.calls.append((self.path, self.headers.get("Authorization"), b""))
        return self._send(404, {"error": f"stand-in: no route for GET {self.path}"})


def test_push_to_hub_uploads_the_dataset_through_huggingface_hub(tmp_path):
    hub = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        tasks = write_jsonl(tmp_path / "t.jsonl", slow_tasks(2, sleep_s=0))
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_address[1]}", "HF_TOKEN": "hf_standin",
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        out = tmp_path / "ds"
        done = subprocess.run([*PI_ENV, "collect", str(tasks), "--out", str(out), "--quiet", "--push-to-hub",
                               "me/pi-data", "--private"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    finally:
        hub.shutdown()
        hub.server_close()
    assert done.returncode == 0, done.stderr
    assert f"pushed: {env['HF_ENDPOINT']}/datasets/me/pi-data/commit/abc123" in done.stdout
    create = next(json.loads(body) for path, _, body in _FakeHub.calls if path == "/api/repos/create")
    assert create == {**create, "name": "pi-data", "organization": "me", "type": "dataset", "visibility": "private"}
    assert all(auth == "Bearer hf_standin" for _, auth, _ in _FakeHub.calls)
    assert set(_FakeHub.files) == {"results.jsonl", "metadata.json", "README.md", "report.png"}
    assert _FakeHub.files["results.jsonl"] == (out / "results.jsonl").read_bytes()
    assert front_matter(out) in _FakeHub.files["README.md"].decode()
    assert b"api_key" not in _FakeHub.files["metadata.json"]


def test_an_aborted_local_run_closes_the_rollouts_in_flight_at_once():
    from pi_env.collect.executors import Job, LocalExecutor

    executor = LocalExecutor(PiConfig(), concurrency=2)
    for task in slow_tasks(2, sleep_s=120):
        executor.submit(Job(PiTask.model_validate(task), 0))
    time.sleep(8)  # both agents are sleeping inside their sandboxes
    started = time.monotonic()
    executor.close(wait=False)  # what Ctrl-C or an error in the driver does
    outcomes = [executor.next_done(30) for _ in range(2)]
    assert time.monotonic() - started < 30
    assert [o[1].error_kind for o in outcomes] == ["infra", "infra"]  # never stored: a resume runs them again


def test_bad_input_stops_the_run_before_any_rollout_starts(tmp_path):
    from pi_env.endpoints import EndpointError

    with pytest.raises(EndpointError, match="unknown endpoint 'nowhere'"):
        CollectRunner(slow_tasks(2, sleep_s=0), tmp_path, PiConfig(endpoint="nowhere"), progress=False).run()
    assert ids(tmp_path, kept_only=False) == []


def test_a_raising_rollout_is_infra_for_the_sandbox_runtime_or_os_else_internal_with_its_traceback():
    """The one rule `pi-env run`, collect and reverify share (rollout.unscored_by): never a score."""
    from pi_env.agent.runtime import RuntimeInstallError
    from pi_env.rollout import unscored_by
    from pi_env.sandbox import SandboxError

    cases = [(SandboxError("bwrap died"), "infra"), (RuntimeInstallError("npm failed"), "infra"),
             (OSError(24, "Too many open files"), "infra"), (KeyError("turns"), "internal")]
    for error, kind in cases:
        try:
            raise error
        except Exception as raised:
            result = unscored_by("t", raised)
        assert (result.task_id, result.error_kind, result.reward) == ("t", kind, None), error
        assert result.error.startswith(type(error).__name__)
        assert ("Traceback" in result.error) == (kind == "internal")


def test_a_bug_inside_a_rollout_is_internal_not_retried_and_shown(tmp_path, monkeypatch, capsys):
    """An unexpected exception (here a ValueError planted in scoring, as pydantic raises) is
    `internal`: it neither aborts the run as bad input nor is retried as infrastructure; each
    record keeps the traceback, and the summary counts it apart."""
    from pi_env.collect.report import print_summary
    from pi_env.rollout import phases

    def buggy_score(ctx):
        raise ValueError("1 validation error for RolloutResult")

    monkeypatch.setattr(phases, "score", buggy_score)
    summary = CollectRunner(slow_tasks(2, sleep_s=0), tmp_path, PiConfig(mode="transparent_proxy"), retries=2,
                            retry_backoff_s=[0], progress=False).run()
    records = list(read_records(tmp_path, kept_only=False))
    assert len(records) == 2  # the run went on
    for record in records:
        assert record["error_kind"] == "internal" and record["reward"] is None and record["attempt"] == 1
        assert "ValueError: 1 validation error" in record["error"] and "buggy_score" in record["error"]
    assert summary.retried == 0 and summary.counts["errors"] == {"internal": 2}
    print_summary(summary)
    assert "internal 2: a bug in pi-env" in capsys.readouterr().out.replace("\n", " ")
