"""interception_gate: the agent's call is held at the gateway, handed to the trainer, and
answered with what the trainer delivers. Real gateway, real sockets; the test is the trainer.
The last tests drive the real Pi through PiSessionFactory."""

import asyncio
import concurrent.futures
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from helpers import TOOLS, USER, chat, wait_for
from test_gateway import call, sse_json

from pi_env import PiConfig, PiSessionFactory
from pi_env.proxy import Upstream
from pi_env.proxy.capture import Assembler, TurnCapture
from pi_env.proxy.gate import CompletionInvalid, GateCompletion, GateRequest, RequestNotPending, parse_hermes
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.training import build_training_trace

NOWHERE = Upstream("http://interception-gate.invalid/v1", None, "trainer-model")


@pytest.fixture
def open_gate(gateway):
    """open_gate(timeout_s=30, **gateway options) -> an interception_gate session; closed after."""
    opened = []

    def open_(timeout_s=30.0, **kwargs):
        session = gateway.open_session(NOWHERE, mode="interception_gate", gate_timeout_s=timeout_s, **kwargs)
        opened.append(session)
        return session

    yield open_
    for session in opened:
        gateway.close_session(session)


@pytest.fixture
def agent():
    """agent(gateway, session, body) -> a future of (status, headers, raw): the agent's call,
    made on another thread while the test plays the trainer."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=40)

    def send(gateway, session, body=None, **kwargs):
        return pool.submit(call, gateway, session, body=body or chat(tools=True), **kwargs)

    yield send
    pool.shutdown(wait=True, cancel_futures=True)


def assembled(raw: bytes) -> TurnCapture:
    return Assembler(TurnCapture(request={})).stream(raw)


def only_turn(session):
    assert session.wait_idle(5)
    (turn,) = session.turns
    return turn


COMPLETION = GateCompletion(
    token_ids=[101, 102, 103, 104], logprobs=[-0.5, None, -0.25, -1.0], prompt_token_ids=[1, 2, 3],
    message={"reasoning_content": "Let me write it.", "content": "Writing the file.",
             "tool_calls": [{"name": "bash", "arguments": {"command": "echo hi > a.txt"}},
                            {"id": "call_read", "type": "function",
                             "function": {"name": "read", "arguments": "{\"path\": \"a.txt\"}"}}]},
)


# ------------------------------------------------------------------------- request -> answer


def test_held_call_reaches_the_trainer_and_its_completion_reaches_the_agent_as_sse(gateway, open_gate, agent):
    options = CaptureOptions(sampling={"temperature": 1.0, "seed": 7})
    session = open_gate(capture=options, max_tokens_cap=64)
    body = chat(tools=True, temperature=0.2, top_p=0.9, max_tokens=10_000, tool_choice="auto")
    pending = agent(gateway, session, body)
    request = session.strategy.next_request(5)
    assert isinstance(request, GateRequest) and request.session_id == session.id and request.turn == 0
    assert request.messages == [USER] and request.tools == TOOLS and request.stream is True
    # As the agent sent it, but for the model (the session's, whatever the agent named) and its
    # token limit (the session's cap, in every mode): policy.py
    assert request.body == {**body, "model": NOWHERE.model, "max_tokens": 64} and body["model"] != NOWHERE.model
    assert request.sampling == {"temperature": 1.0, "top_p": 0.9, "max_tokens": 64, "seed": 7}
    assert request.received_at <= time.time() < request.expires_at == request.received_at + 30
    assert not pending.done()  # held until the trainer delivers

    session.strategy.deliver(request, COMPLETION)
    request.messages.append({"role": "system", "content": "the trainer's own edit"})  # its copy only
    status, headers, raw = pending.result(5)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    chunks = sse_json(raw)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0, 1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    message = assembled(raw).choices[0].message()
    assert message["reasoning_content"] == "Let me write it." and message["content"] == "Writing the file."
    bash, read = message["tool_calls"]
    assert bash["function"] == {"name": "bash", "arguments": json.dumps({"command": "echo hi > a.txt"})}
    assert bash["id"].startswith("call_") and read["id"] == "call_read"

    turn = only_turn(session)
    capture = turn.capture
    assert capture.token_ids_source == "trainer" and capture.token_ids_missing_reason is None
    assert capture.completion_token_ids == [101, 102, 103, 104]
    assert capture.per_token_logps == [-0.5, None, -0.25, -1.0]
    assert capture.prompt_token_ids == [1, 2, 3] and capture.request == {**body, "model": NOWHERE.model, "max_tokens": 64}
    assert capture.choices[0].message() == message
    assert turn.upstream_status == 200 and turn.total_tokens == 7 and turn.response_bytes == len(raw)
    assert 0 < turn.ttfb_s <= turn.latency_s and not turn.client_disconnected


def test_an_unstreamed_call_gets_a_chat_completion(gateway, open_gate, agent):
    session = open_gate()
    pending = agent(gateway, session, chat(stream=False, tools=True))
    request = session.strategy.next_request(5)
    assert request.stream is False
    session.strategy.deliver(request.request_id, {"token_ids": [5, 6], "text": "All done."})
    status, headers, raw = pending.result(5)
    body = json.loads(raw)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert body["object"] == "chat.completion" and body["model"] == NOWHERE.model  # the session's model
    assert body["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "All done."},
                                  "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 2
    capture = only_turn(session).capture
    assert capture.completion_token_ids == [5, 6] and capture.per_token_logps == [None, None]
    assert capture.token_ids_missing_reason == "the trainer delivered completion ids but no prompt_token_ids"


def test_turns_chain_into_one_training_sequence_and_the_trace_file(gateway, open_gate, agent, tmp_path):
    trace = tmp_path / "trace.jsonl"
    session = open_gate(trace_path=str(trace))
    gate = session.strategy
    history = [USER]
    delivered = [GateCompletion(token_ids=[10, 11], logprobs=[-0.1, -0.2], prompt_token_ids=[1, 2, 3],
                                text='<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'),
                 GateCompletion(token_ids=[30], logprobs=[-0.3], prompt_token_ids=[1, 2, 3, 10, 11, 20, 21],
                                text="Done.")]
    for completion in delivered:
        pending = agent(gateway, session, chat(history, tools=True))
        gate.deliver(gate.next_request(5), completion)
        raw = pending.result(5)[2]
        history = [*history, assembled(raw).choices[0].message(), {"role": "tool", "content": "a.txt"}]
    assert session.wait_idle(5) and [t.turn for t in session.turns] == [0, 1]
    view = build_training_trace(SimpleNamespace(turn=t.turn, prompt_token_ids=t.capture.prompt_token_ids,
                                                completion_token_ids=t.capture.completion_token_ids,
                                                per_token_logps=t.capture.per_token_logps) for t in session.turns)
    assert view.append_only
    segment = view.segments[0]
    assert segment.token_ids == [1, 2, 3, 10, 11, 20, 21, 30]
    assert segment.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert segment.logprobs == [None, None, None, -0.1, -0.2, None, None, -0.3]
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["capture"]["completion_token_ids"] for line in lines] == [[10, 11], [30]]
    assert lines[0]["capture"]["token_ids_source"] == "trainer"
    assert lines[0]["capture"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "bash"


# ------------------------------------------------------------------------- text parsing


def test_hermes_text_becomes_tool_calls_and_reasoning():
    text = ('<think>\nI need a file.\n</think>\n\nOn it.\n<tool_call>\n{"name": "bash", "arguments": '
            '{"command": "touch x"}}\n</tool_call>\n<tool_call>\n{"name": "read", "arguments": {"path": "x"}}'
            "\n</tool_call>")
    assert parse_hermes(text) == {
        "reasoning_content": "I need a file.", "content": "On it.",
        "tool_calls": [{"name": "bash", "arguments": {"command": "touch x"}},
                       {"name": "read", "arguments": {"path": "x"}}]}
    # The template opened <think> itself: the text starts inside the thought.
    assert parse_hermes("thinking...</think>Answer.") == {"reasoning_content": "thinking...", "content": "Answer."}
    # Not a tool call: kept as the model wrote it.
    broken = 'Try: <tool_call>{"name": "bash", "arguments": </tool_call>'
    assert parse_hermes(broken) == {"content": broken}
    assert parse_hermes("<tool_call>[1, 2]</tool_call>") == {"content": "<tool_call>[1, 2]</tool_call>"}
    assert parse_hermes("x <think>y</think> z") == {"content": "x <think>y</think> z"}
    assert parse_hermes("") == {"content": None}


# --------------------------------------------------------------------------- deliver errors


def test_deliver_refuses_what_it_cannot_answer_and_the_request_stays_pending(gateway, open_gate, agent):
    session, other = open_gate(), open_gate()
    pending = agent(gateway, session)
    request = session.strategy.next_request(5)
    gate = session.strategy

    cases = [
        ({"token_ids": [1, 2], "logprobs": [-0.1], "text": "x"}, "2 token ids but 1 logprobs"),
        ({"token_ids": [1], "text": "x", "message": {"content": "y"}}, "exactly one of"),
        ({"token_ids": [1]}, "exactly one of"),
        ({"token_ids": [1, "2"], "text": "x"}, "token_ids must be a list of non-negative ints"),
        ({"token_ids": [1], "logprobs": [0.5], "text": "x"}, "log-probabilities"),
        ({"token_ids": [1], "logprobs": [float("nan")], "text": "x"}, "log-probabilities"),
        ({"message": {"tool_calls": [{"arguments": {}}]}}, "tool_calls[0] has no name"),
        ({"message": {"tool_calls": [{"name": "bash", "arguments": "{oops"}]}}, "arguments are not JSON"),
        ({"message": {"tool_calls": [{"name": "bash", "arguments": "[1]"}]}}, "must be a JSON object"),
        ({"message": {"content": 5}}, "message.content must be a string"),
        ({"text": "x", "tokens": [1]}, "unknown completion fields ['tokens']"),
    ]
    for completion, why in cases:
        with pytest.raises(CompletionInvalid, match=re.escape(why)):
            gate.deliver(request, completion)
    with pytest.raises(RequestNotPending, match="not one of session") as unknown:
        gate.deliver("gate-no-such-request", "x")
    assert unknown.value.reason == "unknown"
    with pytest.raises(RequestNotPending, match=f"belongs to session {session.id}"):
        other.strategy.deliver(request, "x")
    assert not pending.done()

    gate.deliver(request, {"token_ids": [7], "logprobs": [-0.7], "text": "ok"})
    assert pending.result(5)[0] == 200
    with pytest.raises(RequestNotPending, match="already delivered") as twice:
        gate.deliver(request, "again")
    assert twice.value.reason == "delivered"
    assert only_turn(session).capture.completion_token_ids == [7]
    assert other.turns == []


def nested(depth: int) -> dict:
    """A dict nesting `depth` levels (built without recursion)."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


class _Unprintable:
    def __str__(self) -> str:
        raise ValueError("no text for this id")


def test_deliver_refuses_nested_or_oversized_json_as_completion_invalid(gateway, open_gate, agent):
    """JSON nested past Python's recursion limit made deliver() raise a bare RecursionError; now
    every bad completion is CompletionInvalid saying what to fix, and the request stays pending."""
    from pi_env.proxy.tool_json import MAX_TOOL_CALL_CHARS

    session = open_gate()
    pending = agent(gateway, session)
    request = session.strategy.next_request(5)
    gate = session.strategy
    deep_text = '{"a": ' * 1200 + "1" + "}" * 1200
    big_text = '{"a": "' + "x" * MAX_TOOL_CALL_CHARS + '"}'

    def with_call(**call):
        return {"token_ids": [1], "message": {"tool_calls": [{"name": "bash", **call}]}}

    cases = [
        (with_call(arguments=nested(1200)), "arguments nest deeper than 63 levels"),
        (with_call(arguments=deep_text), "arguments nest deeper than 63 levels"),
        (with_call(arguments=big_text), "arguments are larger than 1,048,576 characters (the limit"),
        (with_call(arguments={"a": "x" * MAX_TOOL_CALL_CHARS}), "larger than 1,048,576 characters as JSON"),
        (with_call(arguments={"a": {1, 2}}), "arguments must be JSON-serialisable"),
        ({"token_ids": [1], "text": "x", "usage": nested(1200)}, "usage nests deeper than 64 levels"),
        ({"token_ids": [1], "text": "x", "usage": {"total": object()}}, "usage must be JSON-serialisable"),
        ({"token_ids": [1], "text": "x", "model": 5}, "model must be a string or None"),
        (with_call(arguments={}, id=_Unprintable()), "cannot be turned into an answer (ValueError: no text for this id)"),
    ]
    for completion, why in cases:
        with pytest.raises(CompletionInvalid, match=re.escape(why)):
            gate.deliver(request, completion)
    assert not pending.done()
    gate.deliver(request, {"token_ids": [7], "text": "fine"})
    assert assembled(pending.result(5)[2]).choices[0].content == "fine"


def test_hostile_text_reaches_the_agent_as_text_with_its_ids(gateway, open_gate, agent):
    """Delivered text is read in linear time and within the tool-call limits: a `<tool_call>`
    loop, JSON nested 1,200 deep (a RecursionError out of deliver before), `<` then `>`s, a call
    over 1 MiB. Each stays the assistant's content; the turn keeps the ids and logprobs."""
    from pi_env.proxy.tool_json import MAX_TOOL_CALL_CHARS

    deep = '<tool_call>\n{"name": "bash", "arguments": {"a": ' + "[" * 1200 + "]" * 1200 + "}}\n</tool_call>"
    big = '<tool_call>{"name": "bash", "arguments": {"a": "' + "x" * MAX_TOOL_CALL_CHARS + '"}}</tool_call>'
    ids = list(range(100, 164))
    for text in ("<tool_call>" * 4096, deep, "<" + ">" * 4095, big):
        session = open_gate()
        pending = agent(gateway, session, chat(stream=False, tools=True))
        session.strategy.deliver(session.strategy.next_request(5),
                                 {"token_ids": ids, "logprobs": [-0.5] * len(ids), "text": text})
        status, _, raw = pending.result(10)
        assert status == 200 and json.loads(raw)["choices"][0]["message"] == {"role": "assistant", "content": text}
        capture = only_turn(session).capture
        assert capture.completion_token_ids == ids and capture.per_token_logps == [-0.5] * len(ids)


# ------------------------------------------------------------------------ ending cleanly


def test_a_trainer_that_never_answers_gets_the_agent_a_clean_stop(gateway, open_gate, agent):
    session = open_gate(timeout_s=0.5)
    started = time.monotonic()
    pending = agent(gateway, session)
    request = session.strategy.next_request(5)
    status, _, raw = pending.result(5)
    assert 0.4 < time.monotonic() - started < 3
    chunks = sse_json(raw)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert assembled(raw).choices[0].message() == {"role": "assistant", "content": None}
    turn = only_turn(session)
    assert turn.capture.synthetic_answer == "gate_timeout" and turn.capture.completion_token_ids == []
    assert "did not deliver" in turn.upstream_error and "within 0.5 s" in turn.upstream_error
    assert session.strategy.stop_reason == "gate_timeout"
    assert session.stopped().reason == "gate_timeout" and "did not deliver" in session.stopped().message

    # The trainer answers late: refused, and it says why.
    with pytest.raises(RequestNotPending, match="expired after 0.5 s") as late:
        session.strategy.deliver(request, "too late")
    assert late.value.reason == "expired"
    # Any later call is stopped at once, without bothering the trainer.
    started = time.monotonic()
    assert agent(gateway, session).result(5)[0] == 200 and time.monotonic() - started < 0.4
    assert session.wait_idle(5) and session.turns[-1].capture.synthetic_answer == "gate_timeout"
    with pytest.raises(TimeoutError):
        session.strategy.next_request(0.05)


def test_closing_the_session_releases_every_held_call(gateway, open_gate, agent):
    session, idle = open_gate(), open_gate()
    held = [agent(gateway, session) for _ in range(3)]
    requests = [session.strategy.next_request(5) for _ in range(2)]  # two taken
    wait_for(lambda: len(session.strategy._queue) == 1)  # and one still queued
    gateway.close_session(session)
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(idle.strategy.next_request, 10)
    time.sleep(0.1)
    gateway.close_session(idle)
    assert waiting.result(5) is None  # a waiting trainer learns the session ended
    for future in held:
        status, _, raw = future.result(5)
        assert status == 200 and assembled(raw).choices[0].finish_reason == "stop"
    assert session.strategy.next_request(1) is None
    with pytest.raises(RequestNotPending, match="session ended") as closed:
        session.strategy.deliver(requests[0], "x")
    assert closed.value.reason == "closed"
    assert session.wait_idle(5) and {t.capture.synthetic_answer for t in session.turns} == {"closed"}


def test_an_agent_that_hangs_up_withdraws_its_request(gateway, open_gate):
    session = open_gate()

    async def impatient():
        async with aiohttp.ClientSession() as client:
            with pytest.raises(asyncio.TimeoutError):
                await client.post(gateway.tcp_base_url + "/chat/completions", json=chat(tools=True),
                                  headers={"Authorization": f"Bearer {session.token}"},
                                  timeout=aiohttp.ClientTimeout(total=0.3))

    asyncio.run(impatient())
    wait_for(lambda: session.turns)  # recorded once the gateway noticed the hang-up
    (turn,) = session.turns
    assert turn.client_disconnected and turn.capture is None
    with pytest.raises(TimeoutError):  # the withdrawn request is never handed out
        session.strategy.next_request(0.1)
    (withdrawn,) = session.strategy._requests
    with pytest.raises(RequestNotPending, match="the agent hung up") as gone:
        session.strategy.deliver(withdrawn, "x")
    assert gone.value.reason == "agent_disconnected"


def test_next_request_times_out_then_sees_the_agent_exit(open_gate):
    session = open_gate()
    gate = session.strategy
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no agent request within 0.2 s"):
        gate.next_request(0.2)
    assert 0.2 <= time.monotonic() - started < 1
    running = [True]
    threading.Timer(0.2, lambda: running.clear()).start()
    started = time.monotonic()
    assert gate.next_request(5, alive=lambda: bool(running)) is None
    assert time.monotonic() - started < 1 and gate.ended == "agent_exited"


def test_async_trainer(gateway, open_gate, agent):
    session = open_gate()
    pending = agent(gateway, session)

    async def trainer():
        request = await session.strategy.anext_request(5)
        await session.strategy.adeliver(request, {"token_ids": [4], "text": "async"})
        with pytest.raises(TimeoutError):
            await session.strategy.anext_request(0.1)

    asyncio.run(trainer())
    assert assembled(pending.result(5)[2]).choices[0].content == "async"


def test_held_calls_do_not_block_readers_of_the_trace(gateway, open_gate, agent):
    session = open_gate()
    first = agent(gateway, session)
    session.strategy.deliver(session.strategy.next_request(5), "one")
    first.result(5)
    second = agent(gateway, session)
    request = session.strategy.next_request(5)
    started = time.monotonic()
    assert session.wait_idle(5) and time.monotonic() - started < 0.5  # the held call is the trainer's
    assert len(session.turns) == 1
    session.strategy.deliver(request, "two")
    assert session.wait_idle(5) and len(session.turns) == 2  # delivered: a reader now waits for its record
    assert second.result(5)[0] == 200


def test_max_turns_still_ends_the_agent_without_asking_the_trainer(gateway, open_gate, agent):
    session = open_gate(max_turns=1)
    first = agent(gateway, session)
    session.strategy.deliver(session.strategy.next_request(5), {"token_ids": [1], "text": "one"})
    assert first.result(5)[0] == 200
    status, headers, raw = agent(gateway, session).result(5)
    assert status == 200 and headers["x-pi-env-budget"] == "max_turns"
    with pytest.raises(TimeoutError):
        session.strategy.next_request(0.1)
    assert session.budget_exhausted == "max_turns" and len(session.turns) == 1


def test_32_concurrent_sessions_each_get_their_own_requests(gateway, open_gate):
    n, turns = 32, 2
    sessions = [open_gate() for _ in range(n)]
    seen: dict[int, list[GateRequest]] = {i: [] for i in range(n)}

    def trainer(i):
        gate = sessions[i].strategy
        for k in range(turns):
            request = gate.next_request(10)
            seen[i].append(request)
            gate.deliver(request, GateCompletion(token_ids=[i, k], logprobs=[-1.0 * i, -1.0 * k],
                                                 text=f"session {i} turn {k}", prompt_token_ids=[1000 + i]))

    async def agent_of(client, i):
        history = [{"role": "user", "content": f"I am {i}"}]
        for k in range(turns):
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=chat(history, tools=True),
                                   headers={"Authorization": f"Bearer {sessions[i].token}"}) as r:
                assert r.status == 200
                text = assembled(await r.read()).choices[0].content
            assert text == f"session {i} turn {k}"
            history = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]

    async def agents():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            await asyncio.gather(*(agent_of(client, i) for i in range(n)))

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    asyncio.run(agents())
    for thread in threads:
        thread.join(5)
    assert time.monotonic() - started < 10
    for i, session in enumerate(sessions):
        assert [r.messages[0]["content"] for r in seen[i]] == [f"I am {i}"] * turns
        assert [r.turn for r in seen[i]] == list(range(turns)) and {r.session_id for r in seen[i]} == {session.id}
        assert session.wait_idle(5)
        assert [t.capture.completion_token_ids for t in session.turns] == [[i, k] for k in range(turns)]
    assert len({r.request_id for rs in seen.values() for r in rs}) == n * turns


# ------------------------------------------------------------------------------ real Pi

FILE_TASK = {"task_id": "gate-file", "instruction": "Create made.txt containing hello.",
             "verify": ["grep -qx hello made.txt"]}


def gate_factory(**mode_settings) -> PiSessionFactory:
    return PiSessionFactory(PiConfig(
        mode={"name": "interception_gate", **mode_settings},
        endpoint={"model": "trainer-model"},
        limits={"agent_timeout_s": 60},
    ))


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_pi_runs_the_trainers_tool_call_and_the_rollout_is_scored(tmp_path):
    first = GateCompletion(token_ids=[11, 12, 13], logprobs=[-0.1, -0.2, -0.3], prompt_token_ids=[1, 2],
                           text='<tool_call>\n{"name": "bash", "arguments": {"command": "echo hello > made.txt"}}'
                                "\n</tool_call>")
    final = GateCompletion(token_ids=[21], logprobs=[-0.05], prompt_token_ids=[1, 2, 11, 12, 13, 14, 15],
                           message={"content": "Created made.txt."})
    with gate_factory(trace_dir=str(tmp_path)).create(FILE_TASK) as session:
        request = session.next_request(30)
        assert request is not None and request.turn == 0
        assert "bash" in [tool["function"]["name"] for tool in request.tools]
        assert "made.txt" in json.dumps(request.messages)
        session.deliver(request, first)
        request = session.next_request(30)
        assert request.turn == 1
        (called,) = request.messages[-2]["tool_calls"]  # Pi sends back the call it ran, and its output
        assert called["function"]["name"] == "bash" and request.messages[-1]["role"] == "tool"
        assert json.loads(called["function"]["arguments"]) == {"command": "echo hello > made.txt"}
        session.deliver(request, final)
        assert session.next_request(30) is None  # Pi has its answer and exits
        result = session.wait_for_completion()
        trace = session.fetch_proxy_trace()
    assert result.error_kind is None and result.reward == 1.0, (result.error, result.agent_log_tail)
    assert result.mode == "interception_gate" and result.endpoint == "interception_gate" and not result.synthetic
    assert result.files["made.txt"] == "hello\n" and result.stop_reason == "stop"
    assert [t.completion_token_ids for t in result.proxy_turns] == [first.token_ids, final.token_ids]
    assert [t.per_token_logps for t in result.proxy_turns] == [first.logprobs, final.logprobs]
    assert [t.prompt_token_ids for t in trace] == [first.prompt_token_ids, final.prompt_token_ids]
    assert {t.token_ids_source for t in trace} == {"trainer"}
    assert result.proxy_turns[1].message == {"role": "assistant", "content": "Created made.txt."}
    assert result.training.append_only and result.training.segments[0].loss_mask == [0, 0, 1, 1, 1, 0, 0, 1]
    assert len(Path(result.trace_path).read_text().splitlines()) == 2


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_pi_rollout_ends_cleanly_when_the_trainer_answers_too_late():
    with gate_factory(gate_timeout_s=1.0).create(FILE_TASK) as session:
        started = time.monotonic()
        request = session.next_request(30)
        assert session.next_request(30) is None  # the deadline answered Pi with a stop; Pi exited
        with pytest.raises(RequestNotPending) as late:
            session.deliver(request, GateCompletion(token_ids=[1], text="late"))
        assert late.value.reason == "expired"
        result = session.wait_for_completion()
    assert time.monotonic() - started < 20
    assert result.error_kind == "gate_timeout" and result.reward is None and result.stop_reason == "gate_timeout"
    assert "did not deliver" in result.error and result.verify_results == []
    (turn,) = result.proxy_turns
    assert turn.completion_token_ids == [] and "did not deliver" in turn.upstream_error


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_concurrent_pi_rollouts_each_get_their_own_requests():
    factory = gate_factory()
    tasks = [{**FILE_TASK, "task_id": f"gate-{i}", "instruction": f"Write {i} into n.txt.",
              "verify": [f"grep -qx {i} n.txt"]} for i in range(4)]

    def rollout(i):
        with factory.create(tasks[i]) as session:
            request = session.next_request(60)
            assert f"Write {i} into n.txt." in json.dumps(request.messages)
            session.deliver(request, {"token_ids": [i], "message": {
                "tool_calls": [{"name": "bash", "arguments": {"command": f"echo {i} > n.txt"}}]}})
            session.deliver(session.next_request(60), {"token_ids": [i, i], "text": "done"})
            assert session.next_request(60) is None
            return session.wait_for_completion()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(rollout, range(4)))
    for i, result in enumerate(results):
        assert result.reward == 1.0, (result.error, result.agent_log_tail)
        assert [t.completion_token_ids for t in result.proxy_turns] == [[i], [i, i]]
