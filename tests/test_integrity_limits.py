"""A hostile agent against the host side (issue 12, parts 2, 4 and 6): whatever it does to its
own work dir is its outcome and is scored; the totals it cannot exhaust; the network of a phase
that has one. Real Pi in the real sandbox, driven by the oracle (each solution step is one real
tool call)."""

import json
import subprocess
import sys

import pytest

from pi_env import PiConfig, PiTask, run_rollout
from pi_env.collect import CollectRunner

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

DEEP = "d=deep; for i in $(seq 1200); do d=$d/d; done; mkdir -p $d && echo bottom > $d/f.txt"
# A session-file line that json.loads turns into a lone surrogate (not UTF-8).
SURROGATE = ('printf \'%s\\n\' \'{"type":"message","message":{"role":"user","content":"\\ud800 forged"}}\' '
             '>> "$(ls /root/logs/agent/session/*.jsonl | head -1)"; echo "\\ud800" > escaped.txt')


def oracle_task(task_id: str, command: str, **fields) -> PiTask:
    fields.setdefault("verify", ["test -f done.txt"])
    return PiTask(task_id=task_id, instruction="x", solution=[{"tool": "bash", "command": command + "; touch done.txt"}],
                  **fields)


def assert_scored(result, reward: float = 1.0) -> None:
    assert result.error_kind is None, (result.error_kind, result.error, result.agent_log_tail[-2000:])
    assert result.reward == reward


def test_a_deeply_nested_work_dir_is_scored_and_collected():
    result = run_rollout(oracle_task("deep", DEEP, verify=["test -f done.txt", "test -d deep/d/d/d"]))
    assert_scored(result)
    assert "done.txt" in result.files and not any(path.endswith("f.txt") for path in result.files)


@pytest.mark.parametrize("plant", ["ln -s /tmp tests", "ln -s /etc tests", "echo file > tests",
                                   "mkdir -p tests/test_a.sh && touch tests/test_a.sh/x",
                                   "mkdir tests && ln -s /etc/passwd tests/test_a.sh"])
def test_verify_files_replace_whatever_the_agent_put_in_their_way(plant):
    task = oracle_task("planted", plant, verify=["sh tests/test_a.sh", "test ! -L tests -a -d tests"],
                       verify_files={"tests/test_a.sh": "echo hidden-check-ran; test -f done.txt\n"})
    result = run_rollout(task)
    assert_scored(result)
    assert "hidden-check-ran" in result.verify_results[0].stdout
    # After verify the work dir is the agent's again (what it planted there, set aside for verify, is back).
    assert "hidden-check-ran" not in json.dumps(result.files)
    if plant == "echo file > tests":
        assert result.files["tests"] == "file\n"


def test_lone_surrogates_in_what_the_agent_wrote_become_valid_utf8():
    result = run_rollout(oracle_task("surrogate", SURROGATE))
    assert_scored(result)
    text = result.model_dump_json()  # raised before: surrogates are not UTF-8
    text.encode("utf-8")
    assert all(isinstance(message, dict) for message in result.messages)


def tasks_file(tmp_path, *tasks: PiTask):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(task.model_dump_json() + "\n" for task in tasks))
    return path


HOSTILE = [oracle_task("deep", DEEP), oracle_task("surrogate", SURROGATE),
           oracle_task("symlink", "ln -s /tmp tests", verify_files={"tests/t.sh": "true\n"},
                       verify=["sh tests/t.sh"])]
BENIGN = oracle_task("benign", "echo fine")


def test_run_keeps_every_task_result_after_hostile_ones(tmp_path):
    out = tmp_path / "results.jsonl"
    done = subprocess.run([sys.executable, "-m", "pi_env.cli", "run", str(tasks_file(tmp_path, *HOSTILE, BENIGN)),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task_id"] for r in results] == ["deep", "surrogate", "symlink", "benign"]
    assert [r["reward"] for r in results] == [1.0] * 4


def test_collect_scores_hostile_rollouts_once_and_keeps_the_rest(tmp_path):
    summary = CollectRunner([*HOSTILE, BENIGN], tmp_path / "out", PiConfig(), retries=2,
                            retry_backoff_s=[0]).run()
    assert summary.complete and summary.retried == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["reward"]) for r in records) == [
        ("benign", 1.0), ("deep", 1.0), ("surrogate", 1.0), ("symlink", 1.0)]
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["status"] == "complete"


# --- totals -------------------------------------------------------------------------------


def test_huge_session_files_do_not_balloon_the_host_process(tmp_path):
    """Two 250 MB session files (2.4 GB peak RSS in the pi-env process with three, before reads
    were bounded per rollout by PiConfig.limits.max_read_bytes) and three of 20 MB, together within that
    budget: the agent's transcript gets at most read_budget.TRANSCRIPT_MAX_BYTES of it (parsed,
    the three held 700 MB)."""
    line = '{"type":"message","message":{"role":"user","content":"padding padding padding"}}'
    sizes = [250_000_000] * 2 + [20_000_000] * 3
    fill = "; ".join(f"yes '{line}' | head -c {size} > /root/logs/agent/session/huge-{i}.jsonl"
                     for i, size in enumerate(sizes))  # fmt: skip
    task = oracle_task("huge-session", fill)
    # VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across exec, so a child of a large
    # pytest process would report its parent's size (720 MB late in the suite).
    script = (f"import json; from pi_env import PiTask, run_rollout\n"
              f"result = run_rollout(PiTask.model_validate_json({task.model_dump_json()!r}))\n"
              f"hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
              f"print(json.dumps({{'kind': result.error_kind, 'rss_mb': hwm >> 10}}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    print("peak RSS of the pi-env process with 2 x 250 MB and 3 x 20 MB session files:", figures)
    assert figures["kind"] != "infra" and figures["rss_mb"] < 600


# --- network ------------------------------------------------------------------------------


def test_setup_and_verify_with_network_cannot_reach_host_listeners():
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"host-secret")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    probe = ("python3 -c \"import socket\nfor host in ('127.0.0.1', '10.0.2.2'):\n    try:\n"
             f"        print(socket.create_connection((host, {port}), timeout=3).recv(100))\n"
             "    except OSError as e:\n        print('unreachable', host)\"")
    try:
        task = PiTask(task_id="net", instruction="x", setup=[f"{probe} > /root/setup-probe.txt"],
                      verify=["! grep -q host-secret /root/setup-probe.txt", f"! ({probe} | grep -q host-secret)",
                              "grep -c unreachable /root/setup-probe.txt | grep -qx 2"],
                      verify_network=True, solution=[{"tool": "bash", "command": "true"}])
        result = run_rollout(task)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert_scored(result)
    assert "host-secret" not in result.setup_results[0].stdout


def test_a_tasks_own_limits_reach_its_sandbox():
    write = "head -c 100000000 /dev/zero > big 2> /tmp/err; rc=$?; rm -f big; (echo rc=$rc; cat /tmp/err) > rc.txt"
    task = oracle_task("small-disk", write, limits={"storage_mb": 64},
                       verify=["grep -qx rc=1 rc.txt", "grep -q 'No space left on device' rc.txt"])
    assert_scored(run_rollout(task))
