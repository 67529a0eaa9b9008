"""The capture worker never imports the user's `__main__`: a script that calls run_rollout at top
level, with no `if __name__ == "__main__":` guard, runs exactly once even when its large answers
are parsed in the worker process."""

import asyncio
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


@pytest.mark.parametrize("way", ["shared file", "pipes", "pipe there, shared file back"])
def test_the_pool_assembles_exactly_what_the_inline_path_does(way, monkeypatch):
    """Through the worker's shared memory file, through its pipes alone (no memfd, or an answer
    past SHARED_MAX_BYTES), and the mix: every way gives the inline path's capture."""
    from pi_env.proxy import capture_worker
    from pi_env.proxy.capture import assemble_answer
    from pi_env.proxy.capture_worker import CapturePool

    if way == "pipes":
        monkeypatch.setattr(capture_worker, "_shared_file", lambda: None)
    elif way != "shared file":  # the child (its own copy of the module) still answers through the file
        monkeypatch.setattr(capture_worker, "SHARED_MAX_BYTES", 0)
    pool = CapturePool(2)
    try:
        raw = large_answer(3000)
        # The relay hands over its pieces as read, in any sizes (one byte too); more pieces than
        # one writev() takes; and an answer larger than the pipe, which goes across in turns.
        cuts = [raw[i : i + 997] for i in range(0, len(raw), 997)]
        many = [raw[i : i + 1] for i in range(2000)] + [raw[2000:]]
        big = large_answer(20000)
        assert len(big) > 2 * (1 << 20) and len(many) > 1024
        for given, whole in (([raw], raw), (cuts, raw), (many, raw), ([bytearray(big)], big)):
            assert asyncio.run(pool.assemble(given, True)).to_json() == assemble_answer(whole, True).to_json()
        assert pool.assembled == 4 and pool.failures == 0 and pool.cpu_s > 0
        assert all((worker._shared is None) == (way == "pipes") for worker in pool.workers)
    finally:
        pool.close()


def test_a_shared_file_holds_one_answer_and_is_emptied_after_a_large_one(monkeypatch):
    """The answer goes to the worker in its shared file (the file holds it afterwards, nothing
    past it), and a file grown past SHARED_KEEP_BYTES is emptied, so an idle worker does not
    keep the pages of the largest answer it ever saw."""
    import os

    from pi_env.proxy import capture_worker
    from pi_env.proxy.capture import assemble_answer
    from pi_env.proxy.capture_worker import CapturePool

    pool = CapturePool(1)
    small, large = large_answer(300), large_answer(20000)
    try:
        assert asyncio.run(pool.assemble([small[:100], small[100:]], True)).to_json() == assemble_answer(
            small, True).to_json()
        (worker,) = pool.workers
        assert worker._shared is not None
        size = os.fstat(worker._shared).st_size
        assert len(small) <= size < 2 * len(small) and os.pread(worker._shared, 100, 0) != small[:100]  # the reply
        monkeypatch.setattr(capture_worker, "SHARED_KEEP_BYTES", len(large) - 1)
        assert asyncio.run(pool.assemble([large], True)).to_json() == assemble_answer(large, True).to_json()
        assert os.fstat(worker._shared).st_size == 0
        assert asyncio.run(pool.assemble([small], True)).to_json() == assemble_answer(small, True).to_json()
        assert pool.failures == 0 and pool.workers == [worker]
    finally:
        pool.close()


def test_a_worker_starts_only_when_every_started_one_is_busy_and_never_past_the_size():
    from pi_env.proxy.capture_worker import CapturePool

    pool = CapturePool(2)

    async def scenario():
        for _ in range(3):  # one at a time: one worker
            await pool.assemble([large_answer(10)], True)
        assert len(pool.workers) == 1
        busy = [await pool._take(), await pool._take()]  # both held: a second worker started
        assert len(pool.workers) == 2 and busy[0] is not busy[1]
        third = asyncio.ensure_future(pool._take())
        await asyncio.sleep(0.2)
        assert not third.done() and len(pool.workers) == 2, "a third worker started past the size"
        cancelled = asyncio.ensure_future(pool._take())  # a waiter that gives up is skipped
        await asyncio.sleep(0)
        cancelled.cancel()
        pool._give_back(busy.pop())
        assert await asyncio.wait_for(third, 5) in pool.workers and len(pool.workers) == 2
        assert cancelled.cancelled()
        pool._give_back(busy.pop())
        assert len(pool._idle) == 1  # not lost to the cancelled waiter

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


def test_a_worker_cancelled_mid_answer_is_replaced_not_reused():
    """Cancelled while the child parses: its pipes hold half an exchange, so the child is killed
    and the next answer gets a fresh one, assembled exactly."""
    from pi_env.proxy.capture import assemble_answer
    from pi_env.proxy.capture_worker import CapturePool

    pool = CapturePool(1)
    raw, other = large_answer(20000), large_answer(3000)

    async def scenario():
        first = asyncio.ensure_future(pool.assemble([raw], True))
        await asyncio.sleep(0.05)
        for _ in range(1000):  # a loaded machine starts the child later than 50 ms
            if pool.workers[0].pid is not None:
                break
            await asyncio.sleep(0.01)
        dead = pool.workers[0].pid
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        again = await asyncio.wait_for(pool.assemble([other], True), 30)  # not the cancelled answer's
        return dead, again

    try:
        dead, again = asyncio.run(scenario())
        assert dead is not None and pool.workers[0].pid not in (None, dead)
        assert again.to_json() == assemble_answer(other, True).to_json()
    finally:
        pool.close()


def test_a_shared_file_that_cannot_be_read_fails_the_answer_not_hangs_it(monkeypatch):
    """The reply is read from the shared file in a readiness callback: an error there must reach
    the caller (who then parses inline), never stay in the loop's log with the caller waiting."""
    import os

    from pi_env.proxy import capture_worker
    from pi_env.proxy.capture_worker import CapturePool, CaptureWorkerError

    def unreadable(fd, length, offset):
        raise OSError(5, "Input/output error")

    pool, real_pread = CapturePool(1), os.pread
    try:
        asyncio.run(pool.assemble([large_answer(10)], True))  # the worker is up before reads fail
        monkeypatch.setattr(capture_worker.os, "pread", unreadable)
        with pytest.raises(CaptureWorkerError, match="Input/output error"):
            asyncio.run(asyncio.wait_for(pool.assemble([large_answer(300)], True), 20))
        monkeypatch.setattr(capture_worker.os, "pread", real_pread)
        assert asyncio.run(pool.assemble([large_answer(10)], True)).choices  # a fresh worker answers
        assert pool.failures == 1
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


def assemble_on_a_thread(pool, raw):
    """Assemble `raw` on an event loop in a thread of its own (as the gateway's loop does);
    returns the thread and a dict that gets its "capture" or "error"."""
    import threading

    outcome: dict = {}

    def run():
        try:
            outcome["capture"] = asyncio.run(pool.assemble([raw], True))
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def wait_busy(pool):
    """Until the pool's one worker has a child that holds an answer."""
    import time

    deadline = time.monotonic() + 20
    while not (pool.workers and not pool._idle and pool.workers[0].pid is not None):
        assert time.monotonic() < deadline, "the worker never took the answer"
        time.sleep(0.001)
    time.sleep(0.02)  # the answer is across: the child parses it


def test_closing_the_pool_at_exit_waits_for_an_answer_another_thread_has_in_flight():
    """atexit closes the pool while the gateway's loop (another thread) may be mid-answer: the
    answer is assembled in the worker all the same, then the worker stops; a later answer is
    refused as closed (its caller parses inline), never given to a new child."""
    from pi_env.proxy.capture import assemble_answer
    from pi_env.proxy.capture_worker import CapturePool, CapturePoolClosed

    pool, raw = CapturePool(1), large_answer(40000)
    thread, outcome = assemble_on_a_thread(pool, raw)
    wait_busy(pool)
    process = pool.workers[0]._process
    pool.close()
    thread.join(30)
    assert "error" not in outcome, outcome
    assert outcome["capture"].to_json() == assemble_answer(raw, True).to_json()
    assert pool.failures == 0 and process is not None and process.returncode is not None
    with pytest.raises(CapturePoolClosed):
        asyncio.run(pool.assemble([large_answer(10)], True))
    assert len(pool.workers) == 1 and pool.workers[0].pid is None


def test_an_answer_in_flight_past_the_wait_ends_its_exchange_and_its_caller_closes_the_worker():
    """Past close()'s wait, the busy worker's child is killed: its caller reads EOF (and parses
    inline) instead of hanging, and closes the worker's pipes and file on its own thread."""
    from pi_env.proxy.capture_worker import CapturePool, CaptureWorkerError

    pool = CapturePool(1)
    thread, outcome = assemble_on_a_thread(pool, large_answer(40000))
    wait_busy(pool)
    pool.close(wait_s=0.0)
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), CaptureWorkerError), outcome
    (worker,) = pool.workers
    assert worker._process is None and worker._shared is None


def test_closing_the_pool_from_a_running_loop_neither_waits_on_it_nor_leaves_its_waiters_hanging():
    """From the thread of a loop with answers in flight, close() cannot wait for them (they need
    that loop): it stops the busy child, and a caller queued for a worker is told the pool closed."""
    import time

    from pi_env.proxy.capture_worker import CapturePool, CapturePoolClosed, CaptureWorkerError

    pool = CapturePool(1)

    async def scenario():
        first = asyncio.ensure_future(pool.assemble([large_answer(40000)], True))
        queued = asyncio.ensure_future(pool.assemble([large_answer(10)], True))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        pool.close()
        took = time.monotonic() - started
        results = await asyncio.wait_for(asyncio.gather(first, queued, return_exceptions=True), 30)
        return took, results

    took, (first, queued) = asyncio.run(scenario())
    assert took < 1.0, f"close() waited {took:.1f} s on its own loop"
    assert isinstance(first, CaptureWorkerError) and isinstance(queued, CapturePoolClosed), (first, queued)


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_worker_runs_as_a_batch_process_so_its_wake_ups_never_preempt_the_engine_or_the_loop():
    import os

    from pi_env.proxy.capture_worker import CapturePool

    pool = CapturePool(1)
    try:
        asyncio.run(pool.assemble([large_answer(10)], True))
        (pid,) = pool.pids
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)  # its share is not cut
    finally:
        pool.close()
