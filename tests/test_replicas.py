"""Several replicas, one endpoint (docs/async-rl.md, "Several replicas"): several scripted
servers behind one gateway session's endpoint; sticky, least-loaded sessions; failover before
the first answer byte only, re-sent byte-identical, flagged; every request each server received
counted; credentials never shown. The collect across three replicas with one killed mid-run is at
the end (real Pi, real bubblewrap)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp
import msgspec
import pytest
from helpers import chat

from pi_env.config import PiConfig
from pi_env.endpoints import resolve_endpoint
from pi_env.judge import AgentEnd, LastCall, judge_agent
from pi_env.proxy import Gateway, Upstream
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.scripted import EngineQuirks, Fault, ScriptedServer, ScriptedToolCall, ScriptedTurn

KEY = "sk-replica-key-0123456789abcdef"
MODES = ["black_box", "transparent_proxy"]


@pytest.fixture
def gateway():
    """A gateway of each test's own: replica health is per gateway."""
    gw = Gateway(read_timeout_s=5.0).start()
    yield gw
    gw.close()


class Replicas:
    """n scripted servers serving the same script under KEY (a model served n times)."""

    def __init__(self, n: int, turns, *, quirks: EngineQuirks | None = None):
        self.servers = [ScriptedServer(quirks=quirks).start() for _ in range(n)]
        for server in self.servers:
            server.add_script(turns, api_key=KEY)

    def upstream(self, **kwargs) -> Upstream:
        urls = tuple(s.base_url for s in self.servers)
        return Upstream(urls[0], KEY, "m", base_urls=urls, **kwargs)

    def host(self, i: int) -> str:
        return f"127.0.0.1:{self.servers[i].port}"

    def index(self, host: str) -> int:
        return [self.host(i) for i in range(len(self.servers))].index(host)

    def chat_requests(self, i: int) -> list:
        return [r for r in self.servers[i].requests if r.path.endswith("completions")]

    def counts(self) -> list[int]:
        return [len(self.chat_requests(i)) for i in range(len(self.servers))]

    def close(self):
        for server in self.servers:
            server.stop()


@pytest.fixture
def make_replicas():
    made: list[Replicas] = []

    def make(n, turns, **kwargs):
        made.append(Replicas(n, turns, **kwargs))
        return made[-1]

    yield make
    for replicas in made:
        replicas.close()


async def _post(url, token, body):
    async with aiohttp.ClientSession() as client:
        async with client.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as answer:
            return answer.status, await answer.read()


def ask(gateway, session, n_assistant: int = 0, **extra):
    """A streamed call whose history holds `n_assistant` earlier answers (the scripted server
    answers turn n_assistant of its script): (status, the text the agent got)."""
    messages = [{"role": "user", "content": "hi"}]
    for i in range(n_assistant):
        messages += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": "more"}]
    status, raw = asyncio.run(_post(gateway.tcp_base_url + "/chat/completions", session.token,
                                    chat(messages, model="m", **extra)))
    assert session.wait_idle(5)  # a capturing mode finishes its record after the agent's last byte
    text = "".join(
        (json.loads(line[6:])["choices"] or [{"delta": {}}])[0]["delta"].get("content") or ""
        for line in raw.decode(errors="replace").split("\n")
        if line.startswith("data: {")
    )
    return status, text, raw


TEXTS = [ScriptedTurn(text=f"answer {i}") for i in range(6)]


# ------------------------------------------------------------------------- assignment, stickiness


def test_sessions_go_to_the_least_loaded_replica_and_stay_there(gateway, make_replicas):
    replicas = make_replicas(3, TEXTS)
    sessions = [gateway.open_session(replicas.upstream()) for _ in range(6)]
    try:
        for session in sessions:
            assert ask(gateway, session)[0] == 200
        for n in (1, 2):
            for session in sessions:
                assert ask(gateway, session, n)[1] == f"answer {n}"
        hosts = {s.id: {t.replica for t in s.turns} for s in sessions}
        assert all(len(h) == 1 for h in hosts.values())  # sticky: every turn on one replica
        assert Counter(next(iter(h)) for h in hosts.values()) == {replicas.host(i): 2 for i in range(3)}
        assert not any(t.failed_over for s in sessions for t in s.turns)
        # What each server received is exactly its sessions' calls, each once.
        for i in range(3):
            received = Counter(r.headers["x-session-id"] for r in replicas.chat_requests(i))
            assert received == {s.id: 3 for s in sessions if hosts[s.id] == {replicas.host(i)}}
        health = {row["replica"]: row for row in sessions[0].replica_health()}
        assert all(row["sessions"] == 2 and row["calls"] == 6 and row["healthy"] for row in health.values())
        # A session that ends frees its place: the next one goes there.
        freed = sessions.pop(0)
        gateway.close_session(freed)
        newcomer = gateway.open_session(replicas.upstream())
        sessions.append(newcomer)
        ask(gateway, newcomer)
        assert newcomer.turns[0].replica == freed.turns[0].replica
    finally:
        for session in sessions:
            gateway.close_session(session)
    assert all(row["sessions"] == 0 and row["in_flight"] == 0 for row in gateway.replica_health()[0]["replicas"])


def test_a_session_starts_where_fewest_calls_are_in_flight_among_equals(gateway, make_replicas):
    slow = [ScriptedTurn(text="slow", fault=Fault(hang_s=1.0))]
    replicas = make_replicas(2, slow)
    first, second = (gateway.open_session(replicas.upstream()) for _ in range(2))
    try:
        ask(gateway, first)
        gateway.close_session(first)  # no session on either now; a call in flight on one:
        busy = threading.Thread(target=ask, args=(gateway, second))
        busy.start()
        time.sleep(0.3)
        third = gateway.open_session(replicas.upstream())
        ask(gateway, third)
        busy.join()
        assert third.turns[0].replica != second.turns[0].replica
        gateway.close_session(third)
    finally:
        gateway.close_session(second)


# ------------------------------------------------------------------------------------ failover


@pytest.mark.parametrize("mode", MODES)
def test_a_refusing_replica_is_retried_on_another_flagged_and_nothing_is_duplicated(gateway, make_replicas, mode):
    replicas = make_replicas(3, TEXTS)
    session = gateway.open_session(replicas.upstream(), mode=mode, capture=CaptureOptions(model="m"))
    try:
        assert ask(gateway, session)[1] == "answer 0"
        first = replicas.index(session.turns[0].replica)
        replicas.servers[first].stop()  # killed: refuses connections from now on
        status, text, _ = ask(gateway, session, 1)
        assert (status, text) == (200, "answer 1")  # the answer of the replica that answered
        status, text, _ = ask(gateway, session, 2)
        assert (status, text) == (200, "answer 2")
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    turns = session.turns
    second = replicas.index(turns[1].replica)
    assert second != first and turns[2].replica == turns[1].replica  # moved, and sticks there
    assert [t.failed_over for t in turns] == [False, True, False]
    assert all(t.upstream_status == 200 and t.upstream_error is None for t in turns)
    if mode == "transparent_proxy":  # the capture is the answering replica's own answer
        assert [t.capture.choices[0].content for t in turns] == ["answer 0", "answer 1", "answer 2"]
    counts = replicas.counts()
    assert counts[first] == 1 and counts[second] == 2 and sum(counts) == 3  # none twice
    health = {row["replica"]: row for row in session.replicas.health()}
    dead = health[replicas.host(first)]
    assert not dead["healthy"] and dead["failures"] == 1 and dead["last_error"] == "refused"
    assert dead["unhealthy_until"] > time.time()


@pytest.mark.parametrize("status", [502, 503, 504, 429])
def test_a_replica_answering_unavailable_is_re_sent_the_same_bytes_elsewhere(gateway, make_replicas, status):
    replicas = make_replicas(2, TEXTS)
    session = gateway.open_session(replicas.upstream(), mode="transparent_proxy", capture=CaptureOptions(model="m"))
    try:
        ask(gateway, session)
        first = replicas.index(session.turns[0].replica)
        unavailable = [TEXTS[0], ScriptedTurn(text="never", fault=Fault(http_status=status)), *TEXTS[2:]]
        replicas.servers[first].add_script(unavailable, api_key=KEY)
        assert ask(gateway, session, 1)[:2] == (200, "answer 1")
    finally:
        gateway.close_session(session)
    refused, answered = replicas.chat_requests(first)[1], replicas.chat_requests(1 - first)[0]
    assert refused.body == answered.body  # re-sent as it was: same body (same salt, same version)...
    assert {k: v for k, v in refused.headers.items() if k not in ("host",)} == {
        k: v for k, v in answered.headers.items() if k not in ("host",)
    }  # ...same headers, the session id included
    assert session.turns[1].failed_over and session.turns[1].replica == replicas.host(1 - first)
    assert session.replicas.health()[first]["last_error"] == f"http_{status}"


@pytest.mark.parametrize("status", [400, 401, 404, 500])
def test_an_answer_about_the_request_is_not_failed_over(gateway, make_replicas, status):
    """A 4xx is the request's fault (every replica would say the same); a 500 is the engine's
    error on this request: relayed as with one URL, never re-sent."""
    replicas = make_replicas(2, [ScriptedTurn(text="x", fault=Fault(http_status=status))])
    session = gateway.open_session(replicas.upstream())
    try:
        got = ask(gateway, session)[0]
    finally:
        gateway.close_session(session)
    assert got == status and sorted(replicas.counts()) == [0, 1]
    (turn,) = session.turns
    assert turn.upstream_status == status and not turn.failed_over
    assert all(row["healthy"] and row["failures"] == 0 for row in session.replicas.health())


def test_a_replica_dying_after_the_first_byte_fails_the_turn_without_a_retry(gateway, make_replicas):
    broken = [TEXTS[0], ScriptedTurn(text="a long answer cut short", chunk_chars=2,
                                     fault=Fault(disconnect_after_chunks=3))]
    replicas = make_replicas(2, broken)
    session = gateway.open_session(replicas.upstream(), mode="transparent_proxy", capture=CaptureOptions(model="m"))
    try:
        ask(gateway, session)
        with pytest.raises(aiohttp.ClientPayloadError):  # the agent sees a failed answer, not a short one
            ask(gateway, session, 1)
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    first = replicas.index(session.turns[0].replica)
    assert replicas.counts()[first] == 2 and replicas.counts()[1 - first] == 0  # never re-sent
    turn = session.turns[1]
    assert turn.replica == replicas.host(first) and not turn.failed_over
    assert "stream broken" in turn.upstream_error
    assert session.replicas.health()[first]["last_error"] == "stream_broken"


def test_all_replicas_down_fails_the_call_as_one_url_down_does(gateway, make_replicas):
    replicas = make_replicas(3, TEXTS)
    session = gateway.open_session(replicas.upstream())
    lone = make_replicas(1, TEXTS)
    single = gateway.open_session(Upstream(lone.servers[0].base_url, KEY, "m"))
    try:
        for server in replicas.servers + lone.servers:
            server.stop()
        status, _, raw = ask(gateway, session)
        lone_status, _, lone_raw = ask(gateway, single)
    finally:
        gateway.close_session(session)
        gateway.close_session(single)
    assert status == lone_status == 502
    assert json.loads(raw)["error"]["type"] == json.loads(lone_raw)["error"]["type"] == "upstream_unreachable"
    (turn,), (lone_turn,) = session.turns, single.turns
    assert turn.upstream_status is lone_turn.upstream_status is None
    assert turn.upstream_error.startswith("upstream unreachable: every replica failed")
    assert all(replicas.host(i) in turn.upstream_error for i in range(3))
    verdict, lone_verdict = (judge_agent(AgentEnd(exit_code=1, last=LastCall.of(t))) for t in (turn, lone_turn))
    assert verdict.error_kind == lone_verdict.error_kind == "endpoint_error"
    assert all(not row["healthy"] for row in gateway.replica_health()[0]["replicas"])


def test_every_replica_unavailable_relays_the_last_refusal_each_asked_once(gateway, make_replicas):
    replicas = make_replicas(3, [ScriptedTurn(text="x", fault=Fault(http_status=503))])
    session = gateway.open_session(replicas.upstream())
    try:
        assert ask(gateway, session)[0] == 503
    finally:
        gateway.close_session(session)
    assert replicas.counts() == [1, 1, 1]
    assert session.turns[0].upstream_status == 503 and session.turns[0].failed_over


def test_a_replica_in_back_off_is_skipped_then_tried_again(gateway, make_replicas, monkeypatch):
    from pi_env.proxy import replicas as replica_module

    monkeypatch.setattr(replica_module, "BACKOFF_S", 0.5)
    replicas = make_replicas(2, TEXTS)
    sessions = [gateway.open_session(replicas.upstream()) for _ in range(2)]
    try:
        for session in sessions:
            ask(gateway, session)
        a, b = sessions
        down = replicas.index(a.turns[0].replica)
        port = replicas.servers[down].port
        replicas.servers[down].stop()
        ask(gateway, a, 1)  # fails over: the replica is in back-off now
        fresh = gateway.open_session(replicas.upstream())
        sessions.append(fresh)
        ask(gateway, fresh)
        assert fresh.turns[0].replica == replicas.host(1 - down)  # skipped while in back-off
        revived = ScriptedServer(port=port).start()  # the replica comes back on its address
        replicas.servers[down] = revived
        revived.add_script(TEXTS, api_key=KEY)
        time.sleep(0.6)  # back-off over
        late = gateway.open_session(replicas.upstream())
        sessions.append(late)
        ask(gateway, late)
        assert late.turns[0].replica == replicas.host(down) and not late.turns[0].failed_over  # tried on next use
        assert session_health(late, down)["healthy"]
    finally:
        for session in sessions:
            gateway.close_session(session)


def session_health(session, index):
    return session.replicas.health()[index]


def test_the_transparent_fallback_re_sends_to_the_sessions_replica(gateway, make_replicas):
    """An engine that rejects logprobs: the fallback's re-send goes where the session is (its
    prefix cache), never to another replica."""
    replicas = make_replicas(2, TEXTS, quirks=EngineQuirks(reject_logprobs="always"))
    session = gateway.open_session(replicas.upstream(), mode="transparent_proxy",
                                   capture=CaptureOptions(model="m", logprobs=True))
    try:
        assert ask(gateway, session)[:2] == (200, "answer 0")
    finally:
        gateway.close_session(session)
    # The rejected call and both fallbacks (unstreamed, then without capture), all on one replica.
    assert sorted(replicas.counts()) == [0, 3]
    assert session.turns[0].capture.fallback.startswith("without_capture")
    assert not session.turns[0].failed_over


# ------------------------------------------------------------------------ one URL, credentials


def test_a_one_url_list_is_a_plain_endpoint(gateway, make_replicas):
    (server,) = make_replicas(1, TEXTS).servers
    url = server.base_url
    assert PiConfig(endpoint={"name": [url], "model": "m"}) == PiConfig(endpoint={"name": url, "model": "m"})
    assert PiConfig(endpoint={"name": f"{url},", "model": "m"}).endpoint == url  # a trailing comma is not a second replica
    endpoint = resolve_endpoint(PiConfig(endpoint={"name": [url], "model": "m"}))
    assert endpoint.base_urls == () and endpoint.base_url == url
    session = gateway.open_session(Upstream(url, KEY, "m", base_urls=(url,)))
    try:
        assert ask(gateway, session)[:2] == (200, "answer 0")
    finally:
        gateway.close_session(session)
    assert session.replicas is None and session.replica_health() is None and gateway.replica_health() == []
    assert session.turns[0].replica == f"127.0.0.1:{server.port}" and not session.turns[0].failed_over


def test_the_list_is_given_as_a_list_or_comma_separated_and_checked():
    urls = ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000"]
    assert PiConfig(endpoint={"name": ",".join(urls), "model": "m"}).endpoint.name == urls
    endpoint = resolve_endpoint(PiConfig(endpoint={"name": urls, "model": "m"}))
    assert endpoint.base_urls == ("http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1")
    vllm = resolve_endpoint(PiConfig(endpoint={"name": "vllm", "base_url": " , ".join(urls), "model": "m"}))
    assert vllm.base_urls == endpoint.base_urls and vllm.name == "vllm"
    with pytest.raises(ValueError, match="several replicas are given as http"):
        PiConfig(endpoint={"name": ["http://10.0.0.1:8000/v1", "vllm"], "model": "m"})
    from pi_env.endpoints import EndpointError

    with pytest.raises(EndpointError, match="twice"):
        resolve_endpoint(PiConfig(endpoint={"name": [urls[1], urls[1] + "/v1"], "model": "m"}))


def test_credentials_in_the_urls_are_never_shown(gateway, make_replicas, tmp_path):
    replicas = make_replicas(2, TEXTS)
    for server in replicas.servers:
        server.set_default(TEXTS)  # basic auth from the URL, no bearer key: the default script
    urls = tuple(s.base_url.replace("http://", "http://alice:s3cretpw@") for s in replicas.servers)
    trace = tmp_path / "trace.jsonl"
    session = gateway.open_session(Upstream(urls[0], None, "m", base_urls=urls), mode="transparent_proxy",
                                   capture=CaptureOptions(model="m"), trace_path=str(trace))
    try:
        ask(gateway, session)
        replicas.servers[replicas.index(session.turns[0].replica)].stop()
        ask(gateway, session, 1)
        for server in replicas.servers:
            server.stop()
        _, _, refused = ask(gateway, session, 2)
        shown = [repr(session), repr(session.upstream), repr(session.replicas), json.dumps(gateway.replica_health()),
                 refused.decode(), trace.read_text(), *(msgspec.json.encode(t.to_json()).decode() for t in session.turns)]
    finally:
        gateway.close_session(session)
    assert session.turns[1].failed_over and session.turns[2].upstream_error
    config = PiConfig(endpoint={"name": ",".join(urls), "model": "m"})
    shown += [json.dumps(config.redacted()), repr(config)]
    assert all("s3cretpw" not in text for text in shown)
    assert any("127.0.0.1" in text for text in shown)
    received = replicas.chat_requests(0) + replicas.chat_requests(1)
    assert received and all(r.headers["authorization"].startswith("Basic ") for r in received)  # still sent


# ------------------------------------------------------------------------------------ token-in


def test_token_in_fails_over_to_another_replica_with_the_ids_of_the_one_that_answered(gateway, tmp_path):
    pytest.importorskip("renderers", reason="token-in needs pi-env[token-in] (the dev extra installs it)")
    transformers = pytest.importorskip("transformers")
    from pi_env.proxy.token_in import load_renderer
    from pi_env.scripted.token_engine import TokenEngine
    from pi_env.testing.tiny_tokenizer import make_tokenizer_dir

    template = (Path(__file__).parent.parent / "scripts/engines/chatml_tools.jinja").read_text()
    texts = [template] + [p.read_text() for p in sorted((Path(__file__).parent.parent / "src/pi_env/proxy").glob("*.py"))]
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tok", texts, chat_template=template)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    servers = [ScriptedServer(token_engine=TokenEngine(tokenizer)).start() for _ in range(2)]
    try:
        for server in servers:
            server.add_script([ScriptedTurn(text="one"), ScriptedTurn(text="two")], api_key=KEY)
        urls = tuple(s.base_url for s in servers)
        session = gateway.open_session(Upstream(urls[0], KEY, "m", base_urls=urls), mode="transparent_proxy",
                                       capture=CaptureOptions(model="m", top_logprobs=2),
                                       token_in=load_renderer("chatml-hermes", str(tokenizer_dir)))
        try:
            _, first, _ = ask(gateway, session)
            dead = [s.port for s in servers].index(int(session.turns[0].replica.split(":")[1]))
            servers[dead].stop()
            messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                        {"role": "user", "content": "more"}]
            status, raw = asyncio.run(_post(gateway.tcp_base_url + "/chat/completions", session.token,
                                            chat(messages, model="m")))
            assert status == 200, raw
            assert session.wait_idle(5)
        finally:
            gateway.close_session(session)
        second = session.turns[1]
        assert second.failed_over and second.replica == f"127.0.0.1:{servers[1 - dead].port}"
        assert second.capture.choices[0].content == "two" and second.capture.token_ids_source == "token_in"
        assert second.capture.token_in["outcome"] == "bridged"  # the session's ids carry over to the new replica
        sent = [r for r in servers[1 - dead].requests if r.path.endswith("/completions")]
        assert len(sent) == 1 and sent[0].body["prompt"] == second.capture.prompt_token_ids
    finally:
        for server in servers:
            server.stop()



# ----------------------------------------------------------- a collect with one replica killed


@pytest.mark.needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "kill"), [("black_box", "stop"), ("transparent_proxy", "sigkill")])
def test_a_collect_across_three_replicas_loses_nothing_when_one_is_killed(tmp_path, mode, kill):
    """bench/replica_failover.py at a few rollouts (the full 64: run the bench): real Pi, one
    replica stopped at a random moment; every rollout stored once, scored or unscored with a
    named error, no call answered twice, sessions sticky except the flagged turns."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from replica_failover import run

    seed = random.randrange(1 << 30)
    figures = run(8, tmp_path / "ds", concurrency=4, seed=seed, mode=mode, kill=kill)
    assert figures["violations"] == [], (seed, figures)
    assert figures["stored"] == 8 and figures["duplicates"] == 0
    assert figures["scored"] + sum(figures["unscored"].values()) == 8
    assert figures["killed_after_s"] is not None, figures  # the kill happened during the run


def test_the_process_gateway_shows_replica_health_for_endpoints(make_replicas):
    """What the OpenEnv server's GET /endpoints shows (`replicas`): the process gateway's sets."""
    from pi_env.proxy.gateway import get_gateway, replica_health

    replicas = make_replicas(2, TEXTS)
    gateway = get_gateway()
    session = gateway.open_session(replicas.upstream())
    try:
        ask(gateway, session)
    finally:
        gateway.close_session(session)
    (shown,) = [h["replicas"] for h in replica_health() if h["replicas"][0]["replica"] == replicas.host(0)]
    assert [r["replica"] for r in shown] == [replicas.host(0), replicas.host(1)]
    assert sum(r["calls"] for r in shown) == 1 and all(r["healthy"] for r in shown)
