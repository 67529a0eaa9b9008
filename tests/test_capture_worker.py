"""The capture worker never imports the user's `__main__`: a script that calls run_rollout at top
level, with no `if __name__ == "__main__":` guard, runs exactly once even when its large answers
are parsed in the worker process."""

import json
import subprocess
import sys
import textwrap

import pytest

GUARDLESS_SCRIPT = textwrap.dedent("""
    import json, sys
    from pi_env import PiConfig, run_rollout
    from pi_env.proxy.capture_worker import capture_worker
    from pi_env.scripted import ScriptedServer
    from pi_env.scripted import ScriptedTurn

    with open(sys.argv[1], "a") as runs:
        runs.write("ran\\n")
    server = ScriptedServer(default=[ScriptedTurn(text="abcd" * 6000, chunk_chars=4)]).start()
    config = PiConfig(endpoint=server.base_url, model="scripted-model", api_key="k", mode="transparent_proxy",
                      max_turns=1, agent_timeout_s=120)
    result = run_rollout({"task_id": "guardless", "instruction": "say something", "verify": ["true"]}, config)
    print(json.dumps({"assembled_in_worker": capture_worker().assembled, "error": result.error,
                      "worker_errors": [t.capture_worker_error for t in result.proxy_turns]}))
    server.stop()
""")


@pytest.mark.needs_bwrap
def test_a_guardless_script_runs_exactly_once(tmp_path):
    script, runs = tmp_path / "train.py", tmp_path / "runs.txt"
    script.write_text(GUARDLESS_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(runs)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["assembled_in_worker"] >= 1, report  # the worker really ran
    assert report["worker_errors"] and not any(report["worker_errors"]), report
    assert runs.read_text() == "ran\n", "the user's script was executed again by a pi-env worker process"
