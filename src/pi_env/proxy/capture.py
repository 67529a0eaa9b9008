"""Turning an upstream answer into a per-turn capture: the assembled message of every choice,
and the engine's own token ids and logprobs, aligned 1:1, never re-tokenised or invented.

Where ids come from, in order of preference:
  - `token_ids` on each choice (vLLM >= 0.10.2 with `return_token_ids: true`), with
    `prompt_token_ids` on the first chunk (or the body);
  - ids on the logprob entries: an `id` field (llama.cpp), or tokens of the form
    "token_id:N" (vLLM `--return-tokens-as-token-ids`).
When neither is there, the capture says why in `token_ids_missing_reason`.

Parsing happens once per answer, after its bytes were relayed (see gateway): the hot path only
keeps the raw bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

TOKEN_ID_PREFIX = "token_id:"


# The wire shapes, only the fields capture reads. Decoding into them skips everything else
# (logprob `bytes` arrays, ids, timestamps) in C, about 2.5x faster than building dicts.
# gc=False: they never form cycles, and tracking thousands of them per answer would run the
# cyclic collector many times per decode.
class TopLogprob(msgspec.Struct, gc=False):
    token: str | None = None
    logprob: float | None = None


class LogprobEntry(msgspec.Struct, gc=False):
    token: str | None = None
    logprob: float | None = None
    id: int | None = None  # llama.cpp names each token's id here
    # Kept as the engine's raw JSON: decoding 5-20 alternatives per token is most of the cost of
    # capture, and only a reader of the trace needs them (see ChoiceCapture.decoded_top_logprobs).
    top_logprobs: msgspec.Raw = msgspec.Raw(b"[]")  # a JSON null arrives as Raw(b"null")


class Logprobs(msgspec.Struct, gc=False):
    content: list[LogprobEntry] | None = None


class FunctionDelta(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, gc=False):
    index: int | None = None
    id: str | None = None
    function: FunctionDelta | None = None


class MessageDelta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class WireChoice(msgspec.Struct, gc=False):
    index: int = 0
    delta: MessageDelta | None = None  # streamed
    message: MessageDelta | None = None  # not streamed
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    stop_reason: Any = None  # vLLM: the stop string (or token id) that ended the answer


class WireChunk(msgspec.Struct, gc=False):
    choices: list[WireChoice] | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    id: str | None = None
    error: Any = None  # an error an upstream sent inside its stream


_chunks = msgspec.json.Decoder(list[WireChunk])
_chunk = msgspec.json.Decoder(WireChunk)
_top_logprobs = msgspec.json.Decoder(list[list[TopLogprob] | None])
NO_TOP_LOGPROBS = msgspec.Raw(b"[]")


@dataclass
class ChoiceCapture:
    index: int
    content: str = ""
    reasoning_content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # by index, arguments joined
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # aligned with token_ids / tokens
    tokens: list[str] = field(default_factory=list)  # each token's text, as the engine gave it
    # Per token, its alternatives as the engine sent them: one JSON array of per-token arrays,
    # kept as bytes (one object, not one per token; decoded only by a reader that asks).
    top_logprobs: msgspec.Raw = field(default_factory=lambda: NO_TOP_LOGPROBS)
    ids_complete: bool = True  # every generated token came with its id
    ids_from_logprobs: bool = False  # ids read off logprob entries ("id" or "token_id:N" tokens)
    alignment_error: str | None = None

    def decoded_top_logprobs(self) -> list[list[dict[str, Any]]]:
        """Per token, its alternatives as {"token", "logprob"} (one decode call for all)."""
        return [
            [{"token": top.token, "logprob": top.logprob} for top in tops or ()]
            for tops in _top_logprobs.decode(self.top_logprobs)
        ]

    def message(self) -> dict[str, Any]:
        """The assembled assistant message (OpenAI shape)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        if self.reasoning:
            message["reasoning"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass
class TurnCapture:
    """What transparent_proxy keeps of one model call (besides the TurnRecord's timings)."""

    request: dict[str, Any]  # the forwarded request, after rewriting
    choices: list[ChoiceCapture] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    model: str | None = None
    token_ids_source: str | None = None  # "token_ids" | "logprob_tokens" | None
    token_ids_missing_reason: str | None = None
    fallback: str | None = None  # how a rejected capture parameter was worked around
    malformed_chunks: int = 0
    synthetic_answer: str | None = None  # the gateway answered itself (e.g. "budget")
    # token-in (proxy/token_in.py): the renderer, the bridge outcome ("first", "bridged",
    # "full_render" with its reason), the sequence index, what was asked of the engine.
    token_in: dict[str, Any] | None = None
    worker_error: str | None = None  # why a large answer was parsed on the gateway's loop, not in the worker

    # Convenience views of choice 0, the one an agent continues with.
    @property
    def completion_token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices and self.choices[0].ids_complete else []

    @property
    def per_token_logps(self) -> list[float | None]:
        return self.choices[0].logprobs if self.choices else []

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def completion_tokens(self) -> int | None:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return len(self.choices[0].tokens or self.choices[0].token_ids) if self.choices else None

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in vars(self).items() if k != "choices"}
        # top_logprobs stay the engine's raw JSON: msgspec.json.encode embeds them verbatim.
        data["choices"] = [vars(choice) | {"message": choice.message()} for choice in self.choices]
        data["completion_token_ids"] = self.completion_token_ids
        data["per_token_logps"] = self.per_token_logps
        data["finish_reason"] = self.finish_reason
        return data


def sse_payloads(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, without `[DONE]`. (Splitting lines beats a
    regex scan here by about 9x.)"""
    payloads = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                payloads.append(payload)
    return payloads


_DONE = b"data: [DONE]\n\n"


def plain_sse_array(raw: bytes) -> bytes | None:
    """The payloads of an SSE body as one JSON array, in two passes over the bytes (split,
    join), when the body has the plain shape engines send (`data: {...}` events, blank-line
    separated, then `data: [DONE]`); None for any other shape (comments, `event:` lines, CRLF,
    a cut stream), which the line reader handles. A payload cannot hold a raw newline (it would
    end its SSE line), so one left in the array means the body was not plain."""
    if raw == _DONE:  # no events at all
        return b"[]"
    pieces = raw.split(b"\n\ndata: ")
    if len(pieces) > 1 and pieces[-1] == b"[DONE]\n\n":
        pieces.pop()  # the last payload's blank line went with the separator
    elif pieces[-1].endswith(b"\n\n"):  # no [DONE] (a stream cut at an event's end)
        pieces[-1] = pieces[-1][:-2]
    else:
        return None
    if not pieces[0].startswith(b"data: "):
        return None
    pieces[-1] += b"]"
    pieces[0] = b"[" + pieces[0][6:]
    array = b",".join(pieces)
    if b"\n" in array or b"\r" in array:
        return None
    return array


def parse_chunks(payloads: list[bytes]) -> tuple[list[WireChunk], int]:
    """Parse every chunk in one call (much cheaper than one call per chunk); on a malformed
    or oddly typed chunk fall back to one by one and count the bad ones."""
    try:
        return _chunks.decode(json_array(payloads)), 0
    except msgspec.DecodeError:
        chunks, bad = [], 0
        for payload in payloads:
            try:
                chunks.append(_chunk.decode(payload))
            except msgspec.DecodeError:
                bad += 1
        return chunks, bad


def parse_sse(raw: bytes) -> tuple[list[WireChunk], int]:
    """The chunks of a streamed answer and how many could not be read."""
    array = plain_sse_array(raw)
    if array is not None:
        try:
            return _chunks.decode(array), 0
        except msgspec.DecodeError:
            pass  # a bad chunk, or a [DONE] mid-stream: the careful reader counts and skips
    return parse_chunks(sse_payloads(raw))


class Assembler:
    """Builds a TurnCapture from a streamed (chunks) or non-streamed (body) answer."""

    def __init__(self, capture: TurnCapture):
        self.capture = capture
        self._choices: dict[int, ChoiceCapture] = {}
        self._tool_calls: dict[int, dict[int, dict]] = {}
        self._tops: dict[int, list[msgspec.Raw]] = {}  # per choice, per token (joined at the end)

    def stream(self, raw: bytes) -> TurnCapture:
        return self.chunks(*parse_sse(raw))

    def chunks(self, chunks: list[WireChunk], bad: int) -> TurnCapture:
        """A streamed answer already decoded (and how many of its chunks could not be)."""
        self.add(chunks)
        self.capture.malformed_chunks += bad
        return self._finish()

    def add(self, chunks: list[WireChunk]) -> None:
        """More chunks of a streamed answer, in order (a whole answer at once, or each piece as
        it passes: proxy/dialects/base.py), so no decoded chunk need be held for long."""
        capture = self.capture
        # The envelope: first prompt ids, last usage, first model (as _envelope, chunk by chunk).
        if not capture.prompt_token_ids:
            capture.prompt_token_ids = next((c.prompt_token_ids for c in chunks if c.prompt_token_ids), [])
        capture.usage = next((c.usage for c in reversed(chunks) if c.usage), capture.usage)
        capture.model = capture.model or next((c.model for c in chunks if c.model), None)
        groups: dict[int, list[WireChoice]] = {}
        for chunk in chunks:
            for choice in chunk.choices or ():
                group = groups.get(choice.index)
                if group is None:
                    groups[choice.index] = [choice]
                else:
                    group.append(choice)
        for index, group in groups.items():
            self._stream_choice(index, group)

    def _stream_choice(self, index: int, group: list[WireChoice]) -> None:
        """One choice's deltas, joined in a few passes rather than chunk by chunk: this runs
        for every token of every captured answer."""
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = ChoiceCapture(index=index)
            self._tool_calls[index], self._tops[index] = {}, []
        deltas = [c.delta for c in group if c.delta is not None]
        choice.content += "".join([d.content for d in deltas if d.content])
        choice.reasoning_content += "".join([d.reasoning_content for d in deltas if d.reasoning_content])
        choice.reasoning += "".join([d.reasoning for d in deltas if d.reasoning])
        for delta in deltas:
            if delta.tool_calls:
                for position, call in enumerate(delta.tool_calls):
                    self._tool_call(index, position if call.index is None else call.index, call)
        choice.finish_reason = next((c.finish_reason for c in reversed(group) if c.finish_reason), choice.finish_reason)
        entries = [c.logprobs.content if c.logprobs is not None and c.logprobs.content else () for c in group]
        if all(len(e) == len(c.token_ids) if c.token_ids is not None else not e for c, e in zip(group, entries)):
            # Every chunk's ids and logprobs pair up 1:1 (or it has neither): flatten.
            choice.token_ids += [i for c in group if c.token_ids for i in c.token_ids]
            flat = [entry for chunk_entries in entries for entry in chunk_entries]
            choice.logprobs += [entry.logprob for entry in flat]
            choice.tokens += [entry.token or "" for entry in flat]
            self._tops[index] += [entry.top_logprobs or NO_TOP_LOGPROBS for entry in flat]
        else:  # ids on logprob entries, ids without logprobs, or a misaligned chunk
            for raw in group:
                self._tokens(choice, raw)

    def body(self, raw: bytes) -> TurnCapture:
        try:
            body = _chunk.decode(raw)
        except msgspec.DecodeError as exc:
            self.capture.malformed_chunks = 1
            self.capture.token_ids_missing_reason = f"the answer is not a chat.completion: {exc}"
            return self.capture
        self._envelope(body)
        for choice in body.choices or ():
            self._choice(choice, choice.message)
        return self._finish()

    def _envelope(self, chunk: WireChunk) -> None:
        capture = self.capture
        if chunk.prompt_token_ids and not capture.prompt_token_ids:
            capture.prompt_token_ids = chunk.prompt_token_ids
        if chunk.usage:
            capture.usage = chunk.usage
        if chunk.model and not capture.model:
            capture.model = chunk.model

    def _choice(self, raw: WireChoice, delta: MessageDelta | None) -> None:
        choice = self._choices.get(raw.index)
        if choice is None:
            choice = self._choices[raw.index] = ChoiceCapture(index=raw.index)
            self._tool_calls[raw.index], self._tops[raw.index] = {}, []
        if delta is not None:
            if delta.content:
                choice.content += delta.content
            if delta.reasoning_content:
                choice.reasoning_content += delta.reasoning_content
            if delta.reasoning:
                choice.reasoning += delta.reasoning
            for position, call in enumerate(delta.tool_calls or ()):
                self._tool_call(raw.index, position if call.index is None else call.index, call)
        if raw.finish_reason:
            choice.finish_reason = raw.finish_reason
        self._tokens(choice, raw)

    def _tool_call(self, choice_index: int, index: int, delta: ToolCallDelta) -> None:
        calls = self._tool_calls[choice_index]
        call = calls.get(index)
        if call is None:
            call = calls[index] = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        if delta.id:
            call["id"] = delta.id
        if delta.function is not None:
            if delta.function.name:
                call["function"]["name"] += delta.function.name
            if delta.function.arguments:
                call["function"]["arguments"] += delta.function.arguments

    def _tokens(self, choice: ChoiceCapture, raw: WireChoice) -> None:
        """Append one chunk's tokens, keeping ids and logprobs aligned 1:1."""
        tops = self._tops[choice.index]
        entries = (raw.logprobs.content if raw.logprobs is not None else None) or []
        ids = raw.token_ids
        if ids is None and entries:
            # int | None each; Any because mypy cannot narrow the list to list[int] through `None not in`
            parsed: list[Any] = [entry.id if entry.id is not None else _token_id(entry.token) for entry in entries]
            ids = parsed if None not in parsed else None
            if ids is not None:
                choice.ids_from_logprobs = True
        if ids is None:
            if entries:  # logprobs without ids: keep the logprobs, mark the ids incomplete
                choice.ids_complete = False
                _append_entries(choice, tops, entries)
            return
        if entries and len(entries) != len(ids):
            # One side lost tokens (vLLM's streaming tool parser once dropped ids): which one is
            # unknowable, so the chunk's logprobs become null and no ids are claimed.
            choice.alignment_error = (
                f"a chunk carried {len(ids)} token ids but {len(entries)} logprobs; "
                "its logprobs are recorded as null and the turn's ids are not claimed"
            )
            choice.ids_complete = False
            entries = []
        choice.token_ids.extend(ids)
        if entries:
            _append_entries(choice, tops, entries)
        else:  # ids without logprobs: nulls in place, never dropped
            choice.logprobs.extend([None] * len(ids))
            choice.tokens.extend([""] * len(ids))
            tops.extend([NO_TOP_LOGPROBS] * len(ids))

    def _finish(self) -> TurnCapture:
        capture = self.capture
        for index in sorted(self._choices):
            choice = self._choices[index]
            choice.tool_calls = [self._tool_calls[index][i] for i in sorted(self._tool_calls[index])]
            choice.top_logprobs = json_array(self._tops[index])
            capture.choices.append(choice)
        first = capture.choices[0] if capture.choices else None
        if capture.malformed_chunks:  # a chunk that could not be read may have carried tokens
            for choice in capture.choices:
                choice.ids_complete = False
        if first is None:
            capture.token_ids_missing_reason = "the upstream answer had no choices"
        elif capture.malformed_chunks and (first.token_ids or first.tokens):
            capture.token_ids_missing_reason = (
                f"{capture.malformed_chunks} chunk(s) of the answer could not be read; "
                "the token ids may have gaps there, so none are claimed"
            )
        elif first.alignment_error:
            capture.token_ids_missing_reason = first.alignment_error
        elif first.token_ids and first.ids_complete:
            capture.token_ids_source = "logprob_tokens" if first.ids_from_logprobs else "token_ids"
        elif first.tokens:
            capture.token_ids_missing_reason = (
                "the engine sent logprobs with text tokens but no token ids (it does not support return_token_ids)"
            )
        else:
            capture.token_ids_missing_reason = "the engine sent neither token ids nor logprobs"
        if first is not None and not capture.prompt_token_ids and not capture.token_ids_missing_reason:
            capture.token_ids_missing_reason = "the engine sent completion ids but no prompt_token_ids"
        return capture


def assemble_answer(raw: bytes, streaming: bool) -> TurnCapture:
    """A capture of one answer (without its request). Never raises: a problem is recorded. A
    plain function of bytes, so it can run in a worker process."""
    capture = TurnCapture(request={})
    try:
        if streaming:
            Assembler(capture).stream(raw)
        else:
            Assembler(capture).body(raw)
    except Exception as exc:  # noqa: BLE001 - any malformed answer: record why, keep going
        capture.token_ids_missing_reason = f"the answer could not be assembled: {type(exc).__name__}: {exc}"
    return capture


def _append_entries(choice: ChoiceCapture, tops: list[msgspec.Raw], entries: list[LogprobEntry]) -> None:
    for entry in entries:
        choice.logprobs.append(entry.logprob)
        choice.tokens.append(entry.token or "")
        tops.append(entry.top_logprobs or NO_TOP_LOGPROBS)


def json_array(items: Sequence[bytes | msgspec.Raw]) -> msgspec.Raw:
    """One JSON array of the given JSON values, as bytes."""
    return msgspec.Raw(b"[" + b",".join(items) + b"]")


def _token_id(token: Any) -> int | None:
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        try:
            return int(token[len(TOKEN_ID_PREFIX) :])
        except ValueError:
            return None
    return None


def sse_from_capture(capture: TurnCapture, *, include_usage: bool) -> bytes:
    """A stream Pi accepts, rebuilt from a non-streamed answer (the fallback for an upstream
    that cannot stream with capture): role, reasoning, content, tool calls with `index`,
    finish reason, usage, [DONE]."""
    envelope = {"id": "pi-env-fallback", "object": "chat.completion.chunk", "model": capture.model or ""}

    def chunk(index: int, delta: dict, finish: str | None = None) -> bytes:
        body = {**envelope, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    events = []
    for choice in capture.choices:
        events.append(chunk(choice.index, {"role": "assistant", "content": ""}))
        if choice.reasoning_content:
            events.append(chunk(choice.index, {"reasoning_content": choice.reasoning_content}))
        if choice.reasoning:
            events.append(chunk(choice.index, {"reasoning": choice.reasoning}))
        if choice.content:
            events.append(chunk(choice.index, {"content": choice.content}))
        for position, call in enumerate(choice.tool_calls):
            events.append(chunk(choice.index, {"tool_calls": [{"index": position, **call}]}))
        events.append(chunk(choice.index, {}, choice.finish_reason or "stop"))
    if include_usage and capture.usage:
        events.append(b"data: " + msgspec.json.encode({**envelope, "choices": [], "usage": capture.usage}) + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"
