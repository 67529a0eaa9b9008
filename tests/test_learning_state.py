"""A learning run carried across machines (pi_env.learning.state): what its packed state holds,
what it leaves out, how it is put back, and the digests its rebuilt checkpoints are checked
against. The rebuild itself (SFT retrained, RL replayed) needs torch: the engine tier checks it
(tests/engines/test_learning_engine.py)."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import pytest

from pi_env.collect.store import read_records
from pi_env.learning import state
from pi_env.learning.pipeline import LearnConfig, score_records


def write_safetensors(directory: Path, tensors: dict[str, bytes], *, metadata=None, reverse=False) -> None:
    """A float32 safetensors file (its layout by hand: an 8-byte header size, the JSON header, the data)."""
    header, data = {}, b""
    for name in sorted(tensors, reverse=reverse):
        header[name] = {"dtype": "F32", "shape": [len(tensors[name]) // 4], "data_offsets": [len(data), len(data) + len(tensors[name])]}
        data += tensors[name]
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    (directory / "config.json").write_text("{}")


TENSORS = {"a.weight": struct.pack("<4f", 1, 2, 3, 4), "b.bias": struct.pack("<2f", 0.5, -1)}


def record(task_id: str, index: int, reward: float | None, *, tokens: int = 50) -> dict:
    return {
        "id": f"{task_id}#{index}",
        "task_id": task_id,
        "group_id": task_id,
        "group_index": index,
        "reward": reward,
        "error_kind": None if reward is not None else "infra",
        "messages": [{"role": "user", "content": "do it"},
                     {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}],
        "tools": [{"name": "bash", "description": "x" * 500}],
        "turns": [{"turn": 0, "latency_s": 1.5, "completion_tokens": 7, "prompt_token_ids": list(range(tokens)),
                   "completion_token_ids": [1, 2, 3], "per_token_logps": [-0.1, -0.2, -0.3]}],
        "training": {"segments": [{"token_ids": list(range(tokens)), "loss_mask": [0] * (tokens - 3) + [1] * 3,
                                   "logprobs": [None] * (tokens - 3) + [-0.1, -0.2, -0.3]}],
                     "turns": [{"turn": 0, "segment": 0}]},
        "wall_s": 9.0,
    }


def store(directory: Path, records: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "metadata.json").write_text('{"kind": "collect"}')
    (directory / ".lock").write_text("")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "tasks").mkdir(parents=True)
    (run / "tasks" / "train.jsonl").write_text('{"task_id": "t"}\n')
    (run / "sft").mkdir()
    (run / "sft" / "summary.json").write_text('{"steps": 3}')
    write_safetensors(run / "sft" / "policy", TENSORS)
    store(run / "eval_sft" / "unseen", [record("u-1", 0, 1.0), record("u-1", 1, 0.0), record("u-2", 0, None)])
    store(run / "rl" / "step_0", [record("r-1", 0, 1.0), record("r-1", 1, 0.0)])
    (run / "rl" / "steps.jsonl").write_text('{"step": 0}\n')
    write_safetensors(run / "rl" / "policy", {**TENSORS, "b.bias": struct.pack("<2f", 0.5, -2)})
    (run / "logs").mkdir()
    (run / "logs" / "vllm-eval_sft.log").write_text("engine chatter\n" * 100)
    (run / "runs_started.txt").write_text("2026-12-06T20:00:44Z start\n")
    (run / "run.pid").write_text("123")
    return run


def test_the_state_keeps_records_without_weights_token_arrays_or_engine_logs(run_dir, tmp_path, monkeypatch):
    packed = state.pack(run_dir, tmp_path / "state")
    files = sorted(str(p.relative_to(tmp_path / "state")) for p in (tmp_path / "state").rglob("*") if p.is_file())
    assert files == ["eval_sft/unseen/metadata.json", "eval_sft/unseen/results.jsonl.gz", "rl/step_0/metadata.json",
                     "rl/step_0/results.jsonl.gz", "rl/steps.jsonl", "runs_started.txt", "sft/summary.json",
                     "tasks/train.jsonl", "weights.json"]
    assert packed["stores"] == 2 and packed["files"] == 7
    # every checkpoint's digest is recorded (the rebuild is checked against it), RL's with its steps
    weights = json.loads((run_dir / "weights.json").read_text())
    assert weights == json.loads((tmp_path / "state" / "weights.json").read_text())
    assert weights["sft/policy"]["sha256"] == state.checkpoint_digest(run_dir / "sft" / "policy")
    assert weights["sft/policy"]["made_on"]["cpu_flags_sha256"]  # what made it, to explain a mismatch
    assert weights["rl/policy"]["steps"] == 1 and weights["rl/policy"]["sha256"] != weights["sft/policy"]["sha256"]

    def unpacked(path):
        return [json.loads(line) for line in gzip.decompress((tmp_path / "state" / path).read_bytes()).splitlines()]

    evals, steps = unpacked("eval_sft/unseen/results.jsonl.gz"), unpacked("rl/step_0/results.jsonl.gz")
    assert [r["reward"] for r in evals] == [1.0, 0.0, None] and evals[0]["messages"][1]["tool_calls"]
    assert "tools" not in evals[0] and "prompt_token_ids" not in evals[0]["turns"][0]
    assert evals[0]["turns"][0]["latency_s"] == 1.5  # what the report reads is kept
    assert evals[0]["training"]["segments"] == [{"length": 50}]  # the trace's shape, not its ids
    assert steps[0]["training"] == record("r-1", 0, 1.0)["training"]  # the replay trains on these: whole
    assert "prompt_token_ids" not in steps[0]["turns"][0]
    full = sum(p.stat().st_size for p in run_dir.rglob("results.jsonl"))
    assert packed["bytes"] < full / 2

    # the same records pack to the same bytes (no time in the gzip header): nothing new to commit
    before = {p: p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file()}
    monkeypatch.setattr(gzip.time, "time", lambda: 2_000_000_000.0)  # packed again, a while later
    state.pack(run_dir, tmp_path / "state")
    assert {p: p.read_bytes() for p in (tmp_path / "state").rglob("*") if p.is_file()} == before


def test_a_restored_run_reads_its_records_and_keeps_what_the_new_machine_began(run_dir, tmp_path):
    state.pack(run_dir, tmp_path / "state")
    other = tmp_path / "other"
    other.mkdir()
    (other / "runs_started.txt").write_text("2026-12-07T08:00:00Z start\n")  # this machine's first line
    (other / "tasks").mkdir()
    (other / "tasks" / "train.jsonl").write_text("this machine's\n")
    assert state.restore(tmp_path / "state", other)["restored"] == 8
    # a file the run directory has is never overwritten; a log it began gets the carried lines in front
    assert (other / "tasks" / "train.jsonl").read_text() == "this machine's\n"
    assert (other / "runs_started.txt").read_text() == "2026-12-06T20:00:44Z start\n2026-12-07T08:00:00Z start\n"
    assert not (other / "sft" / "policy").exists() and not (other / "logs").exists()
    records = list(read_records(other / "eval_sft" / "unseen"))
    assert [r["id"] for r in records] == ["u-1#0", "u-1#1", "u-2#0"]
    scores = score_records(records)  # an eval resumed from restored records scores as before
    assert (scores["passed"], scores["scored"], scores["unscored"], scores["tool_calls"]) == (1, 2, 1, 3)
    assert list(read_records(other / "rl" / "step_0"))[0]["training"]["segments"][0]["token_ids"][:3] == [0, 1, 2]
    # restoring again changes nothing
    snapshot = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    assert state.restore(tmp_path / "state", other)["restored"] == 0
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == snapshot
    # packing an empty run directory into the state loses nothing of it
    (tmp_path / "empty").mkdir()
    state.pack(tmp_path / "empty", tmp_path / "state")
    assert (tmp_path / "state" / "rl" / "step_0" / "results.jsonl.gz").is_file()


def test_the_digest_is_the_tensors_and_a_rebuild_must_match_it(tmp_path):
    write_safetensors(tmp_path / "one", TENSORS)
    write_safetensors(tmp_path / "two", TENSORS, metadata={"format": "pt"}, reverse=True)  # another layout
    assert state.checkpoint_digest(tmp_path / "one") == state.checkpoint_digest(tmp_path / "two")
    changed = dict(TENSORS, **{"b.bias": struct.pack("<2f", 0.5, -1.0000001)})  # one float, one ulp or so
    write_safetensors(tmp_path / "three", changed)
    assert state.checkpoint_digest(tmp_path / "three") != state.checkpoint_digest(tmp_path / "one")
    renamed = {"a.weight2": TENSORS["a.weight"], "b.bias": TENSORS["b.bias"]}
    write_safetensors(tmp_path / "four", renamed)
    assert state.checkpoint_digest(tmp_path / "four") != state.checkpoint_digest(tmp_path / "one")

    run = tmp_path / "run"
    write_safetensors(run / "rl" / "policy", TENSORS)
    digest = state.record_weights(run, "rl/policy", steps=8)
    assert state.check_rebuilt(run, "rl/policy", steps=8) == digest  # rebuilt the same: accepted
    write_safetensors(run / "rl" / "policy", changed)
    with pytest.raises(state.RebuildMismatch, match="rl/policy rebuilt .* not the recorded"):
        state.check_rebuilt(run, "rl/policy", steps=8)
    assert not (run / "rl" / "policy").exists()  # a checkpoint that differs is never left to be served
    # recorded for other steps (a step stopped between its save and its line): recorded anew
    write_safetensors(run / "rl" / "policy", changed)
    assert state.check_rebuilt(run, "rl/policy", steps=7) == state.checkpoint_digest(run / "rl" / "policy")
    assert state.recorded_weights(run)["rl/policy"]["steps"] == 7


def test_the_command_packs_and_restores(run_dir, tmp_path):
    from pi_env.learning.__main__ import main

    assert main(["pack", "--run-dir", str(run_dir), "--state-dir", str(tmp_path / "state")]) == 0
    assert main(["restore", "--run-dir", str(tmp_path / "again"), "--state-dir", str(tmp_path / "state")]) == 0
    assert (tmp_path / "again" / "rl" / "step_0" / "results.jsonl").is_file()
    with pytest.raises(SystemExit):
        main(["pack", "--run-dir", str(run_dir)])  # where to: --state-dir is required
    assert LearnConfig(run_dir=run_dir).n_unseen == 70  # protocol version 3's size is the default
