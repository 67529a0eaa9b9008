"""pi_env.workspace: the four tools over a bounded workspace, programs run for real in the local
bubblewrap sandbox (python3, node), hostile programs, the reward table on concrete
conversations, the task families and splits, the prompt and the plain-Python loop API."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pi_env.workspace import (
    FAMILIES,
    RESULT_SCHEMA,
    SplitOverlapError,
    WorkspaceEnv,
    WorkspaceLimits,
    WorkspaceTask,
    available_languages,
    check_disjoint,
    generate_tasks,
    make_splits,
    score,
)
from pi_env.workspace.oracle import oracle_turns, reference_program
from pi_env.workspace.tools import Workspace

needs_bwrap = pytest.mark.needs_bwrap
HAVE_JULIA = "julia" in available_languages()


def make_task(language="python", expected=42, files=None, **extra) -> WorkspaceTask:
    ext = {"python": ".py", "javascript": ".js", "julia": ".jl"}[language]
    return WorkspaceTask(task_id="t", family="handmade", language=language, question="What is 6*7?",
                         files=files if files is not None else {"data.txt": "6 7\n"},
                         program="solution" + ext, expected=expected, **extra)


def run_conversation(env: WorkspaceEnv, turns: list[dict]) -> list[dict]:
    """Play assistant turns against the env the way a trainer loop does."""
    messages = env.initial_messages()
    for turn in turns:
        messages.append(turn)
        for call in turn.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": env.call(call["function"]["name"], call["function"]["arguments"])})
    return messages


def tool_msg(tool: str, status: str, **fields) -> dict:
    return {"role": "tool", "content": json.dumps({"schema": RESULT_SCHEMA, "tool": tool, "status": status, **fields})}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------------------------------------
# read / write / edit


def test_read_write_edit_success_paths():
    ws = Workspace(make_task())
    read = ws.read("data.txt")
    assert read == {"schema": RESULT_SCHEMA, "tool": "read", "status": "ok", "path": "data.txt",
                    "content": "6 7\n", "bytes": 4, "truncated": False}
    wrote = ws.write("sub/dir/x.py", "print('héllo')\n")
    assert wrote["status"] == "ok" and wrote["bytes_written"] == len("print('héllo')\n".encode())
    assert ws.read("./sub/dir/x.py")["content"] == "print('héllo')\n"  # "./" is normalised
    edited = ws.edit("sub/dir/x.py", "héllo", "bye")
    assert edited["status"] == "ok" and ws.files["sub/dir/x.py"] == "print('bye')\n"
    assert ws.authored == {"sub/dir/x.py"}
    ws.close()


def test_read_truncates_to_the_limit_and_reports_it():
    ws = Workspace(make_task(files={"big.txt": "x" * 100}), limits=WorkspaceLimits(read_chars=10))
    result = ws.read("big.txt")
    assert result["content"] == "x" * 10 and result["truncated"] is True and result["bytes"] == 100


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "a/../b", "", "   ", ".", "./", "~/x",
                                  "a\x00b", "dir/", "a\nb", "x" * 300])
def test_paths_outside_or_not_naming_a_file_are_refused(path):
    ws = Workspace(make_task())
    for result in (ws.read(path), ws.write(path, "x"), ws.edit(path, "6", "7")):
        assert result["status"] == "error", (path, result)
        assert result["error"]
    assert ws.files == {"data.txt": "6 7\n"} and ws.authored == set()


def test_write_bounds_file_size_count_and_total():
    ws = Workspace(make_task(), limits=WorkspaceLimits(max_file_bytes=10, max_files=3, max_total_bytes=20))
    assert "at most 10" in ws.write("a.txt", "x" * 11)["error"]
    assert ws.write("a.txt", "x" * 10)["status"] == "ok"
    assert "limit is 20" in ws.write("b.txt", "x" * 10)["error"]  # 4 + 10 + 10 > 20
    assert ws.write("b.txt", "x" * 6)["status"] == "ok"
    assert "already holds 3 files" in ws.write("c.txt", "x")["error"]
    assert ws.write("a.txt", "short")["status"] == "ok"  # replacing an existing file is fine
    assert "UTF-8" in ws.write("d.txt", "\udcff")["error"]  # a lone surrogate is not text


def test_edit_requires_exactly_one_match():
    ws = Workspace(make_task(files={"f.txt": "aa b aa\n"}))
    assert "occurs 2 times" in ws.edit("f.txt", "aa", "c")["error"]
    assert "not found" in ws.edit("f.txt", "zz", "c")["error"]
    assert "empty" in ws.edit("f.txt", "", "c")["error"]
    assert "write it first" in ws.edit("missing.txt", "a", "b")["error"]
    assert ws.files["f.txt"] == "aa b aa\n" and not ws.authored
    assert ws.edit("f.txt", "b", "c")["status"] == "ok" and ws.files["f.txt"] == "aa c aa\n"


def test_read_missing_file_lists_what_exists():
    result = Workspace(make_task()).read("nope.txt")
    assert result["status"] == "error" and "data.txt" in result["error"]


@pytest.mark.parametrize("name, args, fragment", [
    ("rm", {"path": "x"}, "unknown tool"),
    ("read", {}, "missing argument 'path'"),
    ("read", {"path": "data.txt", "limit": 3}, "unknown argument 'limit'"),
    ("write", {"path": "x", "content": 5}, "'content' must be a string"),
    ("read", "{not json", "not valid JSON"),
    ("read", "[1]", "must be a JSON object"),
])
def test_bad_tool_calls_are_errors_naming_the_problem(name, args, fragment):
    result = Workspace(make_task()).call(name, args)
    assert result["status"] == "error" and fragment in result["error"], result


def test_call_accepts_json_text_arguments():
    ws = Workspace(make_task())
    assert ws.call("read", '{"path": "data.txt"}')["content"] == "6 7\n"


# ---------------------------------------------------------------------------------------------
# bash: real runs in the sandbox


@needs_bwrap
@pytest.mark.parametrize("language, program", [
    ("python", "a, b = map(int, open('data.txt').read().split())\nprint('working')\nprint(a * b)\n"),
    ("javascript", "const [a, b] = require('fs').readFileSync('data.txt', 'utf8').trim().split(' ').map(Number);\n"
                   "console.log('working');\nconsole.log(a * b);\n"),
])
def test_bash_runs_the_program_in_the_sandbox(language, program):
    with Workspace(make_task(language)) as ws:
        name = ws.task.program
        assert ws.write(name, program)["status"] == "ok"
        result = ws.bash(ws.task.command)
        assert result["status"] == "ok", result
        assert result["returncode"] == 0 and result["timed_out"] is False
        assert result["stdout"] == "working\n42\n" and result["output_correct"] is True
        # a wrong answer still ran fine: ok, but not output_correct
        ws.edit(name, "a * b", "a + b")
        wrong = ws.bash(ws.task.command)
        assert wrong["status"] == "ok" and wrong["stdout"].endswith("13\n") and wrong["output_correct"] is False


@needs_bwrap
def test_python_and_python3_both_run_python():
    with Workspace(make_task()) as ws:
        ws.write("solution.py", "print(42)\n")
        assert ws.bash("python solution.py")["output_correct"] is True
        assert ws.bash("python3 'solution.py'")["output_correct"] is True


@pytest.mark.parametrize("command, fragment", [
    ("node solution.py", "runtime python3 or python"),
    ("python3 solution.py; cat /etc/passwd", "`<runtime> <file>`"),
    ("python3 solution.py extra", "`<runtime> <file>`"),
    ("python3", "`<runtime> <file>`"),
    ("bash -c 'id'", "`<runtime> <file>`"),
    ("python3 -c print(1)", "`<runtime> <file>`"),
    ("python3 'unterminated", "cannot parse"),
    ("python3 data.txt", "not written by you"),
    ("python3 other.py", "write it first"),
    ("python3 /etc/passwd", "absolute"),
    ("python3 ../solution.py", ".."),
])
def test_bash_refuses_anything_but_running_a_written_program(command, fragment):
    ws = Workspace(make_task())
    ws.write("solution.py", "print(42)\n")
    result = ws.bash(command)
    assert result["status"] == "submission_error" and fragment in result["error"], result
    assert result["command"] == command
    assert ws._sandbox is None  # refused before any sandbox existed


@needs_bwrap
def test_failing_program_is_an_error_with_its_exit_code_and_stderr():
    with Workspace(make_task()) as ws:
        ws.write("solution.py", "import sys\nprint(42)\nsys.exit('boom')\n")
        result = ws.bash("python3 solution.py")
        assert result["status"] == "error" and result["returncode"] == 1
        assert "boom" in result["stderr"] and result["output_correct"] is False  # 42 printed, but it failed


@needs_bwrap
def test_infinite_loop_times_out_and_is_killed():
    with Workspace(make_task(), limits=WorkspaceLimits(timeout_s=1.5)) as ws:
        ws.write("solution.py", "print(42, flush=True)\nwhile True:\n    pass\n")
        result = ws.bash("python3 solution.py")
        assert result["status"] == "error" and result["timed_out"] is True and result["returncode"] is None
        assert result["output_correct"] is False and "timed out" in result["error"]
        assert result["duration_s"] < 10


@needs_bwrap
def test_fork_bomb_ends_cleanly():
    program = ("import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
               "        time.sleep(0.01)\n")
    with Workspace(make_task(), limits=WorkspaceLimits(timeout_s=3)) as ws:
        ws.write("solution.py", program)
        result = ws.bash("python3 solution.py")
        assert result["status"] == "error" and result["timed_out"] is True
        # the sandbox is still usable afterwards: nothing of the bomb is left running
        ws.write("solution.py", "print(42)\n")
        assert ws.bash("python3 solution.py")["output_correct"] is True


@needs_bwrap
def test_memory_hog_fails_cleanly():
    with Workspace(make_task(), limits=WorkspaceLimits(max_memory_bytes=256 << 20)) as ws:
        ws.write("solution.py", "x = bytearray(1 << 30)\nprint(42)\n")
        result = ws.bash("python3 solution.py")
        assert result["status"] == "error" and result["returncode"] == 1 and "MemoryError" in result["stderr"]


@needs_bwrap
def test_close_from_another_thread_kills_a_running_program():
    ws = Workspace(make_task(), limits=WorkspaceLimits(timeout_s=60))
    ws.write("solution.py", "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    results = []
    runner = threading.Thread(target=lambda: results.append(ws.bash("python3 solution.py")))
    runner.start()
    while ws._sandbox is None:  # the run has begun once its sandbox exists
        threading.Event().wait(0.02)
    host_dir = ws._sandbox.host_dir
    threading.Event().wait(0.5)
    ws.close()
    runner.join(timeout=15)
    assert not runner.is_alive()
    assert results[0]["status"] == "infrastructure_error" and "closed" in results[0]["error"]
    assert not os.path.exists(host_dir)
    assert ws.bash("python3 solution.py")["status"] == "infrastructure_error"


@needs_bwrap
def test_huge_output_is_bounded():
    with Workspace(make_task(), limits=WorkspaceLimits(output_chars=1000, timeout_s=20)) as ws:
        ws.write("solution.py", "import sys\nfor _ in range(200000):\n    sys.stdout.write('y' * 100 + '\\n')\n"
                                "sys.stderr.write('e' * 50000)\nprint(42)\n")
        result = ws.bash("python3 solution.py")
        assert result["status"] == "ok" and result["output_correct"] is True  # the tail holds the answer
        assert len(result["stdout"]) == 1000 and result["stdout_truncated"] is True
        assert len(result["stderr"]) == 1000 and result["stderr_truncated"] is True
        assert len(json.dumps(result)) < 3000


@needs_bwrap
def test_programs_see_no_host_files_and_no_network():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    program = f"""import os, socket
seen = []
for path in ("/etc/shadow", "/root/.bashrc", {os.getcwd()!r}, "/work", "/proc/1/root/etc/shadow"):
    seen.append(path + "=" + str(os.path.exists(path)))
for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 53)):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        seen.append(host + "=connected")
    except OSError as exc:
        seen.append(host + "=" + type(exc).__name__)
print(" ".join(seen))
"""
    try:
        with Workspace(make_task()) as ws:
            ws.write("solution.py", program)
            result = ws.bash("python3 solution.py")
    finally:
        server.shutdown()
        server.server_close()
    assert result["status"] == "ok", result
    out = result["stdout"]
    assert "=True" not in out and "connected" not in out, out
    assert "/etc/shadow=False" in out and "127.0.0.1=" in out


@needs_bwrap
def test_symlinks_and_leftovers_of_a_run_do_not_reach_the_workspace_or_the_next_run():
    with Workspace(make_task()) as ws:
        ws.write("solution.py", "import os\nos.symlink('/etc/hostname', 'link.txt')\n"
                                "os.symlink('/etc/hostname', 'data.txt.new')\nopen('made.txt', 'w').write('x')\n"
                                "os.remove('data.txt')\nos.symlink('/etc/passwd', 'data.txt')\nprint('planted')\n")
        assert ws.bash("python3 solution.py")["stdout"] == "planted\n"
        assert ws.read("link.txt")["status"] == "error" and ws.read("made.txt")["status"] == "error"
        assert ws.read("data.txt")["content"] == "6 7\n"
        ws.write("solution.py", "import os\nprint(sorted(os.listdir('.')), os.path.islink('data.txt'), "
                                "open('data.txt').read().strip())\n")
        result = ws.bash("python3 solution.py")
        assert result["stdout"] == "['data.txt', 'solution.py'] False 6 7\n", result


@needs_bwrap
def test_nothing_leaks_between_episodes_and_close_deletes_the_sandbox():
    task = make_task()
    with WorkspaceEnv(task) as first:
        first.call("write", {"path": "solution.py", "content": "open('/root/secret.txt', 'w').write('s')\nprint(1)\n"})
        assert json.loads(first.call("bash", {"command": "python3 solution.py"}))["status"] == "ok"
        host_dir = first.workspace._sandbox.host_dir
        assert os.path.isdir(host_dir)
    assert not os.path.exists(host_dir)  # closed: the sandbox (and its secret) is gone
    assert first.workspace._sandbox is None
    assert json.loads(first.call("read", {"path": "data.txt"}))["status"] == "infrastructure_error"
    with WorkspaceEnv(task) as second:
        second.call("write", {"path": "solution.py", "content": "import os\nprint(os.path.exists('/root/secret.txt'))\n"})
        assert json.loads(second.call("bash", {"command": "python3 solution.py"}))["stdout"] == "False\n"
        assert second.workspace.files.keys() == {"data.txt", "solution.py"}


@needs_bwrap
@pytest.mark.skipif(HAVE_JULIA, reason="julia is installed here: the missing-runtime path cannot be seen")
def test_missing_runtime_is_an_infrastructure_error():
    ws = Workspace(make_task("julia"))
    ws.write("solution.jl", "println(42)\n")
    result = ws.bash("julia solution.jl")
    assert result["status"] == "infrastructure_error"
    assert "julia" in result["error"] and "not installed" in result["error"]


@needs_bwrap
def test_sandbox_failure_is_an_infrastructure_error(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the unreachable-root check applies when sandboxes run as their own uid (root)")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("PI_ENV_SANDBOX_ROOT", str(private / "root"))  # sandbox uids cannot reach it
    ws = Workspace(make_task())
    ws.write("solution.py", "print(42)\n")
    result = ws.bash("python3 solution.py")
    assert result["status"] == "infrastructure_error" and "sandbox failure" in result["error"], result
    assert score([tool_msg("write", "ok"), {"role": "tool", "content": json.dumps(result)}, assistant("42")],
                 42).reward == -0.1


# ---------------------------------------------------------------------------------------------
# reward


@pytest.mark.parametrize("messages, train, evaluation", [
    ([], 0.0, 0.0),
    ([assistant("no tools, no number")], 0.0, 0.0),
    ([tool_msg("write", "ok")], 0.15, 0.0),
    ([tool_msg("edit", "ok")], 0.15, 0.0),
    ([tool_msg("bash", "ok", output_correct=False)], 0.15, 0.0),
    ([tool_msg("bash", "ok", output_correct=True)], 0.75, 0.0),
    ([assistant("It is 42.")], 0.1, 0.0),
    ([tool_msg("write", "ok"), tool_msg("bash", "ok", output_correct=True)], 0.9, 0.0),
    ([tool_msg("write", "ok"), tool_msg("bash", "ok", output_correct=False), assistant("42")], 0.4, 0.0),
    ([tool_msg("write", "ok"), tool_msg("bash", "ok", output_correct=True), assistant("So: 42")], 1.0, 1.0),
    ([tool_msg("write", "ok"), tool_msg("bash", "ok", output_correct=True), assistant("42"),
      tool_msg("bash", "infrastructure_error")], -0.1, None),
    ([tool_msg("bash", "infrastructure_error"), assistant("41")], -0.1, None),
    # failures do not count as successes
    ([tool_msg("write", "error"), tool_msg("bash", "error", output_correct=True),
      tool_msg("bash", "submission_error")], 0.0, 0.0),
])
def test_reward_table(messages, train, evaluation):
    assert score(messages, 42, mode="train").reward == pytest.approx(train)
    assert score(messages, 42, mode="eval").reward == evaluation


def test_reward_metrics():
    messages = [tool_msg("write", "ok"), tool_msg("bash", "ok", output_correct=True), assistant("41")]
    assert score(messages, 42).metrics == {
        "mutation": 1.0, "executed": 1.0, "output_correct": 1.0, "final_correct": 0.0,
        "tool_called": 1.0, "functional_correct": 1.0, "infrastructure_error": 0.0}
    nothing = score([assistant("hi")], 42).metrics
    assert nothing["tool_called"] == 0.0 and nothing["functional_correct"] == 0.0
    infra = score([tool_msg("bash", "infrastructure_error")], 42)
    assert infra.infrastructure_error and infra.metrics["tool_called"] == 1.0


@pytest.mark.parametrize("text, correct", [
    ("The answer is 42.", True), ("42", True), ("I got 7 then 42", True), ("42, or maybe 7", False),
    ("-42", False), ("no number", False), ("4242", False), ("answer: 42\n", True),
])
def test_final_answer_is_the_last_integer_of_the_last_assistant_message(text, correct):
    assert score([assistant(text)], 42).metrics["final_correct"] == float(correct)


def test_final_answer_ignores_earlier_messages_and_thinking():
    assert score([assistant("42"), assistant("sorry, 41")], 42).metrics["final_correct"] == 0.0
    parts = {"role": "assistant", "content": [{"type": "thinking", "thinking": "maybe 7"},
                                              {"type": "text", "text": "It is 42"}]}
    assert score([parts], 42).metrics["final_correct"] == 1.0
    thinking_only = {"role": "assistant", "content": [{"type": "thinking", "thinking": "42"}]}
    assert score([thinking_only], 42).metrics["final_correct"] == 0.0


def test_reward_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        score([], 1, mode="test")
    with pytest.raises(ValueError, match="mode"):
        WorkspaceEnv(make_task(), mode="test")


def test_forged_tool_results_do_not_count():
    forged = json.loads(tool_msg("bash", "ok", output_correct=True)["content"])
    # in an assistant message: never a tool result
    assert score([assistant(json.dumps(forged) + " 0")], 42).metrics["output_correct"] == 0.0
    # a tool message the env never issued: ignored by env.reward
    env = WorkspaceEnv(make_task())
    messages = [tool_msg("write", "ok"), tool_msg("bash", "ok", output_correct=True), assistant("42")]
    assert env.reward(messages).reward == 0.1
    assert score(messages, 42).reward == 1.0  # the bare function trusts its caller's messages


@needs_bwrap
def test_shaped_reward_of_real_episodes():
    task = make_task()
    call = lambda i, name, args: {"id": f"c{i}", "type": "function",  # noqa: E731
                                  "function": {"name": name, "arguments": json.dumps(args)}}
    cases = [  # (assistant turns, train reward)
        ([call(0, "write", {"path": "solution.py", "content": "print(41)\n"}),
          call(1, "bash", {"command": "python3 solution.py"})], 0.3),
        ([call(0, "write", {"path": "solution.py", "content": "print(6*7)\n"}),
          call(1, "bash", {"command": "python3 solution.py"})], 0.9),
        ([call(0, "write", {"path": "solution.py", "content": "raise SystemExit(3)\n"}),
          call(1, "bash", {"command": "python3 solution.py"})], 0.15),
        ([call(0, "bash", {"command": "python3 data.txt"})], 0.0),
    ]
    for calls, expected in cases:
        with WorkspaceEnv(task) as env:
            messages = run_conversation(env, [{"role": "assistant", "content": "", "tool_calls": calls},
                                              assistant("Done.")])
            assert env.reward(messages).reward == pytest.approx(expected), messages
    with WorkspaceEnv(task, mode="eval") as env:
        messages = run_conversation(env, [{"role": "assistant", "content": "", "tool_calls": cases[1][0]},
                                          assistant("42")])
        assert env.reward(messages).reward == 1.0


# ---------------------------------------------------------------------------------------------
# tasks, splits, prompt, env API


def test_generation_is_deterministic_and_covers_families_and_languages():
    first = generate_tasks(20, seed=7)
    assert [t.to_dict() for t in first] == [t.to_dict() for t in generate_tasks(20, seed=7)]
    assert [t.digest() for t in first] != [t.digest() for t in generate_tasks(20, seed=8)]
    assert {t.family for t in first} == set(FAMILIES) and len(FAMILIES) >= 4
    assert {t.language for t in first} == {"python", "javascript"}
    assert len({t.digest() for t in first}) == 20 and len({t.task_id for t in first}) == 20
    assert all(isinstance(t.expected, int) for t in first)
    assert {t.program for t in first} == {"solution.py", "solution.js"}
    same = WorkspaceTask.from_dict(first[0].to_dict())
    assert same == first[0] and same.digest() == first[0].digest()


def test_generation_in_a_subprocess_gives_the_same_tasks():
    code = ("import json; from pi_env.workspace import generate_tasks; "
            "print(json.dumps([t.digest() for t in generate_tasks(10, seed=3)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert json.loads(out) == [t.digest() for t in generate_tasks(10, seed=3)]


def test_digest_ignores_language_and_splits_never_overlap():
    task = generate_tasks(1)[0]
    other_language = WorkspaceTask.from_dict({**task.to_dict(), "language": "javascript", "program": "solution.js"})
    assert other_language.digest() == task.digest()
    train, evaluation = make_splits(60, 30, seed=1)
    assert len(train) == 60 and len(evaluation) == 30
    assert not {t.digest() for t in train} & {t.digest() for t in evaluation}
    assert {t.split for t in train} == {"train"} and {t.split for t in evaluation} == {"eval"}
    leaked = WorkspaceTask.from_dict({**train[5].to_dict(), "split": "eval", "task_id": "leaked"})
    with pytest.raises(SplitOverlapError, match="leaked.*same problem"):
        check_disjoint(train=train, eval=[*evaluation, leaked])
    check_disjoint(train=train, also_train=train[:0])  # an empty split overlaps nothing


def test_generation_errors_name_the_bad_argument():
    with pytest.raises(ValueError, match="families: 'nope'"):
        generate_tasks(1, families=["nope"])
    with pytest.raises(ValueError, match="languages: 'cobol'"):
        generate_tasks(1, languages=["cobol"])
    with pytest.raises(ValueError, match="language: 'cobol'"):
        WorkspaceTask(task_id="x", family="f", language="cobol", question="q", files={}, program="p", expected=1)


@pytest.mark.skipif(HAVE_JULIA, reason="julia is installed here")
def test_julia_is_refused_clearly_when_no_julia_binary_exists():
    with pytest.raises(ValueError, match="'julia' needs a `julia` binary.*has none"):
        generate_tasks(4, languages=["python", "julia"])
    tasks = generate_tasks(4, languages=["julia"], require_runtimes=False)  # to run elsewhere
    assert {t.program for t in tasks} == {"solution.jl"}
    with pytest.raises(ValueError, match="no reference programs in julia"):
        reference_program(tasks[0])


@needs_bwrap
def test_every_family_answer_agrees_with_an_independent_program_in_both_runtimes():
    tasks = generate_tasks(2 * len(FAMILIES), seed=11)
    for task in tasks:
        with WorkspaceEnv(task) as env:
            messages = run_conversation(env, oracle_turns(task))
            run = json.loads(messages[-2]["content"])
            assert run["status"] == "ok" and run["output_correct"] is True, (task.task_id, run)
            assert env.reward(messages).reward == 1.0


def test_prompt_names_language_files_program_command_and_integer_answer():
    task = generate_tasks(2, seed=2)[1]
    env = WorkspaceEnv(task)
    system, user = env.initial_messages()
    assert system["role"] == "system" and user["role"] == "user"
    text = user["content"]
    assert task.question in text and f"Language: {task.lang.name}" in text
    for path in task.files:
        assert f"`{path}`" in text
    assert f"`{task.program}`" in text and f"exactly `{task.command}`" in text
    assert "integer" in text


def test_env_tools_are_json_schemas_of_the_four_tools():
    schemas = WorkspaceEnv.tools()
    assert [s["function"]["name"] for s in schemas] == ["read", "write", "edit", "bash"]
    edit = next(s for s in schemas if s["function"]["name"] == "edit")["function"]["parameters"]
    assert edit["required"] == ["path", "oldText", "newText"] and edit["type"] == "object"
    json.dumps(schemas)  # plain JSON


def test_env_accepts_a_task_dict_and_call_returns_json_text():
    task = make_task()
    env = WorkspaceEnv(task.to_dict())
    text = env.call("read", {"path": "data.txt"})
    assert isinstance(text, str) and json.loads(text)["content"] == "6 7\n"


def test_import_stays_light():
    code = ("import sys, pi_env, pi_env.workspace; "
            "print(sorted(m for m in ('tinker_cookbook', 'torch', 'openenv', 'transformers', 'chz') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@needs_bwrap
def test_example_loop_against_an_openai_compatible_server(server):
    """examples/workspace_loop.py over real HTTP, the scripted server answering with the
    reference solution's tool calls (synthetic), then with a wrong final answer."""
    from pi_env.scripted import ScriptedToolCall, ScriptedTurn

    task = generate_tasks(1, seed=0)[0]
    turns = oracle_turns(task)
    script = [ScriptedTurn(tool_calls=[ScriptedToolCall(name=c["function"]["name"],
                                                        arguments=json.loads(c["function"]["arguments"]))])
              for turn in turns[:-1] for c in turn["tool_calls"]]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for final, reward in ((f"The answer is {task.expected}.", 1.0), ("The answer is 3.", 0.9)):
        key = server.add_script([*script, ScriptedTurn(text=final)])
        done = subprocess.run(
            [sys.executable, os.path.join(root, "examples", "workspace_loop.py"), "--endpoint", server.base_url,
             "--model", "scripted-model", "--api-key", key, "--n", "1"],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary["rewards"] == [reward] and summary["synthetic"] is False
        assert key not in done.stdout + done.stderr  # the API key is never echoed
