"""The `pi-env` command line, run as a real subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def pi_env(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pi_env.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("content, message", [
    ('{"instruction": "x", "files": {"/etc/passwd": "x"}}', "files['/etc/passwd']: '/etc/passwd' is absolute"),
    ('{"instruction": "x", "verify_files": {"../up.py": ""}}', "contains '..'"),
    ('{"instruction": "x", "verfy": ["true"]}', "verfy"),
    ('{"instruction": ', "not valid JSON"),
    ('["not", "a", "task"]', "expected a task object"),
])
def test_malformed_task_files_exit_2_with_a_clear_message(tmp_path, content, message):
    task = tmp_path / "task.json"
    task.write_text(content)
    done = pi_env("run", str(task))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_missing_file_and_bad_endpoint_exit_2(tmp_path):
    done = pi_env("run", str(tmp_path / "nope.json"))
    assert done.returncode == 2 and "no such task file" in done.stderr
    done = pi_env("run", "examples/fizzbuzz.json", "--endpoint", "nonsense")
    assert done.returncode == 2 and "unknown endpoint" in done.stderr
    task = tmp_path / "t.json"
    task.write_text('{"instruction": "x", "verify": ["true"]}')
    done = pi_env("run", str(task))  # oracle without a solution
    assert done.returncode == 2 and "no solution" in done.stderr


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_run_json_and_out(tmp_path):
    out = tmp_path / "results.jsonl"
    done = pi_env("run", "examples/fizzbuzz.json", "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["task_id"] == "fizzbuzz" and result["reward"] == 1.0 and result["synthetic"] is True
    assert json.loads(out.read_text()) == result


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_dead_endpoint_exits_3(tmp_path):
    done = pi_env("run", "examples/fizzbuzz.json", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--json")
    assert done.returncode == 3
    assert json.loads(done.stdout)["error_kind"] == "endpoint_error"


@pytest.mark.needs_bwrap
def test_doctor_reports_each_check():
    done = pi_env("doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ok]   sandbox" in done.stdout and "[ok]   agent pi" in done.stdout and "[ok]   endpoint" in done.stdout
    failing = pi_env("doctor", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m")
    assert failing.returncode == 3 and "[FAIL] endpoint" in failing.stdout


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_transparent_proxy_from_the_cli_writes_traces(tmp_path):
    done = pi_env("run", "examples/fizzbuzz.json", "--mode", "transparent_proxy", "--trace-dir", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["mode"] == "transparent_proxy" and result["reward"] == 1.0
    assert all(turn["completion_token_ids"] for turn in result["proxy_turns"])
    assert result["training"]["segments"] and Path(result["trace_path"]).parent == tmp_path


@pytest.mark.parametrize("command", ["run", "doctor", "collect", "serve"])
def test_every_command_names_every_registered_backend(command):
    from pi_env.sandbox import backend_names

    help_text = " ".join(pi_env(command, "--help", timeout=60).stdout.split())
    assert f"sandbox backend: {', '.join(backend_names())}" in help_text
    refused = pi_env(command, "--backend", "nope", *(["x.json"] if command in ("run", "collect") else []), timeout=60)
    assert refused.returncode == 2 and "invalid choice: 'nope'" in refused.stderr


@pytest.mark.parametrize("args, message", [
    (["--sampling", "temprature=0"], "--sampling: unknown sampling parameter 'temprature'; allowed: temperature, top_p"),
    (["--sampling", "temperature=hot"], "--sampling: temperature must be a number, not 'hot'"),
    (["--sampling", "seed=1.5"], "--sampling: seed must be an integer, not '1.5'"),
    (["--sampling", "top_p=0"], "--sampling: top_p must be in (0, 1], not 0.0"),
    (["--sampling", "temperature=-1"], "--sampling: temperature must be at least 0, not -1.0"),
    (["--sampling", "temperature"], "--sampling: 'temperature' is not NAME=VALUE"),
    (["--sampling", "seed=1,seed=2"], "--sampling: seed is given twice"),
    (["--sampling", "temperature=0", "--mode", "black_box"], "--mode black_box relays the agent's sampling as sent"),
    (["--max-tokens", "0"], "argument --max-tokens: must be at least 1, not 0"),
])
@pytest.mark.parametrize("command", ["run", "collect"])
def test_bad_sampling_and_max_tokens_name_the_flag(tmp_path, command, args, message):
    extra = ["--out", str(tmp_path / "out")] if command == "collect" else []
    done = pi_env(command, "examples/fizzbuzz.json", *extra, *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.needs_bwrap
def test_sampling_and_max_tokens_are_forced_on_every_call_and_shown(tmp_path):
    """--sampling alone switches `run` to transparent_proxy; every forwarded request carries the
    values (whatever Pi asked), max_tokens is what --max-tokens says, and the result and the
    command's output say which sampling was in force."""
    done = pi_env("run", "examples/fizzbuzz.json", "--sampling", "temperature=0,top_p=1,seed=7", "--max-tokens", "77",
                  "--trace-dir", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    assert "sampling forced at the gateway: temperature=0.0, top_p=1.0, seed=7; max_tokens 77" in done.stderr
    result = json.loads(done.stdout)
    assert result["mode"] == "transparent_proxy" and result["reward"] == 1.0
    assert result["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": 7}
    forwarded = [json.loads(line)["capture"]["request"] for line in Path(result["trace_path"]).read_text().splitlines()]
    forced = [{k: r.get(k) for k in ("temperature", "top_p", "seed", "max_tokens")} for r in forwarded]
    assert forced and all(f == {"temperature": 0, "top_p": 1, "seed": 7, "max_tokens": 77} for f in forced), forced

    plain = pi_env("run", "examples/fizzbuzz.json", "--json")
    assert plain.returncode == 0, plain.stderr
    assert "no sampling forced: Pi sends no temperature, so the engine's default applies (vLLM: 1.0)" in plain.stderr
    assert json.loads(plain.stdout)["sampling"] == {} and json.loads(plain.stdout)["mode"] == "black_box"


RAISING_RUN = """
import sys
from pi_env import cli, rollout
from pi_env.sandbox import SandboxError

def create(self, task):
    raise {error}
rollout.PiSessionFactory.create = create
sys.exit(cli.main(["run", "examples/fizzbuzz.json", "--json"]))
"""


@pytest.mark.parametrize("error, kind", [("SandboxError('bwrap died')", "infra"),
                                         ("KeyError('turns')", "internal")])
def test_a_rollout_that_raises_is_unscored_with_the_kind_collect_gives_it(error, kind):
    """`pi-env run` names a sandbox that broke `infra` (worth a retry) and a bug of ours
    `internal` with its traceback, as collect and reverify do (rollout.unscored_by); both exit 3."""
    done = subprocess.run([sys.executable, "-c", RAISING_RUN.format(error=error)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 3, done.stderr
    result = json.loads(done.stdout)
    assert (result["error_kind"], result["reward"]) == (kind, None)
    assert result["error"].startswith(error.split("(")[0])
    assert ("Traceback" in result["error"]) == (kind == "internal")
