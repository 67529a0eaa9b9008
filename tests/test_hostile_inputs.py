"""The data plane under hostile input (issue 18): bounded reads of task files with errors
naming the file and line, export's rules (the store's: corrupt or duplicated lines reported,
never a bare NaN), trace files private and scrubbed with a retention rule, the scripted/oracle
server keeping nothing per request it was not asked to, and key scrubbing that never corrupts."""

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import scripted_config
from pi_env import PiTask, run_rollout
from pi_env.collect.export import export
from pi_env.collect.store import StoreError
from pi_env.server.rollouts import scrub
from pi_env.task import TaskError, load_tasks
from pi_env.scripted import ScriptedServer, ScriptedToolCall, ScriptedTurn

ROOT = Path(__file__).parent.parent


# -- 8. bounded reads ------------------------------------------------------------------------------------

def pi_env(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pi_env.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_run_dev_zero_is_a_bounded_read_and_a_clear_error():
    started = time.monotonic()
    done = pi_env("run", "/dev/zero", timeout=60)
    assert done.returncode == 2, done
    assert "/dev/zero" in done.stderr and "larger than" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 30


def test_deep_and_non_utf8_task_files_name_the_file_and_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TaskError, match=r"deep.json: JSON nested too deeply"):
        load_tasks(deep)
    shallow_but_deep = tmp_path / "deep2.json"
    shallow_but_deep.write_text(json.dumps({"instruction": "x", "metadata": json.loads("[" * 500 + "]" * 500)}))
    with pytest.raises(TaskError, match=r"deep2.json: JSON nested too deeply"):
        load_tasks(shallow_but_deep)
    jsonl = tmp_path / "set.jsonl"
    jsonl.write_bytes(b'{"instruction": "ok"}\n{"instruction": "caf\xe9"}\n')
    with pytest.raises(TaskError, match=r"set.jsonl:2: not UTF-8"):
        load_tasks(jsonl)
    done = pi_env("run", str(deep))
    assert done.returncode == 2 and "nested too deeply" in done.stderr and "Traceback" not in done.stderr


# -- 9. export: the store's rules ----------------------------------------------------------------------

def record(task_id: str, index: int = 0, reward=1.0) -> dict:
    return {"id": f"{task_id}#{index}", "task_id": task_id, "group_id": task_id, "group_index": index,
            "reward": reward, "scored": reward is not None, "messages": [{"role": "user", "content": "hi"}],
            "tools": "[]", "synthetic": False, "training": None, "turns": [], "model": "m", "mode": "black_box",
            "endpoint": "e", "error_kind": None, "pi_version": "1"}


@pytest.mark.parametrize("line,what", [
    (json.dumps(record("a")), r"results.jsonl:2: record 'a#0' is already in results.jsonl"),
    ("[1, 2]", r"results.jsonl:2: not a pi-env record \(a JSON list\)"),
    ('{"id": "only-an-id#0"}', r"results.jsonl:2: field 'task_id' is missing"),
    (json.dumps({**record("b"), "messages": "not a list"}), r"results.jsonl:2: field 'messages' is a str"),
    (json.dumps({**record("b"), "reward": "1.0"}), r"results.jsonl:2: field 'reward' is a str"),
    (json.dumps(record("b")).replace('"reward": 1.0', '"reward": NaN'), r"results.jsonl:2: not a JSON record"),
    (json.dumps({**record("b"), "messages": [["not", "a", "message"]]}), r"results.jsonl:2: messages\[0\] is not"),
    (json.dumps({**record("b"), "turns": [1]}), r"results.jsonl:2: cannot export record 'b#0' as atif"),
    ('{"id": "x#0", "bad', r"results.jsonl:2: not a JSON record"),
])
def test_export_reports_corrupt_and_duplicated_lines_with_file_and_line(tmp_path, line, what):
    (tmp_path / "results.jsonl").write_text(json.dumps(record("a")) + "\n" + line + "\n")
    formats = ("sft", "atif") if "cannot export" not in what else ("atif",)
    for fmt in formats:
        with pytest.raises(StoreError, match=what):
            export(tmp_path, fmt, keep="all")
        assert not (tmp_path / "exports" / f"{fmt}.jsonl").exists()  # no half export left
    done = pi_env("export", str(tmp_path), "--format", formats[0], "--keep", "all")
    assert done.returncode == 2 and "results.jsonl:2" in done.stderr and "Traceback" not in done.stderr


def test_export_of_a_sound_store_is_strict_json(tmp_path):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(record(t, reward=r)) + "\n"
                                                    for t, r in (("a", 1.0), ("b", None), ("c", 0.5))))
    for fmt in ("sft", "grpo", "atif"):
        target, _, _ = export(tmp_path, fmt, keep="all")
        for text in target.read_text().splitlines():
            json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in {fmt}"))


# -- 6. scrubbing matches every encoding of a key, and only free text is scrubbed ---------------------

@pytest.mark.parametrize("key", ['sk-"quoted"\\back\tslash', "ключ-ü-🔑-secret", "sk-plain-0123456789"])
def test_scrub_matches_every_encoding_of_the_key(key):
    from urllib.parse import quote, quote_plus

    for form in (key, json.dumps(key)[1:-1], json.dumps(key, ensure_ascii=False)[1:-1], repr(key)[1:-1],
                 quote(key, safe=""), quote_plus(key)):
        scrubbed = scrub(f"upstream said: {form} (401)", key)
        assert scrubbed == "upstream said: *** (401)", (form, scrubbed)


def test_the_web_uis_live_log_is_scrubbed_like_a_result():
    """A live log line quotes a model call's upstream error (which may echo the caller's key in
    any encoding): the key is never shown, the rest of the line is."""
    import queue
    from urllib.parse import quote

    from pi_env.results import RolloutEvent, RolloutTurn
    from pi_env.server.web import _drain

    key = 'sk-"ui"\\key-ключ-4242'
    events = queue.SimpleQueue()
    for form in (key, json.dumps(key)[1:-1], quote(key, safe="")):
        events.put(RolloutEvent(kind="turn", elapsed_s=1.0, turn=RolloutTurn(
            turn=0, upstream_status=401, upstream_error=f'{{"error": "invalid key {form}"}}')))
    lines = _drain(events, key)
    assert len(lines) == 3 and all("upstream 401" in line and "invalid key ***" in line for line in lines), lines
    assert "ui" not in "".join(lines).replace("upstream", ""), lines


# -- 4. trace files: private, scrubbed, kept only on purpose -------------------------------------------

def bash(command: str) -> ScriptedTurn:
    return ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": command})])


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_trace_files_are_private_and_deleted_unless_kept(server, tmp_path):
    key = server.add_script([bash("echo hi > a.txt"), ScriptedTurn(text="done")], api_key="sk-trace-0123456789")
    task = PiTask(task_id=f"trace-retention-{os.getpid()}", instruction="write a.txt", verify=["test -f a.txt"])
    kept_dir = tmp_path / "traces"
    result = run_rollout(task, scripted_config(
        server,
        key,
        mode={"name": "transparent_proxy", "trace_dir": str(kept_dir)},
    ))
    trace = Path(result.trace_path)
    assert result.reward == 1.0 and trace.parent == kept_dir and len(trace.read_text().splitlines()) == 2
    assert stat.S_IMODE(kept_dir.stat().st_mode) == 0o700 and stat.S_IMODE(trace.stat().st_mode) == 0o600
    # No trace_dir: the trace is scratch, deleted with the rollout (nothing piles up in /tmp). The
    # scratch dir is shared with every other rollout of this user: only this task's files count.
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"pi-env-traces-{os.getuid()}"
    seen = []
    result = run_rollout(task, scripted_config(server, key, mode="transparent_proxy"),
                         on_event=lambda event: seen.extend(p for p in scratch.glob(f"{task.task_id}-*")))
    assert result.reward == 1.0 and result.trace_path is None
    assert seen, "the scratch trace was never written"  # it existed while the rollout ran ...
    assert not list(scratch.glob(f"{task.task_id}-*")) and stat.S_IMODE(scratch.stat().st_mode) == 0o700


# -- 5. the scripted server keeps nothing per request it was not asked to ------------------------------

def test_the_scripted_server_keeps_requests_bounded_in_bytes_and_the_oracle_keeps_none():
    import urllib.request

    def call(scripted, key, size):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * size}]}).encode()
        request = urllib.request.Request(scripted.base_url + "/chat/completions", body,
                                         {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).read()

    with ScriptedServer(record_bytes=1 << 20) as scripted:
        key = scripted.add_script([ScriptedTurn(text="ok")] * 40)
        for _ in range(20):
            call(scripted, key, 200_000)
        kept = scripted.requests
        assert 3 <= len(kept) <= 5  # ~1 MiB of 200 kB bodies: the newest few, not all twenty
        assert sum(len(json.dumps(r.body)) for r in kept) <= 1 << 20
    from pi_env.oracle import _shared_server

    oracle = _shared_server()
    key = oracle.add_script([ScriptedTurn(text="ok")])
    call(oracle, key, 100_000)
    assert oracle.requests == []
    oracle.remove_script(key)
