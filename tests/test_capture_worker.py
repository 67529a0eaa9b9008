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
    from pi_env.proxy.capture_worker import capture_pool
    from pi_env.scripted import ScriptedServer
    from pi_env.scripted import ScriptedTurn

    with open(sys.argv[1], "a") as runs:
        runs.write("ran\\n")
    server = ScriptedServer(default=[ScriptedTurn(text="abcd" * 6000, chunk_chars=4)]).start()
    config = PiConfig(endpoint=server.base_url, model="scripted-model", api_key="k", mode="transparent_proxy",
                      max_turns=1, agent_timeout_s=120)
    result = run_rollout({"task_id": "guardless", "instruction": "say something", "verify": ["true"]}, config)
    print(json.dumps({"assembled_in_worker": capture_pool().assembled, "error": result.error,
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


def large_answer(tokens: int) -> bytes:
    """A streamed answer with ids and top-2 logprobs, one token per event."""
    events = [{"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "token_ids": [i],
                            "logprobs": {"content": [{"token": f"t{i} ", "logprob": -0.5, "bytes": [116],
                                                      "top_logprobs": [{"token": "x", "logprob": -1.0}] * 2}]}}]}
              for i in range(tokens)]
    events[0]["prompt_token_ids"] = [1, 2]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_the_pool_assembles_exactly_what_the_inline_path_does():
    from pi_env.proxy.capture import assemble_answer
    from pi_env.proxy.capture_worker import CapturePool

    pool = CapturePool(2)
    try:
        raw = large_answer(3000)
        for given in (raw, bytearray(raw)):  # the gateway hands over its bytearray as it is
            assert pool.assemble(given, True).to_json() == assemble_answer(raw, True).to_json()
        assert pool.assembled == 2 and pool.failures == 0 and pool.cpu_s > 0
    finally:
        pool.close()


def test_a_worker_starts_only_when_every_started_one_is_busy_and_never_past_the_size():
    import threading

    from pi_env.proxy.capture_worker import CapturePool

    pool = CapturePool(2)
    try:
        for _ in range(3):  # one at a time: one worker
            pool.assemble(large_answer(10), True)
        assert len(pool.workers) == 1
        busy = [pool._take(), pool._take()]  # both held: a second worker started
        assert len(pool.workers) == 2 and busy[0] is not busy[1]
        third = []
        waiter = threading.Thread(target=lambda: third.append(pool._take()))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and len(pool.workers) == 2, "a third worker started past the size"
        with pool._free:
            pool._idle.append(busy.pop())
            pool._free.notify()
        waiter.join(5)
        assert third and len(pool.workers) == 2
    finally:
        pool.close()


@pytest.mark.parametrize("value, size", [("3", 3), (" 1 ", 1), ("0", None), ("two", None), ("-1", None)])
def test_the_pool_size_comes_from_the_environment_or_the_cpus(monkeypatch, value, size):
    import os

    from pi_env.proxy.capture_worker import MAX_WORKERS, pool_size

    monkeypatch.setenv("PI_ENV_CAPTURE_WORKERS", value)
    if size is None:
        with pytest.raises(ValueError, match="PI_ENV_CAPTURE_WORKERS"):
            pool_size()
    else:
        assert pool_size() == size
    monkeypatch.delenv("PI_ENV_CAPTURE_WORKERS")
    assert pool_size() == min(len(os.sched_getaffinity(0)), MAX_WORKERS)
