"""Capture without a server: assembling answers (SSE and bodies) into a TurnCapture with ids and
logprobs aligned 1:1, request rewriting, the fallback's synthesised SSE, and the training view."""

import json
import random
from dataclasses import dataclass, field

import pytest

from pi_env.proxy.capture import Assembler, TurnCapture, parse_chunks, plain_sse_array, sse_from_capture, sse_payloads
from pi_env.proxy.rewrite import CaptureOptions, rejects_capture, rewrite_request, without_capture
from pi_env.training import build_training_trace

USER = [{"role": "user", "content": "hi"}]


def sse(*chunks, done=True) -> bytes:
    """An SSE body: each chunk a dict (JSON-encoded) or raw bytes (sent as the data payload)."""
    events = [b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks]
    return b"".join(events) + (b"data: [DONE]\n\n" if done else b"")


def chunk(delta=None, *, index=0, finish=None, ids=None, logprobs=None, **envelope):
    choice = {"index": index, "delta": delta or {}, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return {"id": "c", "object": "chat.completion.chunk", "model": "m", **envelope, "choices": [choice]}


def lp(token, logprob, *top):
    """A logprobs.content entry; `top` are (token, logprob) alternatives."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]}


def assemble(raw: bytes) -> TurnCapture:
    return Assembler(TurnCapture(request={})).stream(raw)


def assemble_body(body: dict) -> TurnCapture:
    return Assembler(TurnCapture(request={})).body(json.dumps(body).encode())


def choice_json(capture: TurnCapture, index: int = 0) -> dict:
    return capture.to_json()["choices"][index]


# ------------------------------------------------------------------------------ the message


def test_stream_assembles_reasoning_content_interleaved_tool_calls_finish_and_usage():
    usage = {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
    raw = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "Let me "}), chunk({"reasoning_content": "think."}),
        chunk({"reasoning": "Also "}), chunk({"reasoning": "this."}),
        chunk({"content": "Two "}), chunk({"content": "calls."}),
        # Parallel calls, interleaved: call 1 opens before call 0's arguments are complete.
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "bash", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command": '}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "read", "arguments": '{"path"'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}},
                              {"index": 1, "function": {"arguments": ': "a.py"}'}}]}),
        chunk(finish="tool_calls"),
        {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": usage},
    )
    capture = assemble(raw)
    (choice,) = capture.choices
    assert choice.message() == {
        "role": "assistant", "content": "Two calls.", "reasoning_content": "Let me think.", "reasoning": "Also this.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
        ],
    }
    assert capture.finish_reason == choice.finish_reason == "tool_calls"
    assert capture.usage == usage and capture.completion_tokens == 9 and capture.model == "m"
    assert capture.malformed_chunks == 0


def test_tool_calls_are_ordered_by_index_not_arrival():
    raw = sse(chunk({"tool_calls": [{"index": 1, "id": "second", "function": {"name": "b", "arguments": "{}"}}]}),
              chunk({"tool_calls": [{"index": 0, "id": "first", "function": {"name": "a", "arguments": "{}"}}]}),
              chunk(finish="tool_calls"))
    calls = assemble(raw).choices[0].tool_calls
    assert [(c["id"], c["function"]["name"]) for c in calls] == [("first", "a"), ("second", "b")]


def test_several_choices_are_each_assembled_with_their_own_ids():
    raw = sse(
        chunk({"role": "assistant", "content": ""}, index=0, prompt_token_ids=[1, 2]),
        chunk({"role": "assistant", "content": ""}, index=1),
        chunk({"content": "zero"}, index=0, ids=[10], logprobs=[lp("zero", -0.5)]),
        chunk({"content": "one"}, index=1, ids=[11], logprobs=[lp("one", -1.5)]),
        chunk({"content": "!"}, index=1, ids=[12], logprobs=[lp("!", -2.5)]),
        chunk(index=1, finish="length"),
        chunk(index=0, finish="stop"),
    )
    capture = assemble(raw)
    assert [c.index for c in capture.choices] == [0, 1]
    zero, one = capture.choices
    assert (zero.content, zero.token_ids, zero.logprobs, zero.finish_reason) == ("zero", [10], [-0.5], "stop")
    assert (one.content, one.token_ids, one.logprobs, one.finish_reason) == ("one!", [11, 12], [-1.5, -2.5], "length")
    # The views follow choice 0, the one the agent continues with.
    assert capture.completion_token_ids == [10] and capture.per_token_logps == [-0.5]
    assert capture.finish_reason == "stop" and capture.prompt_token_ids == [1, 2]


def test_the_last_usage_wins():
    # vLLM's continuous_usage_stats puts a running usage on every chunk; the last one is the total.
    raw = sse(chunk({"content": "a"}, usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}),
              chunk({"content": "b"}, finish="stop", usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    assert assemble(raw).usage["total_tokens"] == 5


def test_no_choices_is_recorded_as_the_reason():
    capture = assemble(sse({"id": "c", "choices": [], "usage": {"total_tokens": 3}}))
    assert capture.choices == [] and capture.completion_token_ids == [] and capture.finish_reason is None
    assert "no choices" in capture.token_ids_missing_reason


def test_sse_framing_variants_are_read():
    body = (b": keep-alive comment\r\n\r\n"
            b"event: message\r\ndata:" + json.dumps(chunk({"content": "a"})).encode() + b"\r\n\r\n"
            b"data: " + json.dumps(chunk({"content": "b"}, finish="stop")).encode() + b"\r\n\r\n"
            b"data: [DONE]\r\n\r\n")
    capture = assemble(body)
    assert capture.choices[0].content == "ab" and capture.finish_reason == "stop"
    assert capture.malformed_chunks == 0



@pytest.mark.parametrize("done", [True, False])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_a_plain_stream_becomes_one_json_array_of_its_payloads(count, done):
    chunks = [chunk({"content": f"x{i}\n\ndata: y"}) for i in range(count)]  # escaped newlines are fine
    assert json.loads(plain_sse_array(sse(*chunks, done=done))) == chunks
    assert plain_sse_array(sse()) == b"[]"


@pytest.mark.parametrize("body", [
    b"",
    b": keep-alive\n\n" + sse(chunk({"content": "a"})),
    sse(chunk({"content": "a"})).replace(b"\n", b"\r\n"),
    sse(chunk({"content": "a"})).replace(b"data: ", b"data:"),
    b"event: message\n" + sse(chunk({"content": "a"})),
    sse(chunk({"content": "a"}), done=False) + b'data: {"choices": [{"ind',  # cut mid-event
    sse(chunk({"content": "a"}), done=False)[:-1],
], ids=["empty", "comment", "crlf", "no-space", "event-line", "cut", "half-separator"])
def test_any_other_stream_shape_is_left_to_the_line_reader(body):
    assert plain_sse_array(body) is None
    assemble(body)  # and the line reader takes it without raising


def chunk_by_chunk(raw: bytes) -> TurnCapture:
    """The reference assembly: every chunk through the per-chunk rules (as bodies are)."""
    assembler = Assembler(TurnCapture(request={}))
    chunks, assembler.capture.malformed_chunks = parse_chunks(sse_payloads(raw))
    for wire in chunks:
        assembler._envelope(wire)
        for choice in wire.choices or ():
            assembler._choice(choice, choice.delta)
    return assembler._finish()


def random_chunk(rng: random.Random, position: int) -> dict:
    index = rng.choice([0, 0, 0, 1])
    choice = {"index": index, "finish_reason": rng.choice([None, None, "stop", "length"])}
    if rng.random() < 0.9:
        delta = {}
        for name in ("content", "reasoning_content", "reasoning"):
            if rng.random() < 0.4:
                delta[name] = rng.choice(["", "a", "bc", "\u00e9 d"])
        if rng.random() < 0.15:
            delta["tool_calls"] = [{"index": rng.choice([0, 1, None]), "id": rng.choice([None, "call_1"]),
                                    "function": {"name": rng.choice(["", "bash"]), "arguments": "{\"x\""}}]
        choice["delta"] = delta
    count = rng.choice([0, 1, 1, 2])
    if rng.random() < 0.8:
        choice["token_ids"] = [position * 10 + k for k in range(count)]
    if rng.random() < 0.8:
        entries = count + (rng.choice([-1, 1]) if rng.random() < 0.1 and count else 0)
        spelled = rng.random() < 0.1  # "token_id:N" tokens (vLLM --return-tokens-as-token-ids)
        tokens = [f"token_id:{position * 10 + k}" if spelled else f"t{k}" for k in range(entries)]
        choice["logprobs"] = {"content": [lp(t, -0.5 * k, (t, -0.5 * k)) | ({"id": position * 10 + k}
                                          if rng.random() < 0.1 else {}) for k, t in enumerate(tokens)]}
    envelope = {"id": "c", "model": rng.choice(["m", None]), "choices": [choice]}
    if position == 0 or rng.random() < 0.05:
        envelope["prompt_token_ids"] = [1, 2, position]
    if rng.random() < 0.1:
        envelope["usage"] = {"total_tokens": position}
    return envelope


@pytest.mark.parametrize("seed", range(300))
def test_the_flat_assembly_equals_the_chunk_by_chunk_rules(seed):
    """Streams are assembled in a few passes per choice (the hot path); whatever a stream holds
    (several choices, tool calls, ids on logprob entries, misaligned counts, bad chunks), the
    capture is the one the per-chunk rules give."""
    rng = random.Random(seed)
    chunks = [random_chunk(rng, position) for position in range(rng.randint(0, 12))]
    if rng.random() < 0.1:
        chunks.insert(rng.randint(0, len(chunks)), b"{not json")
    raw = sse(*chunks, done=rng.random() < 0.8)
    assert assemble(raw).to_json() == chunk_by_chunk(raw).to_json()

# ------------------------------------------------------------------- ids and logprobs, 1:1


def test_token_ids_and_logprobs_are_aligned_one_to_one():
    raw = sse(
        chunk({"role": "assistant", "content": ""}, prompt_token_ids=[5, 6, 7], ids=[], logprobs=[]),
        chunk({"reasoning_content": "hm"}, ids=[40], logprobs=[lp("hm", -0.25, ("hm", -0.25), ("ah", -2.0))]),
        chunk({"content": "Hello"}, ids=[41, 42], logprobs=[lp("Hel", -0.5, ("Hel", -0.5)), lp("lo", -1.0, ("lo", -1.0))]),
        chunk(finish="stop", ids=[43], logprobs=[lp("<eos>", -0.125, ("<eos>", -0.125))]),
    )
    capture = assemble(raw)
    choice = capture.choices[0]
    assert capture.prompt_token_ids == [5, 6, 7]
    assert choice.token_ids == capture.completion_token_ids == [40, 41, 42, 43]
    assert choice.logprobs == capture.per_token_logps == [-0.25, -0.5, -1.0, -0.125]
    assert choice.tokens == ["hm", "Hel", "lo", "<eos>"]
    assert choice.decoded_top_logprobs() == [
        [{"token": "hm", "logprob": -0.25}, {"token": "ah", "logprob": -2.0}],
        [{"token": "Hel", "logprob": -0.5}], [{"token": "lo", "logprob": -1.0}], [{"token": "<eos>", "logprob": -0.125}],
    ]
    assert capture.token_ids_source == "token_ids" and capture.token_ids_missing_reason is None
    assert choice.ids_complete and choice.alignment_error is None


def test_null_logprobs_stay_in_place():
    raw = sse(chunk({"content": "abc"}, ids=[1, 2, 3], logprobs=[lp("a", -1.0), lp("b", None), lp("c", -3.0)],
                    prompt_token_ids=[9]),
              chunk({"content": "d"}, ids=[4], logprobs=[lp("d", None)]),
              chunk(finish="stop"))
    capture = assemble(raw)
    assert capture.completion_token_ids == [1, 2, 3, 4]
    assert capture.per_token_logps == [-1.0, None, -3.0, None]
    assert capture.choices[0].tokens == ["a", "b", "c", "d"]


def test_token_id_prefixed_logprob_tokens_are_the_ids():
    # vLLM --return-tokens-as-token-ids, no return_token_ids: the logprob tokens carry the ids.
    raw = sse(chunk({"content": "xy"}, logprobs=[lp("token_id:101", -0.5, ("token_id:101", -0.5), ("token_id:7", -3.0)),
                                                 lp("token_id:0", -1.5)]),
              chunk({"content": "z"}, logprobs=[lp("token_id:65535", None)]),
              chunk(finish="stop"))
    capture = assemble(raw)
    assert capture.completion_token_ids == [101, 0, 65535]
    assert capture.per_token_logps == [-0.5, -1.5, None]
    assert capture.token_ids_source == "logprob_tokens"
    # No prompt ids came with them: said, not invented.
    assert capture.prompt_token_ids == [] and "prompt_token_ids" in capture.token_ids_missing_reason

    with_prompt = assemble(sse(chunk({"content": "x"}, logprobs=[lp("token_id:3", -0.5)], prompt_token_ids=[1, 2]),
                               chunk(finish="stop")))
    assert with_prompt.completion_token_ids == [3] and with_prompt.token_ids_missing_reason is None


def test_token_ids_without_logprobs_get_null_logprobs():
    raw = sse(chunk({"content": "ab"}, ids=[1, 2], prompt_token_ids=[8]), chunk({"content": "c"}, ids=[3]),
              chunk(finish="stop", ids=[]))
    capture = assemble(raw)
    assert capture.completion_token_ids == [1, 2, 3]
    assert capture.per_token_logps == [None, None, None]
    assert capture.token_ids_source == "token_ids" and capture.token_ids_missing_reason is None
    assert len(capture.choices[0].tokens) == len(capture.choices[0].decoded_top_logprobs()) == 3


def test_logprobs_without_ids_keep_the_logprobs_and_invent_no_ids():
    raw = sse(chunk({"content": "Hello"}, logprobs=[lp("Hel", -0.5), lp("lo", None)]),
              chunk({"content": "!"}, logprobs=[lp("!", -2.0)]), chunk(finish="stop"))
    capture = assemble(raw)
    choice = capture.choices[0]
    assert choice.token_ids == [] and capture.completion_token_ids == [] and not choice.ids_complete
    assert choice.logprobs == [-0.5, None, -2.0] and choice.tokens == ["Hel", "lo", "!"]
    assert capture.token_ids_source is None and "no token ids" in capture.token_ids_missing_reason


def test_partly_prefixed_tokens_claim_no_ids():
    # Some chunks spell ids, one does not: the ids are not complete, so none are claimed.
    raw = sse(chunk({"content": "a"}, logprobs=[lp("token_id:1", -0.5)]),
              chunk({"content": "b"}, logprobs=[lp("b", -0.5)]),
              chunk({"content": "cd"}, logprobs=[lp("token_id:3", -0.5), lp("d", -0.5)]),
              chunk({"content": "e"}, logprobs=[lp("token_id:5", -0.5)]), chunk(finish="stop"))
    capture = assemble(raw)
    assert capture.completion_token_ids == [] and capture.token_ids_missing_reason
    assert capture.per_token_logps == [-0.5] * 5
    assert capture.choices[0].tokens == ["token_id:1", "b", "token_id:3", "d", "token_id:5"]


def test_no_ids_and_no_logprobs_is_said():
    capture = assemble(sse(chunk({"content": "plain"}), chunk(finish="stop")))
    assert capture.completion_token_ids == [] and capture.per_token_logps == []
    assert "neither token ids nor logprobs" in capture.token_ids_missing_reason


def test_ids_and_logprobs_disagreeing_in_count_never_misalign():
    raw = sse(chunk({"content": "ab"}, ids=[1, 2], logprobs=[lp("a", -1.0), lp("b", -2.0)], prompt_token_ids=[9]),
              chunk({"content": "cde"}, ids=[3, 4], logprobs=[lp("c", -3.0), lp("d", -4.0), lp("e", -5.0)]),
              chunk({"content": "f"}, ids=[5], logprobs=[lp("f", -6.0)]), chunk(finish="stop"))
    capture = assemble(raw)
    choice = capture.choices[0]
    assert "2 token ids but 3 logprobs" in choice.alignment_error
    assert choice.token_ids == [1, 2, 3, 4, 5]
    # The disagreeing chunk's logprobs are unknown (null), the others stay at their own tokens.
    assert choice.logprobs == [-1.0, -2.0, None, None, -6.0]
    assert len(choice.tokens) == len(choice.decoded_top_logprobs()) == len(choice.token_ids)
    assert choice.tokens[4] == "f"
    # Which side lost tokens is unknowable: a trainer gets no ids rather than wrong ones.
    assert capture.completion_token_ids == [] and "not claimed" in capture.token_ids_missing_reason


def test_malformed_chunks_are_counted_and_the_rest_assembled():
    raw = sse(chunk({"content": "a"}), b"{this is not json", b"[1, 2]", b"42",
              chunk({"content": "b"}, finish="stop"))
    capture = assemble(raw)
    assert capture.malformed_chunks == 3
    assert capture.choices[0].content == "ab" and capture.finish_reason == "stop"


def test_a_malformed_chunk_means_the_ids_may_have_gaps():
    # The bad chunk may have carried tokens: claiming the ids around it would misalign them.
    raw = sse(chunk({"content": "a"}, ids=[1], logprobs=[lp("a", -1.0)], prompt_token_ids=[9]),
              b'{"choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [2], "logpr',
              chunk({"content": "c"}, ids=[3], logprobs=[lp("c", -3.0)]), chunk(finish="stop"))
    capture = assemble(raw)
    assert capture.malformed_chunks == 1 and capture.choices[0].content == "ac"
    assert capture.completion_token_ids == [] and "could not be read" in capture.token_ids_missing_reason


def test_a_truncated_stream_keeps_what_arrived():
    raw = sse(chunk({"content": "par"}, ids=[1], logprobs=[lp("par", -1.0)], prompt_token_ids=[9]),
              chunk({"content": "tial"}, ids=[2], logprobs=[lp("tial", -2.0)]), done=False)
    capture = assemble(raw + b'data: {"choices": [{"ind')  # cut mid-event
    assert capture.choices[0].content == "partial" and capture.finish_reason is None
    assert capture.choices[0].token_ids == [1, 2] and capture.malformed_chunks == 1


# ----------------------------------------------------------------------- non-streamed bodies


def test_body_assembles_every_choice_with_ids_logprobs_and_usage():
    body = {
        "id": "c", "object": "chat.completion", "model": "m", "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        "choices": [
            {"index": 0, "finish_reason": "tool_calls", "token_ids": [10, 11, 12],
             "logprobs": {"content": [lp("a", -0.5), lp("b", None), lp("c", -1.5)]},
             "message": {"role": "assistant", "content": None, "reasoning_content": "why",
                         "tool_calls": [{"id": "t0", "type": "function", "function": {"name": "bash", "arguments": "{}"}},
                                        {"id": "t1", "type": "function", "function": {"name": "read", "arguments": "{\"p\": 1}"}}]}},
            {"index": 1, "finish_reason": "stop", "token_ids": [20], "logprobs": {"content": [lp("x", -2.0)]},
             "message": {"role": "assistant", "content": "x", "reasoning": "r"}},
        ],
    }
    capture = assemble_body(body)
    zero, one = capture.choices
    assert zero.message() == {"role": "assistant", "content": None, "reasoning_content": "why",
                              "tool_calls": body["choices"][0]["message"]["tool_calls"]}
    assert one.message() == {"role": "assistant", "content": "x", "reasoning": "r"}
    assert capture.prompt_token_ids == [1, 2, 3] and capture.usage == body["usage"]
    assert capture.completion_token_ids == [10, 11, 12] and capture.per_token_logps == [-0.5, None, -1.5]
    assert (one.token_ids, one.logprobs) == ([20], [-2.0])
    assert capture.finish_reason == "tool_calls" and capture.token_ids_source == "token_ids"


def test_body_that_is_not_a_completion_is_said_not_raised():
    capture = Assembler(TurnCapture(request={})).body(b"<html>bad gateway</html>")
    assert capture.choices == [] and capture.token_ids_missing_reason


# --------------------------------------------------------------- the fallback's synthesised SSE


@pytest.mark.parametrize("include_usage", [True, False])
def test_sse_from_capture_parses_back_to_the_same_messages(include_usage):
    body = {
        "model": "m", "prompt_token_ids": [1], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        "choices": [
            {"index": 0, "finish_reason": "tool_calls", "token_ids": [5, 6],
             "message": {"role": "assistant", "content": "Calling.", "reasoning_content": "rc", "reasoning": "r",
                         "tool_calls": [{"id": "t0", "type": "function", "function": {"name": "bash", "arguments": "{\"a\": 1}"}},
                                        {"id": "t1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}},
            {"index": 1, "finish_reason": "length", "message": {"role": "assistant", "content": "other"}},
        ],
    }
    original = assemble_body(body)
    raw = sse_from_capture(original, include_usage=include_usage)
    assert raw.endswith(b"data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]
    for event in events:
        for choice in event["choices"]:
            assert all("index" in call for call in choice["delta"].get("tool_calls", []))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    back = assemble(raw)
    assert [c.message() for c in back.choices] == [c.message() for c in original.choices]
    assert [c.finish_reason for c in back.choices] == ["tool_calls", "length"]
    assert back.usage == (body["usage"] if include_usage else None)


# ------------------------------------------------------------------------- request rewriting


def test_rewrite_adds_logprobs_and_top_logprobs_overriding_the_agent():
    body = {"model": "m", "messages": USER, "logprobs": False, "top_logprobs": 2}
    out = rewrite_request(body, CaptureOptions(top_logprobs=7))
    assert out["logprobs"] is True and out["top_logprobs"] == 7
    assert body == {"model": "m", "messages": USER, "logprobs": False, "top_logprobs": 2}  # not mutated
    assert "return_token_ids" not in out  # off unless the endpoint is known to take it


def test_rewrite_top_logprobs_zero_removes_them():
    out = rewrite_request({"messages": USER, "top_logprobs": 3}, CaptureOptions(top_logprobs=0))
    assert out["logprobs"] is True and "top_logprobs" not in out


def test_rewrite_without_logprobs_leaves_the_agents_own():
    options = CaptureOptions(logprobs=False)
    assert "logprobs" not in rewrite_request({"messages": USER}, options)
    out = rewrite_request({"messages": USER, "logprobs": True, "top_logprobs": 2}, options)
    assert out["logprobs"] is True and out["top_logprobs"] == 2


def test_rewrite_return_token_ids_when_enabled():
    assert rewrite_request({"messages": USER}, CaptureOptions(return_token_ids=True))["return_token_ids"] is True


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_rewrite_keeps_the_token_limit_the_policy_left(key):
    # The one cap is the session's, put on every call by pi_env.proxy.policy before any rewrite
    # (tests/test_gateway.py); the capture rewrite adds no second one.
    out = rewrite_request({"model": "llama", "messages": USER, key: 5000}, CaptureOptions())
    assert out[key] == 5000 and len({"max_tokens", "max_completion_tokens"} & set(out)) == 1
    assert "max_tokens" not in rewrite_request({"model": "llama", "messages": USER}, CaptureOptions())



@pytest.mark.parametrize("model", ["gpt-5", "gpt-5-mini", "o1", "o1-preview", "o3-mini", "o4-mini"])
def test_rewrite_moves_max_tokens_for_models_that_refuse_it(model):
    options = CaptureOptions()  # the limit is the policy's, put on the call before (tests/test_gateway.py)
    out = rewrite_request({"model": model, "messages": USER, "max_tokens": 50}, options)
    assert "max_tokens" not in out and out["max_completion_tokens"] == 50
    out = rewrite_request({"model": model, "messages": USER}, options)
    assert "max_tokens" not in out and "max_completion_tokens" not in out
    # Both given: the explicit max_completion_tokens wins, max_tokens goes.
    out = rewrite_request({"model": model, "messages": USER, "max_tokens": 7, "max_completion_tokens": 9}, options)
    assert "max_tokens" not in out and out["max_completion_tokens"] == 9


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4.1-mini", "Qwen/Qwen3-8B", "llama-o1"])
def test_rewrite_keeps_max_tokens_for_other_models(model):
    out = rewrite_request({"model": model, "messages": USER, "max_tokens": 50}, CaptureOptions())
    assert out["max_tokens"] == 50 and "max_completion_tokens" not in out


def test_rewrite_decides_the_move_by_the_upstream_model_id():
    out = rewrite_request({"model": "agent-alias", "messages": USER, "max_tokens": 50},
                          CaptureOptions(model="o3"))
    assert out["model"] == "o3" and out["max_completion_tokens"] == 50 and "max_tokens" not in out


def test_rewrite_sets_the_exact_upstream_model():
    assert rewrite_request({"model": "whatever-pi-says", "messages": USER},
                           CaptureOptions(model="Qwen/Qwen3-8B"))["model"] == "Qwen/Qwen3-8B"
    assert rewrite_request({"model": "kept", "messages": USER}, CaptureOptions(model=None))["model"] == "kept"


def test_rewrite_disables_thinking_merged_into_existing_template_kwargs():
    kwargs = {"enable_thinking": True, "custom": 1}
    body = {"messages": USER, "chat_template_kwargs": kwargs}
    out = rewrite_request(body, CaptureOptions(disable_thinking=True))
    assert out["chat_template_kwargs"] == {"enable_thinking": False, "custom": 1}
    assert kwargs == {"enable_thinking": True, "custom": 1}  # the agent's dict is not mutated
    assert rewrite_request({"messages": USER}, CaptureOptions(disable_thinking=True))["chat_template_kwargs"] == {
        "enable_thinking": False}
    assert rewrite_request(body, CaptureOptions(disable_thinking=False))["chat_template_kwargs"] == kwargs


def test_rewrite_forces_sampling_over_the_agents_values():
    body = {"messages": USER, "temperature": 0.1, "top_p": 0.5, "seed": 1, "stop": ["x"]}
    out = rewrite_request(body, CaptureOptions(sampling={"temperature": 1.0, "top_p": 1.0, "seed": 42, "top_k": -1}))
    assert (out["temperature"], out["top_p"], out["seed"], out["top_k"]) == (1.0, 1.0, 42, -1)
    assert out["stop"] == ["x"]  # not a forced key: the agent's own
    assert rewrite_request(body, CaptureOptions())["temperature"] == 0.1  # nothing forced: untouched


@pytest.mark.parametrize("kwargs, match", [
    ({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs"),
    ({"sampling": {"temperature": 1.0, "logit_bias": {}}}, "logit_bias"),
])
def test_invalid_capture_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CaptureOptions(**kwargs)


def test_without_capture_drops_only_the_capture_parameters():
    body = rewrite_request({"model": "m", "messages": USER, "temperature": 0.3, "max_tokens": 10},
                           CaptureOptions(return_token_ids=True))
    assert without_capture(body) == {"model": "m", "messages": USER, "temperature": 0.3, "max_tokens": 10}


@pytest.mark.parametrize("status, body, rejects", [
    (400, '{"error": {"message": "logprobs is not supported with tools + stream"}}', True),  # llama.cpp
    (500, '{"error": {"code": 500, "message": "logprobs is not supported with tools + stream"}}', True),  # older llama.cpp
    (400, '{"error": {"message": "`logprobs` is not supported with this model"}}', True),  # Groq
    (422, '{"detail": "return_token_ids: extra inputs are not permitted"}', True),
    (400, '{"error": {"message": "Unrecognized request argument supplied: top_logprobs"}}', True),
    (400, '{"error": {"message": "maximum context length is 4096 tokens"}}', False),
    (401, '{"error": {"message": "invalid key (logprobs)"}}', False),
    (500, '{"error": {"message": "CUDA error while computing logprobs"}}', False),  # a crash, not a refusal
    (503, '{"error": {"message": "logprobs are not supported while overloaded"}}', False),
])
def test_rejects_capture(status, body, rejects):
    assert rejects_capture(status, body) is rejects


# ------------------------------------------------------------------------- the training view


@dataclass
class Turn:
    turn: int
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    per_token_logps: list[float | None] = field(default_factory=list)


def test_append_only_turns_merge_into_one_sequence_with_a_loss_mask():
    turns = [
        Turn(0, [1, 2, 3], [10, 11], [-0.1, -0.2]),
        Turn(1, [1, 2, 3, 10, 11, 4, 5], [12], [None]),  # 4, 5: a tool result
        Turn(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], [-0.3, -0.4]),
    ]
    trace = build_training_trace(turns)
    assert trace.append_only and len(trace.segments) == 1
    (segment,) = trace.segments
    assert segment.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert segment.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert segment.logprobs == [None, None, None, -0.1, -0.2, None, None, None, None, -0.3, -0.4]
    assert segment.turns == [0, 1, 2] and segment.prompt_length == 3
    assert [(t.turn, t.segment, t.extends_previous) for t in trace.turns] == [(0, 0, False), (1, 0, True), (2, 0, True)]


def test_a_turn_that_does_not_extend_starts_a_new_sequence():
    turns = [Turn(0, [1, 2], [10], [-1.0]),
             Turn(1, [1, 2, 99, 5], [11], [-2.0]),  # history re-rendered: 10 became 99
             Turn(2, [1, 2, 99, 5, 11, 6], [12], [-3.0])]
    trace = build_training_trace(turns)
    assert not trace.append_only and len(trace.segments) == 2
    first, second = trace.segments
    assert (first.token_ids, first.loss_mask, first.turns) == ([1, 2, 10], [0, 0, 1], [0])
    assert (second.token_ids, second.loss_mask, second.turns) == ([1, 2, 99, 5, 11, 6, 12], [0, 0, 0, 0, 1, 0, 1], [1, 2])
    assert second.prompt_length == 4 and second.logprobs == [None] * 4 + [-2.0, None, -3.0]
    assert [(t.segment, t.extends_previous) for t in trace.turns] == [(0, False), (1, False), (1, True)]
    assert "new sequence" in trace.turns[1].note


@dataclass
class ExtraTurn(Turn):
    extra_call: str | None = None


def test_an_agents_extra_call_is_left_out_and_the_task_stays_one_sequence():
    """OpenCode's title call, answered between two of the task's calls: in no segment, marked,
    and the task's calls still one append-only sequence."""
    turns = [ExtraTurn(0, [1, 2], [10], [-1.0]),
             ExtraTurn(1, [7, 8], [9], [-0.5], extra_call="title"),
             ExtraTurn(2, [1, 2, 10, 3], [11], [-2.0])]
    trace = build_training_trace(turns)
    assert trace.append_only and len(trace.segments) == 1
    assert trace.segments[0].turns == [0, 2] and trace.segments[0].token_ids == [1, 2, 10, 3, 11]
    assert [(t.segment, t.extends_previous, t.extra_call) for t in trace.turns] == [
        (0, False, None), (None, False, "title"), (0, True, None)]


@pytest.mark.parametrize("broken", [Turn(1, [], [], []), Turn(1, [1, 10, 2], [], [])], ids=["no ids", "no completion ids"])
def test_a_turn_without_ids_breaks_the_chain(broken):
    turns = [Turn(0, [1], [10], [-1.0]), broken, Turn(2, [1, 10, 2, 11, 3], [12], [-2.0])]
    trace = build_training_trace(turns)
    assert [t.segment for t in trace.turns] == [0, None, 1]
    assert trace.turns[1].note and not trace.turns[2].extends_previous
    # Turn 2 cannot be spliced onto turn 0: turn 1's completion (11) never came with ids.
    assert trace.segments[1].token_ids == [1, 10, 2, 11, 3, 12] and trace.segments[1].loss_mask == [0] * 5 + [1]
    assert all(1 not in s.turns for s in trace.segments)


def test_logprob_count_mismatch_never_misaligns():
    trace = build_training_trace([Turn(0, [1], [10, 11, 12], [-1.0, -2.0]),
                                  Turn(1, [1, 10, 11, 12, 2], [13], [-3.0])])
    (segment,) = trace.segments
    assert len(segment.token_ids) == len(segment.loss_mask) == len(segment.logprobs) == 6
    assert segment.logprobs == [None, None, None, None, None, -3.0]  # turn 0's logprobs are unknown
    assert segment.loss_mask == [0, 1, 1, 1, 0, 1]


def test_capture_views_feed_the_training_view():
    raw = sse(chunk({"content": "ab"}, ids=[10, 11], logprobs=[lp("a", -1.0), lp("b", None)], prompt_token_ids=[1, 2]),
              chunk(finish="stop"))
    capture = assemble(raw)
    turn = Turn(0, capture.prompt_token_ids, capture.completion_token_ids, capture.per_token_logps)
    (segment,) = build_training_trace([turn]).segments
    assert segment.token_ids == [1, 2, 10, 11] and segment.logprobs == [None, None, -1.0, None]


def test_llama_cpp_ids_on_logprob_entries_are_used():
    """llama.cpp names each token's id in its logprob entry (`id`), with no token_ids field."""
    body = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi!"},
                         "logprobs": {"content": [{**lp("Hi", -0.5), "id": 17}, {**lp("!", -0.25), "id": 0}]}}]}
    capture = assemble_body(body)
    assert capture.completion_token_ids == [17, 0] and capture.per_token_logps == [-0.5, -0.25]
    assert capture.token_ids_source == "logprob_tokens"
    one_missing = {"choices": [{**body["choices"][0], "logprobs": {"content": [{**lp("Hi", -0.5), "id": 17},
                                                                              lp("!", -0.25)]}}]}
    assert assemble_body(one_missing).completion_token_ids == []  # never half a sequence
