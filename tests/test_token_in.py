"""Token-in: the chatml-hermes renderer against the template itself (transformers), the gateway's
token-in path against the scripted server's token engine (non-canonical ids, as real models
sample them), and real Pi rollouts that stay one sequence through tool calls where the plain
capture path breaks."""

import asyncio
import hashlib
import json
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("renderers", reason="token-in needs pi-env[token-in] (the dev extra installs it)")
transformers = pytest.importorskip("transformers")

from helpers import bash, chat, scripted_config, wait_for  # noqa: E402
from pi_env import PiTask, run_rollout  # noqa: E402
from pi_env.proxy import Upstream  # noqa: E402
from pi_env.proxy.chatml_hermes import (  # noqa: E402
    TEMPLATE_SHA256, ChatMLHermesRenderer, HermesCallStream, parse_hermes_text)
from pi_env.proxy.token_in import TokenInUnavailable, check_endpoint_sync, load_renderer  # noqa: E402
from pi_env.scripted import ScriptedServer, ScriptedToolCall, ScriptedTurn  # noqa: E402
from pi_env.testing.tiny_tokenizer import make_tokenizer_dir  # noqa: E402
from pi_env.scripted.token_engine import TokenEngine  # noqa: E402
from pi_env.training import build_training_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (ROOT / "scripts/engines/chatml_tools.jinja").read_text()
BASH_TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a command",
                                              "parameters": {"type": "object", "properties": {
                                                  "command": {"type": "string", "description": "the command"},
                                                  "timeout": {"type": "number"}}, "required": ["command"]}}}
READ_TOOL = {"type": "function", "function": {"name": "read", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}
EMPTY_TOOL = {"type": "function", "function": {"name": "noop", "description": "", "parameters": {}}}


def corpus():
    texts = [TEMPLATE, json.dumps([BASH_TOOL, READ_TOOL])]
    for path in sorted((ROOT / "src/pi_env").rglob("*.py"))[:40]:
        texts.append(path.read_text())
    return texts


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"), corpus(), chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatMLHermesRenderer(tokenizer)


def template_ids(tokenizer, messages, tools=None, add_generation_prompt=False):
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


SYSTEM = {"role": "system", "content": "You are Pi, a coding agent. Be brief."}
USER = {"role": "user", "content": "Write hello.txt holding Hello, world! then show it."}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "bash",
                                                      "arguments": '{"command":"echo \'Hello, world!\' > hello.txt"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "(no output)"}
CONVERSATIONS = {
    "plain": [SYSTEM, USER],
    "default_system": [USER],
    "tool_history": [SYSTEM, USER, CALL, RESULT, {"role": "assistant", "content": "Done: héllo wörld ✓."},
                     {"role": "user", "content": "thanks"}],
    "content_and_two_calls_then_two_results": [
        SYSTEM, USER, {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "read", "arguments": {"path": "x.txt"}}},
            {"id": "b", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"}, {"role": "tool", "tool_call_id": "b", "content": "y\n"}],
    "empty_assistant": [SYSTEM, USER, {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, [BASH_TOOL, READ_TOOL, EMPTY_TOOL]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_full_render_equals_the_template_token_for_token(tokenizer, renderer, name, tools, generation_prompt):
    messages = CONVERSATIONS[name]
    expected = template_ids(tokenizer, messages, tools, generation_prompt)
    assert renderer.render_ids(messages, tools=tools, add_generation_prompt=generation_prompt) == expected


def test_the_renderer_mirrors_this_very_template():
    """An edited template must come with an edited renderer: the hash pins the pair."""
    assert hashlib.sha256(TEMPLATE.encode()).hexdigest() == TEMPLATE_SHA256


def test_render_attributes_sampled_tokens_to_the_assistant_only(tokenizer, renderer):
    messages = CONVERSATIONS["tool_history"]
    rendered = renderer.render(messages, tools=[BASH_TOOL])
    sampled = [t for t, s in zip(rendered.token_ids, rendered.sampled_mask) if s]
    owners = {rendered.message_indices[k] for k, s in enumerate(rendered.sampled_mask) if s}
    assert owners == {2, 4}  # the two assistant messages
    text = tokenizer.decode(sampled, skip_special_tokens=False)
    assert text.startswith("<tool_call>\n") and text.endswith("Done: héllo wörld ✓.<|im_end|>")


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "Plain answer, with <b>markup</b> and a trailing space "},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
    {"role": "assistant", "content": "Two calls:", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "read", "arguments": {"path": "a b.txt"}}},
        {"id": "y", "type": "function", "function": {"name": "write", "arguments": {"path": "é", "content": "1\n2"}}}]},
], ids=["content", "one_call", "content_two_calls"])
def test_parse_inverts_render(tokenizer, renderer, message):
    prompt = renderer.render_ids([SYSTEM, USER], add_generation_prompt=True)
    full = renderer.render_ids([SYSTEM, USER, message])
    assert full[:len(prompt)] == prompt
    completion = full[len(prompt):-1]  # without the template's newline after <|im_end|>
    parsed = renderer.parse_response(completion, prompt_ids=prompt)
    assert parsed.content == (message["content"] or "")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert all(c.status == "ok" for c in parsed.tool_calls)


def test_unparseable_and_cut_off_calls_are_reported_not_repaired():
    parsed = parse_hermes_text('Hi\n<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call>\n'
                               '<tool_call>\n{"arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "ba')
    assert parsed.content == "Hi"
    assert [c.status for c in parsed.tool_calls] == ["invalid_json", "missing_name", "unclosed_block"]
    assert parsed.tool_calls[2].raw == '<tool_call>\n{"name": "ba'


def nested_call(depth: int, name: str = "bash") -> str:
    """A <tool_call> block whose JSON nests `depth` levels (the call object is level 1)."""
    inner = "[" * (depth - 2) + "]" * (depth - 2)
    return '<tool_call>\n{"name": "' + name + '", "arguments": {"a": ' + inner + "}}\n</tool_call>"


def test_tool_calls_over_the_nesting_or_size_limit_stay_text():
    """Within the limits a block is a call; past them (or JSON nested 1,200 deep, where json.loads
    raised RecursionError) it is reported malformed and its text reaches the agent as content."""
    from pi_env.proxy.token_in import answer_message
    from pi_env.proxy.tool_json import MAX_TOOL_CALL_CHARS, MAX_TOOL_CALL_DEPTH

    assert [c.status for c in parse_hermes_text(nested_call(MAX_TOOL_CALL_DEPTH)).tool_calls] == ["ok"]
    for text in (nested_call(MAX_TOOL_CALL_DEPTH + 1), nested_call(1200),
                 '<tool_call>\n{"name": "bash", "arguments": {"a": "' + "x" * MAX_TOOL_CALL_CHARS + '"}}\n</tool_call>'):
        parsed = parse_hermes_text("Look:\n" + text)
        assert [c.status for c in parsed.tool_calls] == ["malformed_structure"]
        message, unparsed = answer_message(parsed)
        assert message == {"role": "assistant", "content": "Look:\n" + text} and unparsed == [text]
    # Brackets inside strings are text, not nesting.
    deep_string = '<tool_call>\n{"name": "bash", "arguments": {"command": "' + "[{" * 2000 + '"}}\n</tool_call>'
    assert [c.status for c in parse_hermes_text(deep_string).tool_calls] == ["ok"]


def test_the_stream_parser_finds_the_final_parses_calls_however_the_text_is_cut():
    """Calls are found chunk by chunk (a tag may straddle chunks) without re-reading the answer,
    and they are exactly the leading valid calls of the final parse."""
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    texts = ["Hi\n" + call + "\n" + call, call + "<tool_call><tool_call>" + call, call + "\n" + nested_call(1200) + call,
             "<tool_" + "<tool_call>" * 50, "a</tool_call>" + call, call + "\n<tool_call>\n{bad}\n</tool_call>" + call]
    for text in texts:
        final = []
        for parsed_call in parse_hermes_text(text).tool_calls:
            if parsed_call.status != "ok":
                break
            final.append(parsed_call.raw)
        for size in (1, 2, 5, 11, 12, 13, len(text)):
            stream = HermesCallStream()
            found = [c.raw for k in range(0, len(text), size) for c in stream.feed(text[k:k + size])]
            assert found == final, (text[:80], size)



def test_bridge_extends_the_sampled_ids_exactly(tokenizer, renderer):
    """From the model's own (non-canonical) ids the bridge appends only the new messages; from
    canonical ids it equals a full render of the whole conversation."""
    tools = [BASH_TOOL]
    prompt = renderer.render_ids([SYSTEM, USER], tools=tools, add_generation_prompt=True)
    engine = TokenEngine(tokenizer)
    turn = ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})])
    sampled = engine.answer_ids(turn)
    canonical = TokenEngine(tokenizer, split="canonical").answer_ids(turn)
    assert sampled != canonical and tokenizer.decode(sampled) == tokenizer.decode(canonical)
    new = [{"role": "tool", "tool_call_id": "c", "content": "a.txt\n"}]
    bridged = renderer.bridge_to_next_turn(prompt, sampled, new, tools=tools).token_ids
    assert bridged[:len(prompt) + len(sampled)] == prompt + sampled
    history = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]}, *new]
    full = renderer.render_ids(history, tools=tools, add_generation_prompt=True)
    assert renderer.bridge_to_next_turn(prompt, canonical, new, tools=tools).token_ids == full
    assert full == template_ids(tokenizer, history, tools, True)
    assert bridged[len(prompt) + len(sampled):] == full[len(prompt) + len(canonical):]
    # Cut off (no <|im_end|>): the close is added as prompt context after the sampled ids.
    cut = renderer.bridge_to_next_turn(prompt, sampled[:-3], new, tools=tools).token_ids
    assert cut[:len(prompt) + len(sampled) - 3] == prompt + sampled[:-3]
    assert cut[len(prompt) + len(sampled) - 3] == renderer.get_stop_token_ids()[0]
    assert renderer.bridge_to_next_turn(prompt, sampled, [{"role": "assistant", "content": "x"}]) is None


def test_auto_finds_chatml_hermes_by_the_tokenizers_template(tokenizer_dir, tmp_path):
    assert load_renderer("auto", str(tokenizer_dir)).resolved == "chatml-hermes"
    other = make_tokenizer_dir(tmp_path / "other", corpus()[:3], chat_template="{{ messages[0].content }}")
    with pytest.raises(TokenInUnavailable, match="no renderer for the model.*--renderer NAME.*chatml-hermes"):
        load_renderer("auto", str(other))
    with pytest.raises(TokenInUnavailable, match="could not load the tokenizer.*--tokenizer"):
        load_renderer("chatml-hermes", str(tmp_path / "missing"))
    with pytest.raises(TokenInUnavailable, match="unknown renderer 'nonesuch'"):
        load_renderer("nonesuch", str(tokenizer_dir))


# ------------------------------------------------------------------ the gateway's token-in


@pytest.fixture
def token_server(tokenizer):
    with ScriptedServer(token_engine=TokenEngine(tokenizer)) as scripted:
        yield scripted


def test_an_engine_without_token_in_is_refused_by_name(server, tokenizer_dir):
    spec = load_renderer("chatml-hermes", str(tokenizer_dir))
    upstream = Upstream(server.base_url, server.add_script([ScriptedTurn(text="x")]), "m")
    with pytest.raises(TokenInUnavailable, match=r"no token-in /v1/completions.*answered 404"):
        check_endpoint_sync(upstream, spec)


def test_a_busy_engine_is_not_taken_for_one_without_token_in(token_server, tokenizer_dir):
    """A 503 or 429 to the probe says nothing about token-in: not refused, probed again later."""
    from pi_env.scripted import Fault

    spec = load_renderer("chatml-hermes", str(tokenizer_dir))
    for status in (503, 429):
        key = token_server.add_script([ScriptedTurn(text="x", fault=Fault(http_status=status))])
        check_endpoint_sync(Upstream(token_server.base_url, key, f"busy-{status}"), spec)  # does not raise


def test_collect_stops_at_once_with_what_is_missing_instead_of_storing_failures(server, tokenizer_dir, tmp_path):
    """Token-in against an engine without it is a configuration every rollout would fail on:
    the collect says what to fix, and no record claims a rollout ran."""
    from pi_env.collect import CollectError, CollectRunner
    from pi_env.collect.store import read_records

    config = scripted_config(
        server,
        server.add_script([ScriptedTurn(text="x")]),
        mode={"name": "transparent_proxy", "token_in": True, "tokenizer": str(tokenizer_dir)},
    )
    tasks = [PiTask(task_id=f"t{i}", instruction="x", verify=["true"]) for i in range(3)]
    with pytest.raises(CollectError, match="has no token-in /v1/completions"):
        CollectRunner(tasks, tmp_path / "out", config, concurrency=2).run()
    assert list(read_records(tmp_path / "out")) == []


def sse_chunks(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]


async def _post(url, token, body):
    async with aiohttp.ClientSession() as client:
        async with client.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as answer:
            return answer.status, await answer.read()


def ask(gateway, session, messages, tools=(BASH_TOOL,), **extra):
    """Send a streamed chat/completions call through the gateway; its content, calls and finish."""
    body = {**chat(messages, model="m", **extra), "tools": list(tools)}
    status, raw = asyncio.run(_post(gateway.tcp_base_url + "/chat/completions", session.token, body))
    assert status == 200, raw
    chunks = sse_chunks(raw)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls") or []]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return {"content": content, "calls": calls, "finish": finish, "chunks": chunks}


def pi_history(answer) -> dict:
    """The assistant message as Pi sends it back: arguments re-serialised compactly."""
    calls = [{"id": c["id"], "type": "function", "function": {
        "name": c["function"]["name"], "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                               separators=(",", ":"))}} for c in answer["calls"]]
    return {"role": "assistant", "content": answer["content"] or None, **({"tool_calls": calls} if calls else {})}


def open_token_in(gateway, token_server, tokenizer_dir, turns, spec=None):
    spec = spec or load_renderer("chatml-hermes", str(tokenizer_dir))
    key = token_server.add_script(turns)
    from pi_env.proxy.rewrite import CaptureOptions

    return gateway.open_session(Upstream(token_server.base_url, key, "scripted-model"), mode="transparent_proxy",
                                capture=CaptureOptions(model="scripted-model", top_logprobs=2), token_in=spec)


def test_token_in_sends_the_session_id_and_salts_the_engine_request_per_version(gateway, token_server,
                                                                               tokenizer_dir):
    """Token-in sends its own /v1/completions request: the session header, the version stamp and
    the cache salt (docs/async-rl.md) are on it as on any transparent_proxy call."""
    from pi_env.proxy import PolicyVersion, Routing
    from pi_env.proxy.records import cache_salt
    from pi_env.proxy.rewrite import CaptureOptions

    key = token_server.add_script([ScriptedTurn(text="one"), ScriptedTurn(text="two")])
    policy = PolicyVersion(1)
    session = gateway.open_session(Upstream(token_server.base_url, key, "scripted-model"), mode="transparent_proxy",
                                   capture=CaptureOptions(model="scripted-model", top_logprobs=2),
                                   token_in=load_renderer("chatml-hermes", str(tokenizer_dir)),
                                   policy=policy, routing=Routing(cache_salt=True))
    try:
        first = ask(gateway, session, [USER])
        policy.set(2)
        ask(gateway, session, [USER, {"role": "assistant", "content": first["content"]},
                               {"role": "user", "content": "again"}])
        assert session.wait_idle(5)
    finally:
        gateway.close_session(session)
    sent = [r for r in token_server.requests if r.path.endswith("/completions")]
    assert [r.headers["x-session-id"] for r in sent] == [session.id] * 2
    assert [r.body["cache_salt"] for r in sent] == [cache_salt(1), cache_salt(2)]
    assert [t.policy_version for t in session.turns] == [1, 2]
    assert [t.capture.token_in["engine_request"]["cache_salt"] for t in session.turns] == [cache_salt(1),
                                                                                          cache_salt(2)]


def test_token_in_bridges_each_turn_and_records_what_it_sent_and_received(gateway, token_server, tokenizer_dir,
                                                                          tokenizer):
    turns = [ScriptedTurn(text="I will list the files.", tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})]),
             ScriptedTurn(text="Two files: a and b.")]
    session = open_token_in(gateway, token_server, tokenizer_dir, turns)
    try:
        first = ask(gateway, session, [SYSTEM, USER])
        assert first["content"] == "I will list the files." and first["finish"] == ["tool_calls"]
        assert [c["function"]["name"] for c in first["calls"]] == ["bash"]
        assert json.loads(first["calls"][0]["function"]["arguments"]) == {"command": "ls"}
        assert first["chunks"][-1]["usage"]["completion_tokens"] > 0
        history = [SYSTEM, USER, pi_history(first), {"role": "tool", "tool_call_id": first["calls"][0]["id"],
                                                     "content": "a\nb"}]
        second = ask(gateway, session, history)
        assert second["content"] == "Two files: a and b." and second["finish"] == ["stop"] and not second["calls"]
        assert session.wait_idle()
    finally:
        gateway.close_session(session)
    records = [t.capture for t in session.turns]
    sent = [r.body for r in token_server.requests if r.path == "/v1/completions" and r.body.get("stream")]
    assert [r.token_in["outcome"] for r in records] == ["first", "bridged"]
    assert [r.token_in["sequence"] for r in records] == [0, 0]
    assert all(r.token_in["engine_prompt_token_ids_match"] for r in records)
    for record, request in zip(records, sent):
        assert record.prompt_token_ids == request["prompt"]  # the ids recorded are the ids sent
        assert request["return_token_ids"] is True and request["logprobs"] == 2 and request["stream"] is True
        assert request["stop_token_ids"] == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        answer = token_server.token_engine.answer_ids(turns[records.index(record)])
        assert record.completion_token_ids == answer  # the engine's ids, non-canonical as sampled
        assert len(record.per_token_logps) == len(answer) and None not in record.per_token_logps
        assert record.token_ids_source == "token_in"
    assert records[1].prompt_token_ids[:len(sent[0]["prompt"]) + len(records[0].completion_token_ids)] == \
        sent[0]["prompt"] + records[0].completion_token_ids
    trace = build_training_trace([_ids(t) for t in session.turns])
    assert trace.append_only
    generated = [i for i, m in zip(trace.segments[0].token_ids, trace.segments[0].loss_mask) if m]
    assert generated == records[0].completion_token_ids + records[1].completion_token_ids


class _ids:
    def __init__(self, record):
        self.turn = record.turn
        self.prompt_token_ids = record.capture.prompt_token_ids
        self.completion_token_ids = record.capture.completion_token_ids
        self.per_token_logps = record.capture.per_token_logps
        self.token_in = record.capture.token_in


def test_a_diverged_history_is_rendered_in_full_as_a_new_sequence_with_the_reason(gateway, token_server,
                                                                                  tokenizer_dir):
    turns = [ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})]),
             ScriptedTurn(text="ok"), ScriptedTurn(text="again")]
    session = open_token_in(gateway, token_server, tokenizer_dir, turns)
    try:
        first = ask(gateway, session, [SYSTEM, USER])
        result = {"role": "tool", "tool_call_id": first["calls"][0]["id"], "content": "a"}
        edited = {**pi_history(first), "tool_calls": [{**pi_history(first)["tool_calls"][0], "function": {
            "name": "bash", "arguments": '{"command":"ls -la"}'}}]}
        ask(gateway, session, [SYSTEM, USER, edited, result])
        ask(gateway, session, [SYSTEM, {"role": "user", "content": "compacted"}, edited, result,
                                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
        assert session.wait_idle()
    finally:
        gateway.close_session(session)
    records = [t.capture.token_in for t in session.turns]
    assert [r["outcome"] for r in records] == ["first", "full_render", "full_render"]
    assert [r["sequence"] for r in records] == [0, 1, 2]
    assert "tool call 0 has other arguments" in records[1]["reason"]
    assert "differs from the previous call's at message 1" in records[2]["reason"]
    trace = build_training_trace([_ids(t) for t in session.turns])
    assert len(trace.segments) == 3 and "tool call 0 has other arguments" in trace.turns[1].note


def test_a_cut_off_tool_call_reaches_the_agent_as_text(gateway, token_server, tokenizer_dir, tokenizer):
    turns = [ScriptedTurn(text="Run:", tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls -la /"})])]
    session = open_token_in(gateway, token_server, tokenizer_dir, turns)
    try:
        answer = ask(gateway, session, [SYSTEM, USER], max_tokens=20)
        assert session.wait_idle()
    finally:
        gateway.close_session(session)
    text = TokenEngine.answer_text(turns[0])
    ids = token_server.token_engine.answer_ids(turns[0])[:20]
    assert answer["calls"] == [] and answer["finish"] == ["length"]
    assert answer["content"] == tokenizer.decode(ids) and text.startswith(answer["content"])
    assert "<tool_call>" in answer["content"]
    assert session.turns[0].capture.token_in["unparsed_tool_calls"]


# ------------------------------------------------------------------ hostile output


HOSTILE = ["tool_call_loop", "invalid_utf8", "lt_then_gt", "nested_json"]


def hostile_ids(tokenizer, kind: str, size: int = 4096) -> list[int]:
    """A pathological answer of `size` ids (4,096: the gateway's default max_tokens cap), as the
    hostile-output review of issue 25 found them; bench/token_in_hostile.py times the same."""
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    if kind == "tool_call_loop":  # a model stuck repeating an opening tag
        unit = encode("<tool_call>")
        return (unit * (size // len(unit) + 1))[:size]
    if kind == "invalid_utf8":  # byte-level BPE's token for the byte 0xFF: no text holds it
        return [tokenizer.convert_tokens_to_ids("ÿ")] * size
    if kind == "lt_then_gt":  # every `>` may close a tag
        return encode("<") + encode(">") * (size - 1)
    return encode(nested_call(1200)) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_answer_is_recorded_whole_and_reaches_the_agent_as_text(gateway, token_server, tokenizer_dir,
                                                                          tokenizer, kind):
    """Each class completes; the agent gets the answer's text (no invented call, no cut stream);
    the turn holds every id and logprob the engine sent."""
    ids = hostile_ids(tokenizer, kind)
    session = open_token_in(gateway, token_server, tokenizer_dir, [ScriptedTurn(token_ids=ids)])
    try:
        answer = ask(gateway, session, [SYSTEM, USER])
        assert session.wait_idle(30)
    finally:
        gateway.close_session(session)
    text = tokenizer.decode([i for i in ids if i != tokenizer.convert_tokens_to_ids("<|im_end|>")],
                            skip_special_tokens=False)
    assert answer["calls"] == [] and answer["finish"] == ["stop"]
    assert answer["content"] == text
    (turn,) = session.turns
    record = turn.capture
    assert turn.upstream_error is None and record.token_ids_source == "token_in"
    assert record.completion_token_ids == ids
    assert len(record.per_token_logps) == len(ids) and None not in record.per_token_logps
    assert record.choices[0].content == text and record.choices[0].tool_calls == []
    if kind == "nested_json":
        assert record.token_in["unparsed_tool_calls"] == [text]


def test_the_gateway_answers_health_while_it_reads_a_worst_case_answer(gateway, token_server, tokenizer_dir,
                                                                       tokenizer):
    """`<tool_call>` to the 4,096-token cap was re-parsed whole at every `>` (11-43 s, during
    which /health did not answer). The bound is loose enough for a loaded 2-core machine; the
    precise figure is bench/token_in_hostile.py's."""
    ids = hostile_ids(tokenizer, "tool_call_loop")
    session = open_token_in(gateway, token_server, tokenizer_dir, [ScriptedTurn(token_ids=ids)])
    body = {"model": "m", "stream": True, "messages": [SYSTEM, USER], "tools": [BASH_TOOL]}

    async def turn_with_polls():
        loop = asyncio.get_running_loop()
        latencies, during = [], []
        done = asyncio.Event()

        async def poll(client):
            while not done.is_set():
                started = loop.time()
                async with client.get(gateway.tcp_base_url.removesuffix("/v1") + "/health") as health:
                    assert health.status == 200
                latencies.append(loop.time() - started)
                await asyncio.sleep(0.01)

        async with aiohttp.ClientSession() as health_client, aiohttp.ClientSession() as client:
            poller = asyncio.ensure_future(poll(health_client))
            started = loop.time()
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {session.token}"}) as answer:
                raw = await answer.read()
            during.append(loop.time() - started)
            done.set()
            await poller
        return raw, latencies, during[0]

    try:
        raw, latencies, turn_s = asyncio.run(turn_with_polls())
        assert session.wait_idle(30)
    finally:
        gateway.close_session(session)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert len(latencies) >= 2 and max(latencies) < 2.0, (max(latencies), len(latencies), turn_s)
    assert session.turns[0].capture.completion_token_ids == ids


def test_an_agent_that_hangs_up_mid_answer_leaves_a_turn_with_the_ids_so_far(gateway, token_server, tokenizer_dir,
                                                                            tokenizer):
    """The handler is cancelled while it reads a long answer: the ids and logprobs read so far
    and their text are recorded (the parse finishing in a task of its own), and the next call
    starts a new sequence."""
    from pi_env.scripted import Fault

    ids = hostile_ids(tokenizer, "lt_then_gt", 2000)
    turns = [ScriptedTurn(token_ids=ids, fault=Fault(delay_s=0.002)), ScriptedTurn(text="ok")]
    session = open_token_in(gateway, token_server, tokenizer_dir, turns)
    body = {"model": "m", "stream": True, "messages": [SYSTEM, USER], "tools": [BASH_TOOL]}

    async def hang_up():
        async with aiohttp.ClientSession() as client:
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {session.token}"}) as answer:
                await answer.content.readany()
                await asyncio.sleep(0.5)  # some hundreds of ids in, then gone

    try:
        asyncio.run(hang_up())
        wait_for(lambda: session.turns)
        retry = ask(gateway, session, [SYSTEM, USER, {"role": "assistant", "content": "..."},
                                        {"role": "user", "content": "go on"}])
        assert retry["content"] == "ok" and session.wait_idle(30)
    finally:
        gateway.close_session(session)
    first, second = session.turns
    record = first.capture
    assert first.client_disconnected
    got = record.completion_token_ids
    assert 0 < len(got) < len(ids) and got == ids[:len(got)]
    assert len(record.per_token_logps) == len(got) and None not in record.per_token_logps
    assert record.choices[0].content == tokenizer.decode(got, skip_special_tokens=False)
    assert second.capture.token_in["outcome"] == "full_render"


class _FailingParse(ChatMLHermesRenderer):
    """A custom renderer whose parser fails on its answers (a bug, a recursion, an odd id); a
    parse_response of its own, so chatml-hermes's incremental call finder is not used for it."""
    def parse_response(self, token_ids, *, tools=None, prompt_ids=None):
        if token_ids:
            raise RecursionError("maximum recursion depth exceeded")
        return super().parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)


def test_a_renderer_that_fails_to_parse_leaves_the_agent_the_text_and_the_turn_its_ids(gateway, token_server,
                                                                                      tokenizer):
    from pi_env.proxy.rewrite import CaptureOptions
    from pi_env.proxy.token_in import TokenInSpec

    spec = TokenInSpec(name="failing", resolved="failing", tokenizer="tiny", renderer=_FailingParse(tokenizer))
    turn = ScriptedTurn(text="Let me look.", tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})])
    key = token_server.add_script([turn])
    session = gateway.open_session(Upstream(token_server.base_url, key, "scripted-model"), mode="transparent_proxy",
                                   capture=CaptureOptions(model="scripted-model", top_logprobs=2), token_in=spec)
    try:
        answer = ask(gateway, session, [SYSTEM, USER])
        assert session.wait_idle(30)
    finally:
        gateway.close_session(session)
    assert answer["content"] == TokenEngine.answer_text(turn) and answer["calls"] == []
    record = session.turns[0].capture
    assert record.completion_token_ids == token_server.token_engine.answer_ids(turn)
    assert None not in record.per_token_logps
    assert "RecursionError" in record.token_in["parse_error"]


# ------------------------------------------------------------------ real Pi rollouts


@pytest.mark.slow
@pytest.mark.needs_bwrap
def test_pi_rollouts_stay_one_sequence_with_token_in_and_break_without(token_server, tokenizer_dir, tmp_path):
    """The same script through real Pi: the plain capture path's prompts are the engine's canonical
    re-render, which no longer extends the model's non-canonical ids at the first tool call;
    token-in bridges every turn: one sequence, loss mask 1 exactly on the sampled ids."""
    turns = [bash("echo one > a.txt"), bash("cat a.txt"), ScriptedTurn(text="Done: a.txt holds one.")]
    task = PiTask(instruction="Write one into a.txt and show it.", verify=["grep -q one a.txt"])
    results = {}
    for token_in in (False, True):
        key = token_server.add_script(turns)
        config = scripted_config(
            token_server,
            key,
            mode={"name": "transparent_proxy", "return_token_ids": True, "token_in": token_in, "tokenizer": str(tokenizer_dir), "trace_dir": str(tmp_path)},
        )
        results[token_in] = run_rollout(task, config)
    plain, token_in = results[False], results[True]
    for result in (plain, token_in):
        assert result.reward == 1.0 and result.error_kind is None, result.error
        assert len(result.proxy_turns) == 3
    assert [t.turn for t in plain.training.turns] == [0, 1, 2]
    assert not plain.training.append_only and not plain.training.turns[1].extends_previous
    training = token_in.training
    assert training.append_only and [t.extends_previous for t in training.turns] == [False, True, True]
    assert [t.token_in["outcome"] for t in token_in.proxy_turns] == ["first", "bridged", "bridged"]
    segment = training.segments[0]
    sampled = [i for i, m in zip(segment.token_ids, segment.loss_mask) if m]
    assert sampled == [i for t in token_in.proxy_turns for i in t.completion_token_ids]
    assert sum(segment.loss_mask) == sum(len(t.completion_token_ids) for t in token_in.proxy_turns)
    assert token_in.proxy_turns[0].message["tool_calls"][0]["function"]["name"] == "bash"
    sent = [r.body["prompt"] for r in token_server.requests if r.path == "/v1/completions" and r.body.get("stream")]
    assert [t.prompt_token_ids for t in token_in.proxy_turns] == sent[-3:]


# ------------------------------------------------------------------ interception_gate


def test_gate_requests_carry_bridged_ids_and_delivered_ids_are_parsed(gateway, tokenizer_dir, tokenizer, renderer):
    """The trainer generates from GateRequest.prompt_token_ids and delivers ids only; the gateway's
    renderer turns them into Pi's answer and bridges the next request from them."""
    import concurrent.futures

    from pi_env.proxy.gate import CompletionInvalid

    spec = load_renderer("chatml-hermes", str(tokenizer_dir))
    session = gateway.open_session(Upstream("http://interception-gate.invalid/v1", None, "trainer"),
                                   mode="interception_gate", token_in=spec)
    engine = TokenEngine(tokenizer)
    turn = ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"})])
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    try:
        first = pool.submit(ask, gateway, session, [SYSTEM, USER])
        request = session.strategy.next_request(timeout_s=10)
        assert request.prompt_token_ids == renderer.render_ids([SYSTEM, USER], tools=[BASH_TOOL],
                                                               add_generation_prompt=True)
        assert request.token_in["outcome"] == "first"
        with pytest.raises(CompletionInvalid, match="token_ids"):
            session.strategy.deliver(request, {"text": "hello"})
        ids = engine.answer_ids(turn)
        session.strategy.deliver(request, {"token_ids": ids, "logprobs": [-0.5] * len(ids)})
        answer = first.result(timeout=10)
        assert [c["function"]["name"] for c in answer["calls"]] == ["bash"] and answer["finish"] == ["tool_calls"]
        history = [SYSTEM, USER, pi_history(answer), {"role": "tool", "tool_call_id": answer["calls"][0]["id"],
                                                      "content": "a.txt"}]
        second = pool.submit(ask, gateway, session, history)
        again = session.strategy.next_request(timeout_s=10)
        assert again.token_in["outcome"] == "bridged"
        assert again.prompt_token_ids[:len(request.prompt_token_ids) + len(ids)] == request.prompt_token_ids + ids
        final = engine.answer_ids(ScriptedTurn(text="Found a.txt."))
        session.strategy.deliver(again, {"token_ids": final})
        assert second.result(timeout=10)["content"] == "Found a.txt."
        assert session.wait_idle()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        gateway.close_session(session)
    trace = build_training_trace([_ids(t) for t in session.turns])
    assert trace.append_only and [t.capture.token_ids_source for t in session.turns] == ["trainer", "trainer"]


@pytest.mark.parametrize("kind", ["nested_json", "tool_call_loop"])
def test_gate_delivered_hostile_ids_reach_the_agent_as_text(gateway, tokenizer_dir, tokenizer, kind):
    """The renderer parses the trainer's ids inside deliver(): nested JSON (a RecursionError out
    of deliver before) or a `<tool_call>` loop is delivered, the agent gets the text, the turn
    the ids."""
    import concurrent.futures

    spec = load_renderer("chatml-hermes", str(tokenizer_dir))
    session = gateway.open_session(Upstream("http://interception-gate.invalid/v1", None, "trainer"),
                                   mode="interception_gate", token_in=spec)
    ids = hostile_ids(tokenizer, kind)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pending = pool.submit(ask, gateway, session, [SYSTEM, USER])
        session.strategy.deliver(session.strategy.next_request(timeout_s=10),
                                 {"token_ids": ids, "logprobs": [-0.5] * len(ids)})
        answer = pending.result(timeout=30)
        assert session.wait_idle()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        gateway.close_session(session)
    text = tokenizer.decode([i for i in ids if i != tokenizer.convert_tokens_to_ids("<|im_end|>")],
                            skip_special_tokens=False)
    assert answer["content"] == text and answer["calls"] == []
    record = session.turns[0].capture
    assert record.completion_token_ids == ids and record.per_token_logps == [-0.5] * len(ids)
    assert record.token_in["unparsed_tool_calls"] == [text]


def test_token_in_is_refused_where_the_gateway_does_not_render():
    from pydantic import ValidationError

    from pi_env import PiConfig

    with pytest.raises(ValidationError, match="token_in is a setting of transparent_proxy and interception_gate"):
        PiConfig(mode={"name": "black_box", "token_in": True})


def test_session_start_names_what_is_missing(server, token_server, tokenizer_dir, tmp_path):
    from pi_env import PiSessionFactory

    task = PiTask(instruction="x", verify=["true"])
    plain_engine = scripted_config(
        server,
        server.add_script([ScriptedTurn(text="x")]),
        mode={"name": "transparent_proxy", "token_in": True, "tokenizer": str(tokenizer_dir)},
    )
    with pytest.raises(TokenInUnavailable, match=rf"endpoint 127.0.0.1:{server.port} has no token-in"):
        PiSessionFactory(plain_engine).create(task)
    no_template = make_tokenizer_dir(tmp_path / "plain", corpus()[:3], chat_template="{{ messages }}")
    unknown_model = scripted_config(
        token_server,
        token_server.add_script([ScriptedTurn(text="x")]),
        mode={"name": "transparent_proxy", "token_in": True, "tokenizer": str(no_template)},
    )
    with pytest.raises(TokenInUnavailable, match="no renderer for the model"):
        PiSessionFactory(unknown_model).create(task)


class _Reparsed(ChatMLHermesRenderer):
    """chatml-hermes without its incremental call finder, as the `renderers` package's renderers
    are: the gateway re-parses the answer on a closing `>`, within a budget."""

    stream_parser = None


@pytest.mark.parametrize("finder", ["incremental", "reparsed"])
def test_each_tool_call_reaches_the_agent_as_soon_as_it_is_complete(gateway, token_server, tokenizer_dir, tokenizer,
                                                                    finder):
    from pi_env.proxy.token_in import TokenInSpec
    from pi_env.scripted import Fault

    second = {"command": "echo " + "x" * 40}
    turns = [ScriptedTurn(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "ls"}),
                                      ScriptedToolCall(name="bash", arguments=second)], fault=Fault(delay_s=0.01))]
    spec = None if finder == "incremental" else TokenInSpec(name="reparsed", resolved="reparsed", tokenizer="tiny",
                                                            renderer=_Reparsed(tokenizer))
    session = open_token_in(gateway, token_server, tokenizer_dir, turns, spec)
    body = {"model": "m", "stream": True, "messages": [SYSTEM, USER], "tools": [BASH_TOOL]}

    async def timed():
        arrivals = []
        async with aiohttp.ClientSession() as client:
            async with client.post(gateway.tcp_base_url + "/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {session.token}"}) as answer:
                async for line in answer.content:
                    if line.startswith(b"data: {"):
                        arrivals.append((asyncio.get_running_loop().time(), json.loads(line[6:])))
        return arrivals

    try:
        arrivals = asyncio.run(timed())
        assert session.wait_idle()
    finally:
        gateway.close_session(session)
    calls = [(at, c) for at, chunk in arrivals if chunk["choices"] for c in chunk["choices"][0]["delta"].get("tool_calls") or []]
    finished = next(at for at, chunk in arrivals if chunk["choices"] and chunk["choices"][0]["finish_reason"])
    assert [json.loads(c["function"]["arguments"]) for _, c in calls] == [{"command": "ls"}, second]
    assert [c["index"] for _, c in calls] == [0, 1]
    assert finished - calls[0][0] > 0.3  # the first call went out while the second was still being generated
    given = session.turns[0].capture.choices[0].tool_calls
    assert [c["id"] for c in given] == [c["id"] for _, c in calls]  # the record holds the ids the agent got


def test_openenv_training_trace_links_a_token_in_rollout_into_one_chain():
    """pi_env.harness marks each call that extends the previous one, as openenv's capture graph
    links nodes by exact prefix, so a trainer merges a token-in rollout into one row."""
    pytest.importorskip("openenv.core.harness")
    from openenv.core.harness import TrainingTurn

    from pi_env.harness import _link_sequences

    def turn(node, prompt, completion):
        return TrainingTurn(node_id=node, prompt_token_ids=prompt, completion_token_ids=completion,
                            per_token_logps=[-0.5] * len(completion),
                            loss_mask=[0] * len(prompt) + [1] * len(completion))

    turns = [turn("e:0", [1, 2], [3, 4]), turn("e:1", [1, 2, 3, 4, 5], [6]), turn("e:2", [1, 9], [7])]
    _link_sequences(turns)
    assert [t.metadata.get("parent_node_id") for t in turns] == [None, "e:0", None]
    assert [t.metadata["sequence"] for t in turns] == [0, 0, 1]


def test_an_engine_dying_mid_answer_fails_the_call_and_the_next_one_starts_a_new_sequence(
        gateway, token_server, tokenizer_dir):
    from pi_env.scripted import Fault

    turns = [ScriptedTurn(text="I will look.", fault=Fault(disconnect_after_chunks=5)), ScriptedTurn(text="ok")]
    session = open_token_in(gateway, token_server, tokenizer_dir, turns)
    body = {"model": "m", "stream": True, "messages": [SYSTEM, USER], "tools": [BASH_TOOL]}
    try:
        with pytest.raises(aiohttp.ClientPayloadError):  # a failed answer, not a cleanly short one
            asyncio.run(_post(gateway.tcp_base_url + "/chat/completions", session.token, body))
        retry = ask(gateway, session, [SYSTEM, USER, {"role": "assistant", "content": "I will look."},
                                        {"role": "user", "content": "go on"}])
        assert retry["content"] == "ok"
        assert session.wait_idle()
    finally:
        gateway.close_session(session)
    first, second = (t.capture.token_in for t in session.turns)
    assert session.turns[0].upstream_error.startswith("upstream stream broken") and session.turns[0].upstream_broke
    assert second["outcome"] == "full_render" and second["sequence"] == 1
    assert second["reason"].startswith("the previous call failed")
