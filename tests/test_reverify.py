"""pi-env reverify: a dataset collected with --keep-workdir (real Pi, real bubblewrap, the oracle
as the model) scored again without any agent. The same verifiers reproduce every reward; a
changed verifier's changes are reported; a task missing, a work dir over its cap and a hostile
archive are unscored with their reason (never 0); a killed run resumes where it stopped.
Hostile archives are also read without any sandbox (pi_env.verify.workdir)."""

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from pi_env import PiConfig, PiTask
from pi_env.cli import main
from pi_env.collect import CollectError, CollectRunner, reverify
from pi_env.collect.store import read_records
from pi_env.collect.workdirs import workdir_file
from pi_env.verify.workdir import UnsafeArchive, WorkdirLimits, read_archive

CAP = 8 << 10  # keep_workdir_max_bytes of the collect below: the "big" task's work dir is over it


def oracle(task_id: str, command: str, verify: list[str], **extra) -> dict:
    return {"task_id": task_id, "instruction": f"do {task_id}", "verify": verify,
            "solution": [{"tool": "bash", "command": command}], **extra}


TASKS = [
    oracle("pass", "echo 3 > n.txt", ["grep -qx 3 n.txt"]),
    oracle("fail", "echo 4 > n.txt", ["grep -qx 3 n.txt"]),
    oracle("half", "echo a > a.txt", ["test -f a.txt", "test -f b.txt"]),
    oracle("file-reward", "echo 0.25 > score", ["cp score /root/logs/verifier/reward.txt"], reward_file=True),
    # setup's files, the agent's edits of them, an executable, a symlink out, an empty dir, a deep file
    oracle("tree", "echo agent >> base.txt; printf '#!/bin/sh\\necho hi\\n' > run.sh; chmod +x run.sh; "
           "ln -s /etc/hostname host; mkdir -p empty deep/a/b; echo x > deep/a/b/c",
           ["grep -qx setup base.txt && grep -qx agent base.txt", "./run.sh | grep -qx hi",
            "test -L host && test -d empty && test -f deep/a/b/c"],
           setup=["echo setup > base.txt"]),
    # the agent plants a conftest.py that would pass every test: set aside, as in the rollout
    oracle("steer", "printf 'import pytest\\n@pytest.hookimpl(tryfirst=True)\\ndef pytest_runtest_call(item):\\n"
           "    pass\\n' > conftest.py; echo 1 > v.txt",
           ["grep -qx 2 v.txt"]),
    oracle("big", "head -c 20000 /dev/zero > big.bin", ["test -f big.bin"]),
]
EXPECTED = {"pass#0": 1.0, "fail#0": 0.0, "half#0": 0.5, "file-reward#0": 0.25, "tree#0": 1.0, "steer#0": 0.0,
            "big#0": 1.0}

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    config = PiConfig(mode="black_box", result={"keep_workdir": True, "keep_workdir_max_bytes": CAP})
    CollectRunner(TASKS, out, config, concurrency=2).run()
    return out


def results_digest(out: Path) -> str:
    return hashlib.sha256((out / "results.jsonl").read_bytes()).hexdigest()


def lines(path: Path) -> dict[str, dict]:
    return {line["id"]: line for line in map(json.loads, path.read_text().splitlines())}


def test_collect_keeps_each_work_dir_beside_the_dataset_or_says_why_not(dataset):
    records = {r["id"]: r for r in read_records(dataset)}
    assert {i: r["reward"] for i, r in records.items()} == EXPECTED
    for record_id, record in records.items():
        kept = record["workdir"]
        if record_id == "big#0":
            assert not kept["kept"] and f"over the cap of {CAP}" in kept["reason"]
            assert not (dataset / workdir_file(record_id)).exists()
        else:
            assert kept["kept"] and kept["file"] == workdir_file(record_id)
            assert (dataset / kept["file"]).stat().st_size == kept["bytes"]
    tree = {e.path: e for e in read_archive((dataset / workdir_file("tree#0")).read_bytes(), WorkdirLimits())}
    assert tree["base.txt"].data == b"setup\nagent\n" and tree["run.sh"].mode == 0o755
    assert tree["host"].kind == "symlink" and tree["host"].target == "/etc/hostname"
    assert tree["empty"].kind == "dir" and tree["deep/a/b/c"].data == b"x\n"
    assert "data" not in json.dumps(records["tree#0"]["workdir"])  # the archive is never in the record


def test_reverify_with_the_same_verifiers_reproduces_every_reward(dataset):
    before = results_digest(dataset)
    summary = reverify(dataset, TASKS, "same.jsonl")
    assert summary.out == dataset / "same.jsonl" and summary.summary_path == dataset / "same.summary.json"
    got = lines(summary.out)
    assert {i: line["new_reward"] for i, line in got.items() if i != "big#0"} == {
        i: r for i, r in EXPECTED.items() if i != "big#0"}
    assert all(line["changed"] is False for i, line in got.items() if i != "big#0")
    assert got["big#0"]["new_reward"] is None and got["big#0"]["changed"] is None  # never 0
    assert got["big#0"]["error_kind"] == "workdir_not_kept" and "over the cap" in got["big#0"]["error"]
    assert any("conftest.py" in note for note in got["steer#0"]["verify_notes"])  # set aside, as in the rollout
    assert (summary.records, summary.same, summary.changed, summary.unscored) == (7, 6, 0, 1)
    assert summary.unscored_kinds == {"workdir_not_kept": 1}
    assert json.loads(summary.summary_path.read_text())["same"] == 6
    assert results_digest(dataset) == before  # nothing of the dataset overwritten


def test_a_changed_verifier_is_reported_and_a_missing_task_is_not_dropped(dataset, capsys):
    new = [PiTask.coerce(t) for t in TASKS if t["task_id"] != "half"]  # "half" missing from the new set
    new = [t.model_copy(update={"verify": ["grep -qx 4 n.txt"]}) if t.task_id in ("pass", "fail") else t
           for t in new]
    tasks_file = dataset.parent / "fixed.jsonl"
    tasks_file.write_text("".join(t.model_dump_json() + "\n" for t in new))
    code = main(["reverify", str(dataset), "--tasks", str(tasks_file), "--out", "fixed.jsonl", "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "2 changed" in printed and "tasks missing from --tasks: half" in printed
    got = lines(dataset / "fixed.jsonl")
    assert (got["pass#0"]["old_reward"], got["pass#0"]["new_reward"], got["pass#0"]["changed"]) == (1.0, 0.0, True)
    assert (got["fail#0"]["old_reward"], got["fail#0"]["new_reward"], got["fail#0"]["changed"]) == (0.0, 1.0, True)
    assert got["half#0"]["error_kind"] == "task_missing" and got["half#0"]["new_reward"] is None
    summary = json.loads((dataset / "fixed.summary.json").read_text())
    assert summary["missing_tasks"] == ["half"] and summary["changed"] == 2 and summary["same"] == 3


def test_a_killed_run_resumes_and_skips_what_is_done(dataset):
    out = dataset / "resumed.jsonl"
    first = reverify(dataset, TASKS, out)
    assert first.ran == 7
    kept = out.read_text().splitlines()[:4]
    out.write_text("\n".join(kept) + '\n{"id": "tree#0", "new_rew')  # killed mid-write, 3 lines lost
    again = reverify(dataset, TASKS, out)
    assert (again.already_done, again.ran) == (4, 3)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(EXPECTED) and len(ids) == 7  # exactly one line each, the torn one cut
    assert again.same == 6
    assert reverify(dataset, TASKS, out).ran == 0
    with pytest.raises(CollectError, match="never overwrites"):
        reverify(dataset, TASKS, dataset / "results.jsonl")


def test_a_hostile_kept_work_dir_is_unscored_and_nothing_is_written_outside(tmp_path):
    canary = tmp_path / "pwned"
    archive = tar_gz([file_member(f"../../../../../../..{canary}"), file_member("ok.txt")])
    out = tmp_path / "ds"
    out.mkdir()
    record = {"id": "t#0", "task_id": "t", "group_id": "t", "group_index": 0, "messages": [], "reward": 1.0,
              "synthetic": True, "workdir": {"kept": True, "file": workdir_file("t#0"), "bytes": len(archive),
                                             "sha256": hashlib.sha256(archive).hexdigest(), "reason": None}}
    (out / "results.jsonl").write_text(json.dumps(record) + "\n")
    (out / "workdirs").mkdir()
    (out / workdir_file("t#0")).write_bytes(archive)
    task = PiTask(task_id="t", instruction="x", verify=["true"])
    summary = reverify(out, [task], "r.jsonl")
    line = lines(summary.out)["t#0"]
    assert line["error_kind"] == "workdir_unsafe" and line["new_reward"] is None and "'..'" in line["error"]
    assert not canary.exists()
    (out / workdir_file("t#0")).write_bytes(tar_gz([file_member("ok.txt", b"other")]))  # swapped
    line = lines(reverify(out, [task], "r2.jsonl").out)["t#0"]
    assert line["error_kind"] == "workdir_mismatch" and line["new_reward"] is None


# -- archives read without a sandbox ----------------------------------------------------------


def file_member(name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple:
    return name, data, kind, link


def tar_gz(members: list[tuple]) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as compressed, tarfile.open(fileobj=compressed, mode="w|") as tar:
        for name, data, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buffer.getvalue()


@pytest.mark.parametrize("members, why", [
    ([file_member("../x")], "'..'"),
    ([file_member("a/../../x")], "'..'"),
    ([file_member("/etc/passwd")], "not a relative path"),
    ([file_member("link", kind=tarfile.SYMTYPE, link="/etc"), file_member("link/passwd")], "below a file or symlink"),
    ([file_member("link/passwd"), file_member("link", kind=tarfile.SYMTYPE, link="/etc")], "below a file or symlink"),
    ([file_member("hard", kind=tarfile.LNKTYPE, link="/etc/shadow")], "hard link, device or fifo"),
    ([file_member("dev", kind=tarfile.CHRTYPE)], "hard link, device or fifo"),
    ([file_member("fifo", kind=tarfile.FIFOTYPE)], "hard link, device or fifo"),
    ([file_member("a"), file_member("a")], "twice"),
    ([file_member("big", b"y" * 2000)], "more than 1000 bytes"),
    ([file_member(f"f{i}") for i in range(11)], "more than 10 entries"),
])
def test_hostile_archives_are_refused(members, why):
    with pytest.raises(UnsafeArchive, match=why):
        read_archive(tar_gz(members), WorkdirLimits(max_files=10, max_bytes=1000))


def test_a_compression_bomb_stops_at_the_limit_and_junk_is_refused():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("a")
        info.pax_headers = {"comment": "A" * (64 << 20)}  # 64 MiB of header, read before any size check
        tar.addfile(info, io.BytesIO(b""))
    bomb = gzip.compress(buffer.getvalue())
    assert len(bomb) < 1 << 20
    with pytest.raises(UnsafeArchive, match="decompresses past its limit"):
        read_archive(bomb, WorkdirLimits(max_files=10, max_bytes=1 << 20))
    with pytest.raises(UnsafeArchive, match="not a readable tar.gz"):
        read_archive(b"not an archive", WorkdirLimits())
    fine = read_archive(tar_gz([file_member("a/b.txt", b"hi"), file_member("l", kind=tarfile.SYMTYPE, link="../..")]),
                        WorkdirLimits())
    assert [(e.path, e.kind) for e in fine] == [("a/b.txt", "file"), ("l", "symlink")]  # a symlink alone: kept
