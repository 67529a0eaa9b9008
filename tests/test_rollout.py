"""End to end: the real Pi CLI in the real bubblewrap sandbox, against the oracle or the
server server. Each test is one or two real rollouts (about a second each)."""

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from helpers import bash, direct_answer, processes_of_uid, scripted_config
from pi_env import PiConfig, PiSessionFactory, PiTask, load_tasks, run_rollout
from pi_env.scripted import Fault, ScriptedTurn

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

EXAMPLES = load_tasks(Path(__file__).parent.parent / "examples")


def rollout_with_uid(task, config=None):
    """A rollout, and the uid its sandbox ran as (to check nothing of it survives)."""
    with PiSessionFactory(config).create(task) as session:
        uid = session.sandbox.uid
        result = session.wait_for_completion()
    return result, uid


def tool_outputs(result) -> str:
    """Everything the agent's tools returned (as the gateway relayed it to the model), as one string."""
    texts = []
    for message in result.messages:
        if message.get("role") == "tool":
            content = message.get("content")
            texts += [content] if isinstance(content, str) else \
                [block.get("text", "") for block in content or [] if isinstance(block, dict)]
    return "\n".join(texts)


@pytest.mark.parametrize("task", EXAMPLES, ids=[task.task_id for task in EXAMPLES])
def test_examples_score_one_through_the_oracle(task):
    result = run_rollout(task)
    assert result.error_kind is None, (result.error, result.agent_log_tail)
    assert result.reward == 1.0
    assert result.synthetic and result.endpoint == "oracle"
    assert result.stop_reason == "stop"
    assert len(result.proxy_turns) == len(task.solution) + 1  # one call per step, then the final text
    assert all(turn.upstream_status == 200 for turn in result.proxy_turns)
    assert [m["role"] for m in result.messages].count("assistant") == len(task.solution) + 1
    assert set(result.timings) >= {"sandbox_create", "setup", "agent", "verify"}
    for path in task.verify_files:  # staged for verify only: the collected files are the agent's
        assert path not in result.files


def test_partly_failing_verify_gives_the_exact_fraction():
    task = PiTask(task_id="fraction", instruction="write x", verify=["test -f x.txt", "false", "grep -q hi x.txt"],
                  solution=[{"tool": "write", "path": "x.txt", "content": "hi\n"}])
    result = run_rollout(task)
    assert result.reward == pytest.approx(2 / 3) and result.reward_source == "pass_rate"
    assert [r.exit_code for r in result.verify_results] == [0, 1, 0]


def test_verify_written_reward_file_overrides_pass_rate():
    task = PiTask(task_id="reward-file", instruction="x", verify=["true", "echo 0.25 > $HOME/logs/verifier/reward.txt"],
                  solution=[{"tool": "bash", "command": "true"}])
    result = run_rollout(task)
    assert result.reward == 0.25 and result.reward_source == "reward_file"


def test_agent_written_reward_file_is_ignored():
    forged = "mkdir -p $HOME/logs/verifier && echo 1.0 > $HOME/logs/verifier/reward.txt && " \
             "ln -sf $HOME/forged $HOME/logs/verifier/reward.json; echo 1.0 > $HOME/forged"
    task = PiTask(task_id="forge", instruction="x", verify=["test -f solved.txt"],
                  solution=[{"tool": "bash", "command": forged}])
    result = run_rollout(task)
    assert result.reward == 0.0 and result.reward_source == "pass_rate"


def test_setup_failure_is_unscored_and_skips_the_agent():
    task = PiTask(task_id="setup-fails", instruction="x", setup=["true", "echo broken >&2; exit 3", "touch never"],
                  verify=["true"], solution=[{"tool": "bash", "command": "true"}])
    result = run_rollout(task)
    assert result.reward is None and result.error_kind == "setup_failed"
    assert "exited 3" in result.error and "broken" in result.error
    assert len(result.setup_results) == 2 and result.proxy_turns == [] and result.verify_results == []


def test_setup_runs_before_the_agent_and_files_are_staged():
    task = PiTask(task_id="order", instruction="x", files={"data/in.txt": "41\n"},
                  setup=["test -f data/in.txt && echo $(( $(cat data/in.txt) + 1 )) > data/out.txt"],
                  verify=["test \"$(cat seen.txt)\" = 42"],
                  solution=[{"tool": "bash", "command": "cat data/out.txt > seen.txt"}])
    assert run_rollout(task).reward == 1.0


def test_hanging_agent_is_killed_at_its_timeout_with_nothing_left():
    # 20 s: time for Pi's first call to be answered on a loaded machine, then the tool hangs
    # until the limit.
    task = PiTask(task_id="hang", instruction="x", verify=["true"], timeouts={"agent_s": 20},
                  solution=[{"tool": "bash", "command": "(setsid sleep 600 &) ; nohup sleep 700 & sleep 900"}])
    result, uid = rollout_with_uid(task)
    # The agent spent its own time (a hung tool): scored like any rollout that stopped, never
    # unscored (that would let a failing agent dodge its 0).
    assert result.error_kind is None and result.stop_reason == "timeout" and result.truncated, result.error
    assert result.reward == 1.0 and len(result.verify_results) == 1
    assert 20 <= result.timings["agent"] < 35
    assert processes_of_uid(uid) == []


def test_an_endpoint_that_never_begins_answering_is_scored_at_the_time_limit(server):
    # A zero stays a zero: once Pi has called the model, a time-out is scored on what the agent
    # left, even with Pi's first call unanswered (it used to be agent_timeout, unscored).
    key = server.add_script([ScriptedTurn(text="late", fault=Fault(hang_s=60))])
    result, uid = rollout_with_uid(PiTask(instruction="x", verify=["test -f solved.txt"], timeouts={"agent_s": 3}),
                                   scripted_config(server, key))
    assert result.error_kind is None and result.reward == 0.0, (result.error_kind, result.error)
    assert result.stop_reason == "timeout" and result.truncated and result.proxy_turns[-1].upstream_status is None
    assert processes_of_uid(uid) == []


@pytest.mark.parametrize("status, kind", [(400, "agent_error"), (500, "endpoint_error")])
def test_llm_error_is_reported_not_scored(server, status, kind):
    """Pi exits 0 in json mode when the LLM call fails; we judge from its session instead."""
    key = server.add_script([ScriptedTurn(fault=Fault(http_status=status, body={"error": {"message": f"boom {status}"}}))])
    result = run_rollout(PiTask(instruction="x", verify=["true"]), scripted_config(server, key))
    assert result.reward is None and result.error_kind == kind, (result.error, result.agent_log_tail)
    assert result.stop_reason == "error" and f"{status}" in result.error
    assert result.proxy_turns[0].upstream_status == status


def test_an_answer_the_endpoint_breaks_mid_stream_is_unscored(server):
    # The engine dies after a few tokens of Pi's only answer: infrastructure, never a reward of 0.
    key = server.add_script([ScriptedTurn(text="x" * 200, chunk_chars=1, fault=Fault(disconnect_after_chunks=5))])
    result = run_rollout(PiTask(instruction="x", verify=["true"]), scripted_config(server, key))
    assert result.reward is None and result.error_kind == "endpoint_error", (result.error, result.agent_log_tail)
    assert "broke its answer mid-stream" in result.error


def test_unreachable_endpoint_is_an_endpoint_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    config = PiConfig(endpoint={"name": f"http://127.0.0.1:{port}/v1", "model": "m", "api_key": "k"})
    result = run_rollout(PiTask(instruction="x", verify=["true"]), config)
    assert result.reward is None and result.error_kind == "endpoint_error"
    assert "unreachable" in result.error


def test_max_turns_budget_stops_the_agent_and_still_scores():
    steps = [{"tool": "bash", "command": f"echo {i} >> log.txt"} for i in range(6)]
    task = PiTask(task_id="budget", instruction="x", verify=["test $(wc -l < log.txt) -ge 1"], solution=steps)
    result = run_rollout(task, PiConfig(gateway={"max_turns": 2}))
    assert result.stop_reason == "budget" and result.budget_exhausted == "max_turns" and result.error_kind is None
    assert result.reward == 1.0 and result.truncated
    assert result.files["log.txt"] == "0\n1\n"
    assert len(result.proxy_turns) == 2  # the refused third call never reached the upstream


def test_long_prompt_reaches_the_model_intact(server):
    instruction = "Implement the spec below.\n" + "".join(f"line {i}: {'x' * 60}\n" for i in range(3000))
    key = server.add_script([ScriptedTurn(text="ok")])
    result = run_rollout(PiTask(instruction=instruction, verify=["true"]), scripted_config(server, key))
    assert result.reward == 1.0
    request = next(r for r in server.requests if r.api_key == key)
    user = next(m for m in request.body["messages"] if m["role"] == "user")
    text = user["content"] if isinstance(user["content"], str) else "".join(p.get("text", "") for p in user["content"])
    assert text == instruction.strip() and len(instruction) > 128 * 1024  # beyond one argv string


def test_task_pi_dir_cannot_change_pi_settings(server):
    files = {".pi/settings.json": json.dumps({"retry": {"enabled": True, "maxRetries": 5}}),
             ".pi/SYSTEM.md": "PWNED-SYSTEM-PROMPT", "AGENTS.md": "PWNED-AGENTS-FILE"}
    key = server.add_script([ScriptedTurn(fault=Fault(http_status=503))])
    result = run_rollout(PiTask(instruction="x", files=files, verify=["true"]), scripted_config(server, key))
    requests = [r for r in server.requests if r.api_key == key]
    assert len(requests) == 1, "retries stay off whatever the task's .pi/settings.json says"
    assert "PWNED" not in json.dumps(requests[0].body)
    assert result.error_kind == "endpoint_error"


class HostListener:
    """A TCP service on the host's loopback that the sandbox must not reach."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


def test_hostile_agent_gets_nothing(server, tmp_path):
    upstream_key = "sk-upstream-DO-NOT-LEAK-7f3a9"
    secret_file = Path.home() / ".pi-env-test-host-secret"
    secret_file.write_text("HOST-SECRET-c0ffee\n")
    listener = HostListener()
    probes = [
        f"cat {secret_file} /etc/shadow; ls -la /root /home /tmp; cat {tmp_path}/* 2>&1 | head",
        f"python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', {listener.port}), 2)\" "
        "&& echo LOOPBACK-REACHED || echo loopback-blocked; "
        "python3 -c \"import socket; s=socket.create_connection(('1.1.1.1', 80), 2)\" "
        "&& echo INTERNET-REACHED || echo internet-blocked; "
        "getent hosts pypi.org && echo DNS-RESOLVED || echo no-dns",
        "env; cat ~/.pi/agent/*.json; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -i key; "
        "ps aux 2>/dev/null || cat /proc/*/cmdline | tr '\\0' ' '",
        "echo pwned > /etc/pwned-by-agent; echo pwned > /usr/pwned-by-agent; echo pwned > /opt/pi-env/runtime/pwned; "
        "touch /tmp/ok-in-tmpfs && echo tmp-ok",
    ]
    key = server.add_script([bash(p) for p in probes] + [ScriptedTurn(text="done")], api_key=upstream_key)
    try:
        result = run_rollout(PiTask(instruction="x", verify=["true"]), scripted_config(server, upstream_key))
    finally:
        secret_file.unlink()
        listener.sock.close()
    assert result.reward == 1.0 and result.error_kind is None  # the rollout still returns, scored
    seen = tool_outputs(result) + json.dumps(result.files) + result.agent_log_tail
    assert "tmp-ok" in seen  # the probes really ran
    assert "HOST-SECRET" not in seen
    assert Path("/etc/shadow").read_text().splitlines()[0] not in seen
    assert upstream_key not in seen
    assert listener.connections == 0
    assert "loopback-blocked" in seen and "LOOPBACK-REACHED" not in seen
    assert "internet-blocked" in seen and "INTERNET-REACHED" not in seen
    assert "no-dns" in seen and "DNS-RESOLVED" not in seen
    assert not Path("/etc/pwned-by-agent").exists() and not Path("/usr/pwned-by-agent").exists()
    # The upstream saw the real key; the sandbox only ever held the session token.
    assert key == upstream_key and len(server.requests) == len(probes) + 1
    assert all(r.api_key == upstream_key for r in server.requests)


def test_fork_bomb_is_contained():
    task = PiTask(task_id="forkbomb", instruction="x", verify=["true"], timeouts={"agent_s": 20},
                  solution=[{"tool": "bash", "command": "timeout 5 bash -c ':(){ :|:& };:' ; echo survived"}])
    result, uid = rollout_with_uid(task, PiConfig(limits={"max_processes": 64}))
    assert result.error_kind in (None, "agent_timeout")
    assert processes_of_uid(uid) == []


def test_session_api_and_trace():
    task = EXAMPLES[0]
    factory = PiSessionFactory(PiConfig(), sandbox_backend="local", mode="black_box")
    with factory.create(task) as session:
        uid = session.sandbox.uid
        result = session.wait_for_completion(timeout_s=120)
        assert session.wait_for_completion() is result  # idempotent
        trace = session.fetch_proxy_trace()
    assert result.reward == 1.0 and len(trace) == len(task.solution) + 1
    assert processes_of_uid(uid) == []


def test_wait_for_completion_timeout_raises_and_rollout_continues():
    task = PiTask(task_id="slow", instruction="x", verify=["test -f done.txt"],
                  solution=[{"tool": "bash", "command": "sleep 2; touch done.txt"}])
    with PiSessionFactory().create(task) as session:
        with pytest.raises(TimeoutError):
            session.wait_for_completion(timeout_s=0.2)
        assert session.wait_for_completion().reward == 1.0


def test_wait_for_completion_timeout_bounds_verify_and_every_caller():
    """The timeout holds while verify runs, and a second caller waiting at the same time gets
    its own TimeoutError on time instead of blocking behind the first."""
    task = PiTask(task_id="slow-verify", instruction="x", verify=["sleep 6; test -f done.txt"],
                  solution=[{"tool": "bash", "command": "touch done.txt"}])
    with PiSessionFactory().create(task) as session:
        deadline = time.monotonic() + 60
        while session.ctx.agent.poll() is None and time.monotonic() < deadline:  # the agent is done: verify next
            time.sleep(0.05)
        outcomes = {}

        def second_caller():
            started = time.monotonic()
            try:
                session.wait_for_completion(timeout_s=1.0)
                outcomes["second"] = "returned"
            except TimeoutError:
                outcomes["second"] = time.monotonic() - started

        other = threading.Thread(target=second_caller)
        started = time.monotonic()
        other.start()
        with pytest.raises(TimeoutError):
            session.wait_for_completion(timeout_s=1.5)
        first_waited = time.monotonic() - started
        other.join(10)
        assert first_waited < 4, f"the timeout did not bound verify: {first_waited:.1f} s"
        assert isinstance(outcomes["second"], float) and outcomes["second"] < 4, outcomes
        result = session.wait_for_completion(timeout_s=60)
        assert result.reward == 1.0 and result.verify_results[0].duration_s >= 5
        assert session.wait_for_completion(timeout_s=0) is result


def test_oracle_needs_a_solution():
    from pi_env.endpoints import EndpointError

    with pytest.raises(EndpointError, match="no solution"):
        run_rollout(PiTask(instruction="x", verify=["true"]))


def test_no_verify_is_unscored():
    result = run_rollout(PiTask(instruction="x", solution=[{"tool": "bash", "command": "true"}]))
    assert result.reward is None and result.error_kind == "no_verify"


def test_host_environment_does_not_leak(monkeypatch):
    monkeypatch.setenv("PI_ENV_TEST_HOST_SECRET", "leaky-value-123")
    task = PiTask(instruction="x", verify=["! env | grep -q leaky-value"],
                  solution=[{"tool": "bash", "command": "env > env.txt"}])
    result = run_rollout(task)
    assert result.reward == 1.0 and "leaky-value" not in result.files["env.txt"]
    assert "HOME=/root" in result.files["env.txt"]
    assert os.environ["PI_ENV_TEST_HOST_SECRET"] == "leaky-value-123"


def test_legacy_pi_073_on_system_node(server):
    """An older pin (the pre-rename package, node >= 20.6) runs the same way; it has no -na, so
    the task's .pi/ is masked instead."""
    from pi_env.config import LEGACY_PI_PACKAGE

    legacy = {"agent": {"pi": {"package": LEGACY_PI_PACKAGE, "version": "0.73.1"}}}
    result = run_rollout(EXAMPLES[0], PiConfig(**legacy))
    assert result.reward == 1.0 and result.pi_version == "0.73.1", (result.error, result.agent_log_tail)
    files = {".pi/settings.json": json.dumps({"retry": {"enabled": True}}), ".pi/SYSTEM.md": "PWNED-SYSTEM-PROMPT"}
    key = server.add_script([ScriptedTurn(text="ok")])
    result = run_rollout(PiTask(instruction="x", files=files, verify=["test -f .pi/SYSTEM.md"]),
                         scripted_config(server, key, **legacy))
    assert result.reward == 1.0  # the task's files are back for verification
    assert "PWNED" not in json.dumps([r.body for r in server.requests if r.api_key == key])


# -- transparent_proxy through the real Pi ------------------------------------------------------


def test_transparent_proxy_captures_every_turn_with_engine_ids(server, tmp_path):
    """Against an engine-like upstream: each turn's ids and logprobs are exactly what the
    upstream sent, the training view is one append-only sequence, and the trace file holds a
    line per turn without the real key."""
    upstream_key = "sk-upstream-never-in-trace"
    turns = [bash("echo hi > a.txt"), ScriptedTurn(reasoning="checking", text="All done.")]
    server.add_script(turns, api_key=upstream_key)
    config = scripted_config(
        server,
        upstream_key,
        mode={"name": "transparent_proxy", "trace_dir": str(tmp_path), "sampling": {"temperature": 0.0, "seed": 7}, "top_logprobs": 3},
    )
    result = run_rollout(PiTask(instruction="write a.txt", verify=["test -f a.txt"]), config)
    assert result.reward == 1.0 and result.error_kind is None
    assert len(result.proxy_turns) == 2
    requests = [r.body for r in server.requests if r.api_key == upstream_key]
    for turn, request in zip(result.proxy_turns, requests):
        assert request["logprobs"] is True and request["top_logprobs"] == 3 and request["return_token_ids"] is True
        assert request["temperature"] == 0.0 and request["seed"] == 7 and request["model"] == "scripted-model"
        direct = direct_answer(server, upstream_key, request)
        assert turn.prompt_token_ids == direct["prompt_token_ids"]
        assert turn.completion_token_ids == direct["choices"][0]["token_ids"]
        assert turn.per_token_logps == [e["logprob"] for e in direct["choices"][0]["logprobs"]["content"]]
        assert all(len(top) == 3 for top in turn.top_logprobs) and turn.token_ids_source == "token_ids"
    assert result.proxy_turns[0].message["tool_calls"][0]["function"]["name"] == "bash"
    assert result.proxy_turns[1].message["reasoning_content"] == "checking"
    training = result.training
    assert training.append_only and training.segments[0].turns == [0, 1]
    segment = training.segments[0]
    generated = [tid for tid, mask in zip(segment.token_ids, segment.loss_mask) if mask]
    assert generated == result.proxy_turns[0].completion_token_ids + result.proxy_turns[1].completion_token_ids
    lines = Path(result.trace_path).read_text().splitlines()
    assert len(lines) == 2 and upstream_key not in "".join(lines)
    assert json.loads(lines[0])["capture"]["completion_token_ids"] == result.proxy_turns[0].completion_token_ids


def test_token_budget_ends_the_rollout_cleanly(server):
    key = server.add_script([bash(f"echo {i} >> log.txt") for i in range(5)] + [ScriptedTurn(text="done")])
    config = scripted_config(server, key, mode="transparent_proxy", gateway={"max_total_tokens": 1})
    result = run_rollout(PiTask(instruction="x", verify=["test -f log.txt"]), config)
    assert result.stop_reason == "budget" and result.budget_exhausted == "max_total_tokens"
    assert result.error_kind is None and result.reward == 1.0  # what the agent did is still scored
    assert len(result.proxy_turns) == 1 and result.files["log.txt"] == "0\n"


def test_events_report_phases_and_each_model_call_live():
    """on_event sees every phase open and close in lifecycle order, each model call as it is
    recorded (before the rollout ends, with the turn's data), then "done" with the reward."""
    task = PiTask(task_id="events", instruction="write x", verify=["grep -q hi x.txt"],
                  solution=[{"tool": "write", "path": "x.txt", "content": "hi\n"},
                            {"tool": "bash", "command": "cat x.txt"}])
    events = []
    result = run_rollout(task, on_event=events.append)
    assert result.reward == 1.0
    kinds = [e.kind for e in events]
    assert kinds[-1] == "done" and kinds.count("done") == 1
    assert events[-1].reward == 1.0 and events[-1].error_kind is None
    started = [e.phase for e in events if e.kind == "phase_start"]
    assert [e.phase for e in events if e.kind == "phase_end"] == started
    assert started == ["runtime", "sandbox_create", "setup", "agent_start", "agent", "verify", "collect"]
    turns = [e.turn for e in events if e.kind == "turn"]
    assert [t.turn for t in turns] == [t.turn for t in result.proxy_turns] == [0, 1, 2]
    assert all(t.upstream_status == 200 for t in turns)
    position = {(e.kind, e.phase): i for i, e in enumerate(events)}
    turn_positions = [i for i, e in enumerate(events) if e.kind == "turn"]
    assert turn_positions[0] < position["phase_end", "agent"]  # live: while the agent runs
    assert turn_positions[-1] < position["phase_start", "verify"]
    assert [e.elapsed_s for e in events] == sorted(e.elapsed_s for e in events)


def test_a_failing_event_listener_does_not_fail_the_rollout():
    def listener(event):
        raise RuntimeError("listener bug")

    task = PiTask(task_id="bad-listener", instruction="write x", verify=["test -f x.txt"],
                  solution=[{"tool": "write", "path": "x.txt", "content": "hi\n"}])
    result = run_rollout(task, on_event=listener)
    assert result.reward == 1.0 and result.error_kind is None


def test_the_system_prompt_in_the_result_is_the_text_the_model_saw(tmp_path):
    """messages[0] is the system message exactly as the model was sent it (the gateway's record),
    appended text too; Pi's session file (which has it only as `sections`) is the untrusted extra."""
    config = PiConfig(
        mode={"name": "transparent_proxy", "trace_dir": str(tmp_path)},
        agent={"pi": {"append_system_prompt": "Answer in French."}},
    )
    result = run_rollout(EXAMPLES[0], config)
    assert result.reward == 1.0, result.error
    system = result.messages[0]
    sent = json.loads(Path(result.trace_path).read_text().splitlines()[0])["capture"]["request"]["messages"][0]
    assert system == sent and system["role"] == "system"
    assert result.pi_session_messages[0]["role"] == "system" and result.pi_session_messages[0]["sections"]
    assert "Answer in French." in system["content"] and "You are" in system["content"]


def own_call(stream: bool) -> str:
    """The agent calls the gateway itself, with Pi's own token (one assistant message in its
    history: the scripted server answers with the script's second turn)."""
    return ("python3 -c \"import json, urllib.request; p = json.load(open('/root/.pi/agent/models.json'))"
            "['providers']; p = next(iter(p.values())); urllib.request.urlopen(urllib.request.Request("
            f"p['baseUrl'] + '/chat/completions', json.dumps({{'model': 'm', 'stream': {stream}, 'messages': "
            "[{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': 'a'}, {'role': 'user', 'content': 'b'}]})"
            ".encode(), {'Authorization': 'Bearer ' + p['apiKey'], "
            "'Content-Type': 'application/json'}), timeout=120)\"")


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
@pytest.mark.parametrize("mode", ["black_box", "transparent_proxy"])
def test_an_agents_own_slow_call_at_its_time_limit_is_scored(server, mode, stream):
    """A zero stays a zero, by ownership: the agent leaves its own call in flight, the endpoint's
    first byte not yet in, when its time runs out. It chose when and how to call, streamed or not,
    so the rollout is verified and scored (it used to be agent_timeout, unscored, and dropped from
    the group: for any streamed call, and before that for an unstreamed one too)."""
    key = server.add_script([bash(own_call(stream)), ScriptedTurn(text="late", fault=Fault(hang_s=60)),
                             ScriptedTurn(text="done")])
    config = scripted_config(server, key, mode=mode)
    result = run_rollout(PiTask(instruction="x", verify=["test -f solved.txt"], timeouts={"agent_s": 6}), config)
    assert result.stop_reason == "timeout" and result.truncated and result.proxy_turns[-1].upstream_status is None
    assert result.error_kind is None and result.reward == 0.0, (result.error_kind, result.error)
