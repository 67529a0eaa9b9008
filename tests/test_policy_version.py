"""Async RL across engine replicas (docs/async-rl.md): the policy version each turn records, the
session id header a router keeps a session on one replica by, and vLLM's cache_salt per version.
Real gateway, real sockets, the scripted server as the engine (it records what it received)."""

import asyncio
import concurrent.futures
import dataclasses

import aiohttp
import msgspec
import pytest
from helpers import bash, chat, scripted_config
from test_gateway import REAL_KEY, call, upstream

from pi_env import PiConfig, PiSessionFactory
from pi_env.proxy import PolicyVersion, Routing, Upstream
from pi_env.proxy.gate import CompletionInvalid, GateCompletion
from pi_env.proxy.records import cache_salt
from pi_env.scripted import ScriptedTurn
from pi_env.training import build_training_trace

NOWHERE = Upstream("http://interception-gate.invalid/v1", None, "trainer-model")
RELAYING = ["black_box", "transparent_proxy"]


async def post_with(gateway, session, headers):
    async with aiohttp.ClientSession() as client:
        async with client.post(gateway.tcp_base_url + "/chat/completions", json=chat(),
                               headers={"Authorization": f"Bearer {session.token}", **headers}) as answer:
            await answer.read()
            return answer.status


def answered(session, calls=1):
    assert session.wait_idle(5)
    assert len(session.turns) == calls
    return session.turns


def received(server):
    return [r for r in server.requests if r.path.endswith("/chat/completions")]


# ------------------------------------------------------------------------ the session header


@pytest.mark.parametrize("mode", RELAYING)
def test_every_call_carries_the_sessions_id_stable_within_and_distinct_across_sessions(gateway, server, mode):
    sessions = [gateway.open_session(upstream(server, [ScriptedTurn(text="ok")] * 3), mode=mode) for _ in range(2)]
    try:
        for session in sessions:
            for _ in range(2):
                assert call(gateway, session)[0] == 200
            assert call(gateway, session, "/models", method="GET", body=None)[0] == 200
    finally:
        for session in sessions:
            gateway.close_session(session)
    ids = [r.headers.get("x-session-id") for r in server.requests]
    assert ids == [sessions[0].id] * 3 + [sessions[1].id] * 3
    assert sessions[0].id != sessions[1].id
    for session in sessions:  # the id is not the session's secret, nor any part of it
        assert session.id not in session.token and session.token not in session.id


@pytest.mark.parametrize("mode", RELAYING)
def test_the_agent_cannot_set_or_spoof_the_session_header_or_the_version(gateway, server, mode):
    routing = Routing(session_header="X-Stainless-Session", version_header="X-Policy-Version")
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]), mode=mode, routing=routing,
                                   policy=PolicyVersion(3))
    spoofed = {"X-Session-ID": "victim", "X-Stainless-Session": "victim", "X-Policy-Version": "999",
               "Session-ID": "victim", "X-Session-Affinity": "victim"}
    try:
        # x-stainless-* is on the allow-list of the agent's headers: the gateway's value replaces it.
        assert asyncio.run(post_with(gateway, session, spoofed)) == 200
    finally:
        gateway.close_session(session)
    (sent,) = received(server)
    assert sent.headers["x-stainless-session"] == session.id
    # Compare whole values: the session id is random hex and may contain "999" by chance.
    values = list(sent.headers.values())
    assert not any("victim" in v for v in values) and "999" not in values
    (turn,) = answered(session)
    assert (turn.policy_version, turn.policy_version_source) == (3, "gateway")  # not the agent's 999


def test_no_session_header_when_configured_off(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]),
                                   routing=Routing(session_header=None))
    try:
        assert call(gateway, session)[0] == 200
    finally:
        gateway.close_session(session)
    (sent,) = received(server)
    assert "x-session-id" not in sent.headers


@pytest.mark.parametrize("name", ["Authorization", "Host", "bad header", "X-Ok\r\nInjected: 1", ""])
def test_a_header_name_the_gateway_cannot_own_is_refused_with_the_field(name):
    with pytest.raises(ValueError, match="session_header"):
        Routing(session_header=name)
    with pytest.raises(ValueError, match="gateway_session_header"):
        PiConfig(gateway={"session_header": name})


# ------------------------------------------------------------------------ the policy version


@pytest.mark.parametrize("mode", RELAYING)
def test_the_version_in_force_when_a_call_is_sent_is_recorded_and_follows_set(gateway, server, mode):
    policy = PolicyVersion()
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")] * 4), mode=mode, policy=policy)
    try:
        assert call(gateway, session)[0] == 200  # never set: None
        policy.set(1)
        assert call(gateway, session)[0] == 200
        session.set_policy_version("ckpt-2")  # the gateway session's own door to the same holder
        assert call(gateway, session)[0] == 200
        assert policy.value == "ckpt-2"
    finally:
        gateway.close_session(session)
    turns = answered(session, 3)
    assert [t.policy_version for t in turns] == [None, 1, "ckpt-2"]
    assert [t.policy_version_source for t in turns] == ["gateway"] * 3
    lines = [msgspec.json.decode(msgspec.json.encode(t.to_json())) for t in turns]  # as the trace file has them
    assert [(line["policy_version"], line["policy_version_source"]) for line in lines] == [
        (None, "gateway"), (1, "gateway"), ("ckpt-2", "gateway")]


def test_one_holder_reaches_every_session_already_open_from_any_thread(gateway, server):
    policy = PolicyVersion(0)
    sessions = [gateway.open_session(upstream(server, [ScriptedTurn(text="ok")] * 2), policy=policy)
                for _ in range(3)]
    try:
        for session in sessions:
            assert call(gateway, session)[0] == 200
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the trainer's thread, not the loop's
            list(pool.map(policy.set, [5]))
        for session in sessions:
            assert call(gateway, session)[0] == 200
    finally:
        for session in sessions:
            gateway.close_session(session)
    for session in sessions:
        assert [t.policy_version for t in answered(session, 2)] == [0, 5]


def test_a_version_the_engine_reports_wins_and_is_recorded_as_the_engines(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")] * 3),
                                   routing=Routing(version_header="X-Policy-Version"), policy=PolicyVersion(4))
    try:
        assert call(gateway, session)[0] == 200  # no header: the version in force
        server.quirks = dataclasses.replace(server.quirks, answer_headers=(("X-Policy-Version", "5"),))
        assert call(gateway, session)[0] == 200
        server.quirks = dataclasses.replace(server.quirks, answer_headers=(("X-Policy-Version", "step-6"),))
        assert call(gateway, session)[0] == 200
    finally:
        gateway.close_session(session)
    turns = answered(session, 3)
    assert [(t.policy_version, t.policy_version_source) for t in turns] == [
        (4, "gateway"), (5, "engine"), ("step-6", "engine")]


@pytest.mark.parametrize("version", [[1], {"step": 1}, float("nan"), object()])
def test_a_version_that_is_not_a_json_scalar_is_refused(version):
    with pytest.raises((TypeError, ValueError), match="version"):
        PolicyVersion().set(version)
    with pytest.raises(ValueError, match="policy_version"):
        PiConfig(gateway={"policy_version": version})


# ------------------------------------------------------------------------------ cache_salt


def test_cache_salt_is_in_every_body_and_changes_with_the_version(gateway, server):
    policy = PolicyVersion(1)
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")] * 3), mode="transparent_proxy",
                                   policy=policy, routing=Routing(cache_salt=True))
    try:
        # The agent's own cache_salt never reaches the engine: the gateway's replaces it.
        assert call(gateway, session, body={**chat(), "cache_salt": "shared-with-everyone"})[0] == 200
        assert call(gateway, session)[0] == 200
        policy.set(2)
        assert call(gateway, session)[0] == 200
    finally:
        gateway.close_session(session)
    salts = [r.body["cache_salt"] for r in received(server)]
    assert salts == [cache_salt(1), cache_salt(1), cache_salt(2)]
    assert salts[0] != salts[2] and "shared-with-everyone" not in salts
    turns = answered(session, 3)
    assert [t.capture.request["cache_salt"] for t in turns] == salts  # the record is what was sent
    assert [t.policy_version for t in turns] == [1, 1, 2]


def test_no_cache_salt_unless_asked(gateway, server):
    session = gateway.open_session(upstream(server, [ScriptedTurn(text="ok")]), mode="transparent_proxy")
    try:
        assert call(gateway, session)[0] == 200
    finally:
        gateway.close_session(session)
    assert "cache_salt" not in received(server)[0].body


@pytest.mark.parametrize("mode", ["black_box", "interception_gate"])
def test_cache_salt_where_bodies_are_not_rewritten_is_refused_with_what_to_fix(gateway, server, mode):
    with pytest.raises(ValueError, match="cache_salt.*transparent_proxy"):
        gateway.open_session(Upstream(server.base_url, REAL_KEY), mode=mode, routing=Routing(cache_salt=True))
    with pytest.raises(ValueError, match="cache_salt is a setting of transparent_proxy, not of " + mode):
        PiConfig(mode={"name": mode, "cache_salt": True})
    salted = PiConfig(mode={"name": "transparent_proxy", "cache_salt": True})  # fine
    with pytest.raises(ValueError, match="cache_salt is a setting of transparent_proxy, not of " + mode):
        PiSessionFactory(salted, mode=mode)  # the factory's mode= is checked like the field


# --------------------------------------------------------------------- interception_gate


def test_the_gate_stamps_the_version_at_hand_off_and_a_trainer_may_name_its_own(gateway, agent_pool):
    policy = PolicyVersion(7)
    session = gateway.open_session(NOWHERE, mode="interception_gate", gate_timeout_s=30, policy=policy)
    gate = session.strategy
    try:
        for delivered_version, expected in [(None, (7, "gateway")), (9, (9, "trainer"))]:
            pending = agent_pool.submit(call, gateway, session, body=chat())
            request = gate.next_request(timeout_s=10)
            assert request.policy_version == 7 and request.session_id == session.id
            policy.set(8)  # changed while the trainer generates: the hand-off's version stands
            with pytest.raises(CompletionInvalid, match="policy_version"):
                gate.deliver(request, GateCompletion(text="x", policy_version=[1]))
            gate.deliver(request, GateCompletion(text="done", policy_version=delivered_version))
            assert pending.result(10)[0] == 200
            policy.set(7)
            assert session.wait_idle(5)
            assert (session.turns[-1].policy_version, session.turns[-1].policy_version_source) == expected
    finally:
        gateway.close_session(session)


@pytest.fixture
def agent_pool():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        yield pool


# ------------------------------------------------------------------------ the training view


def test_the_training_trace_carries_each_segments_versions_and_their_span():
    def turn(index, prompt, completion, version):
        return dataclasses.make_dataclass("T", ["turn", "prompt_token_ids", "completion_token_ids",
                                                "per_token_logps", "policy_version"])(
            index, prompt, completion, [-0.1] * len(completion), version)

    trace = build_training_trace([turn(0, [1, 2], [3], 4), turn(1, [1, 2, 3, 9], [5], 6), turn(2, [7], [8], 5)])
    assert [s.policy_versions for s in trace.segments] == [[4, 6], [5]]
    assert (trace.policy_versions, trace.policy_version_min, trace.policy_version_max) == ([4, 6, 5], 4, 6)
    unknown = build_training_trace([turn(0, [1], [2], None), turn(1, [1, 2, 3], [4], 3)])
    assert unknown.policy_versions == [None, 3]
    assert (unknown.policy_version_min, unknown.policy_version_max) == (None, None)  # never from part of it
    named = build_training_trace([turn(0, [1], [2], "a"), turn(1, [1, 2], [3], "a")])
    assert (named.policy_versions, named.policy_version_min) == (["a"], None)


# ------------------------------------------- a factory's rollouts, the real Pi (docs/async-rl.md)


@pytest.mark.needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("mode", RELAYING)
def test_a_factorys_version_reaches_its_running_rollouts_and_every_record(server, mode):
    """The trainer sets a new version after each recorded call of a rollout already running (as
    weights land mid-rollout): its next call records it; every call carries the rollout's id,
    which is on the result; the collect record and the training view carry the versions."""
    from pi_env import PiSessionFactory, PiTask
    from pi_env.collect.records import to_record

    key = server.add_script([bash("echo 1 > a.txt"), bash("echo 2 >> a.txt"), ScriptedTurn(text="done")])
    salt = {"cache_salt": True} if mode == "transparent_proxy" else {}
    factory = PiSessionFactory(scripted_config(server, key, mode={"name": mode, **salt}, gateway={"policy_version": 10}))
    task = PiTask(task_id="v", instruction="write a.txt", verify=["test -f a.txt"])

    def on_event(event):
        if event.kind == "turn":
            factory.set_policy_version(factory.policy_version + 1)

    with factory.create(task, on_event=on_event) as session:
        result = session.wait_for_completion(timeout_s=120)
    assert result.reward == 1.0, result.error
    assert [(t.policy_version, t.policy_version_source) for t in result.proxy_turns] == [
        (10, "gateway"), (11, "gateway"), (12, "gateway")]
    sent = received(server)
    assert len(sent) == 3 and {r.headers["x-session-id"] for r in sent} == {result.session_id}
    record = to_record(result, task=task, group_index=0, attempt=0)
    assert [t["policy_version"] for t in record["turns"]] == [10, 11, 12]
    assert record["session_id"] == result.session_id
    if mode == "transparent_proxy":
        assert [r.body["cache_salt"] for r in sent] == [cache_salt(10), cache_salt(11), cache_salt(12)]
        training = result.training
        assert (training.policy_version_min, training.policy_version_max) == (10, 12)
        assert [v for s in training.segments for v in s.policy_versions] == [10, 11, 12]
        assert record["training"]["policy_version_max"] == 12
