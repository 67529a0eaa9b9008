"""What every dialect shares: a call in another API's shape (OpenAI Responses, Anthropic Messages,
Gemini generateContent) becomes the one Chat Completions call the gateway already polices, sends,
captures and renders (token-in), and its answer goes back in the dialect's own shape.

A dialect (`Dialect`) knows its routes, turns a request into a `DialectCall` (the Chat
Completions body, whether the agent asked for a stream, what it sent that an open engine cannot
honour), and makes an `AnswerTranslator` per call: Chat Completions chunks in, the dialect's
stream events out (or a whole answer, or an error). `AnswerStream` drives a translator over
the bytes a strategy writes to the agent, so black_box, transparent_proxy, token-in and
interception_gate answer in every dialect without knowing there is one.

Hot path: an answer's chunks are decoded once per write (one msgspec call for all the SSE
events a relay read carried), into structs that skip logprobs; translators build their events
with msgspec too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import msgspec

from pi_env.errors import BadInputError
from pi_env.proxy.capture import Assembler, MessageDelta, TurnCapture, WireChoice, WireChunk, parse_chunks


class DialectError(BadInputError):
    """A request the dialect refuses, answered in the dialect's error shape with `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Route(NamedTuple):
    """What the request target says: the model (Gemini names it in the path), whether the
    answer is streamed (Gemini: the method; None: the body says), and how a stream is framed
    ("sse", or Gemini's "json_array" without `alt=sse`)."""

    model: str | None = None
    streamed: bool | None = None
    framing: str = "sse"


@dataclass
class DialectCall:
    """One dialect call, as the gateway sends it on."""

    dialect: str  # the dialect's name ("responses", "messages", "gemini")
    chat: dict[str, Any]  # the Chat Completions request (the gateway's policy applies to it as to any)
    streamed: bool  # the agent asked for a streamed answer
    model: str  # the model name the agent asked for: echoed in its answers
    framing: str = "sse"
    # Fields the agent sent that an open engine cannot honour, accepted and not forwarded
    # ("prompt_cache_key", "anthropic-beta: ...", "reasoning.encrypted_content"): on the turn's record.
    notes: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)  # what the answer's translation needs


# -- Chat Completions answers as the translators read them: the structs capture decodes them
# into (proxy/capture.py), so one decode serves both the translation and the turn's capture,
# assembled piece by piece as the answer passes (AnswerStream.assembled): a dialect costs no
# second parse of the answer.

ChatChunk = WireChunk
Choice = WireChoice
_chunk = msgspec.json.Decoder(WireChunk)
encode = msgspec.json.encode


class AnswerTranslator(ABC):
    """One call's answer, from Chat Completions to the dialect. `events` is fed every chunk of a
    streamed answer in order (the first call may come with none: an answer that began with no
    chunk), `close` ends the dialect's stream once the chat stream has ended (with or without
    `[DONE]`, with or without a finish reason: a cut-off answer must still end in the dialect's
    shape). `whole` translates an unstreamed chat.completion."""

    def __init__(self, call: DialectCall):
        self.call = call

    @abstractmethod
    def events(self, chunks: list[ChatChunk]) -> bytes: ...

    @abstractmethod
    def close(self) -> bytes: ...

    @abstractmethod
    def whole(self, answer: ChatChunk) -> bytes: ...


class Dialect(ABC):
    """One API shape the gateway speaks besides Chat Completions."""

    name: ClassVar[str]
    stream_content_type: ClassVar[str] = "text/event-stream"

    @abstractmethod
    def match(self, method: str, raw_path: str) -> Route | None:
        """The route for a request target of this dialect (the raw target, query included), or None."""

    @abstractmethod
    def to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        """The Chat Completions call for a request body (a JSON object); DialectError if refused."""

    @abstractmethod
    def translator(self, call: DialectCall) -> AnswerTranslator: ...

    def header_notes(self, headers: Mapping[str, str]) -> list[str]:
        """Notes on request headers the dialect accepts and does not forward (DialectCall.notes)."""
        return []

    @abstractmethod
    def error_body(self, status: int, message: str, kind: str) -> bytes:
        """An error in the dialect's JSON shape."""


# -- driving a translator over what a strategy writes


def chat_error_message(body: bytes) -> tuple[str, str]:
    """(message, type) of an OpenAI-shaped error body, or the body as text."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode(errors="replace")[:4096] or "(empty error body)", "api_error"
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error), str(error.get("type") or error.get("code") or "api_error")
    if isinstance(error, str):
        return error, "api_error"
    return body.decode(errors="replace")[:4096], "api_error"


def _decode(lines: bytes) -> tuple[list[WireChunk], int]:
    """The chunks of whole SSE lines, and how many payloads could not be decoded."""
    # Leading blanks are JSON whitespace; an empty or odd payload fails the batch, then itself.
    payloads = [line[5:] for line in lines.split(b"\n") if line[:5] == b"data:"]
    if payloads and payloads[-1].strip() == b"[DONE]":
        payloads.pop()
    if not payloads:
        return [], 0
    return parse_chunks(payloads)


def _text_only(chunk: ChatChunk) -> tuple[str, str] | None:
    """("content" | "reasoning_content" | "reasoning", text) for a chunk that carries text of one
    kind and nothing else; None for any other chunk."""
    choices = chunk.choices
    if chunk.usage is not None or chunk.error is not None or not choices or len(choices) != 1:
        return None
    choice = choices[0]
    delta = choice.delta
    if delta is None or choice.finish_reason is not None or delta.tool_calls is not None:
        return None
    content, reasoning_content, reasoning = delta.content, delta.reasoning_content, delta.reasoning
    if content and not reasoning_content and not reasoning:
        return "content", content
    if reasoning_content and not content and not reasoning:
        return "reasoning_content", reasoning_content
    if reasoning and not content and not reasoning_content:
        return "reasoning", reasoning
    return None


def coalesce(chunks: list[ChatChunk]) -> list[ChatChunk]:
    """The chunks with each run of text-only chunks of one kind merged into one: an engine sends
    a chunk a token, and one dialect event per token would cost the gateway its per-event work
    (and the agent its parsing) that many times; what arrived in one write leaves as one event."""
    merged: list[ChatChunk] = []
    run: list[str] = []
    kind, first = "", None
    for chunk in chunks:
        text = _text_only(chunk)
        if text is not None and text[0] == kind:
            run.append(text[1])
            continue
        if first is not None:
            merged.append(_merged(first, kind, run))
            first, kind = None, ""
        if text is None:
            merged.append(chunk)
        else:
            kind, run, first = text[0], [text[1]], chunk
    if first is not None:
        merged.append(_merged(first, kind, run))
    return merged


def _merged(first: ChatChunk, kind: str, texts: list[str]) -> ChatChunk:
    if len(texts) == 1:
        return first
    delta = MessageDelta()
    setattr(delta, kind, "".join(texts))
    return ChatChunk(id=first.id, model=first.model, choices=[Choice(index=first.choices[0].index, delta=delta)])  # type: ignore[index]


class AnswerStream:
    """The dialect's bytes for a Chat Completions answer that arrives in pieces: an SSE stream
    translated as it comes, anything else (a whole JSON answer, an error) at its end."""

    def __init__(self, dialect: Dialect, call: DialectCall, status: int, content_type: str | None):
        self.dialect, self.call, self.status = dialect, call, status
        self.sse = status < 400 and (content_type or "").startswith("text/event-stream")
        self.translator = dialect.translator(call)
        self.pending = b""  # an SSE line not yet whole (or, not SSE: the whole body so far)
        self.started = False
        # The turn's capture, assembled from the chunks as they are decoded for translation (so
        # none is decoded twice, nor held once added); None once handed over by assembled().
        self.assembler: Assembler | None = Assembler(TurnCapture(request={})) if self.sse else None
        self.assembly_error: str | None = None
        self.bad = 0  # payloads that could not be decoded

    @property
    def content_type(self) -> str:
        if self.status < 400 and self.call.streamed and self.sse:
            return self.dialect.stream_content_type if self.call.framing == "sse" else "application/json"
        return "application/json"

    def feed(self, data: bytes) -> bytes:
        if not self.sse:
            self.pending += data
            return b""
        data = self.pending + data
        end = data.rfind(b"\n")
        if end < 0:
            self.pending = data
            return b""
        self.pending = data[end + 1 :]
        return self._translate(data[: end + 1])

    def finish(self, data: bytes = b"") -> bytes:
        if not self.sse:
            return self._whole(self.pending + data)
        out = self.feed(data)
        if self.pending.strip():
            out += self._translate(self.pending + b"\n")
            self.pending = b""
        if not self.started:
            self.started = True
            out += self.translator.events([])
        return out + self.translator.close()

    def assembled(self, tail: bytes = b"") -> TurnCapture | None:
        """The capture of the whole answer (`tail`: its bytes not fed yet), from the chunks
        decoded for translation; None for an answer that is not a stream. Called once."""
        assembler, self.assembler = self.assembler, None
        if assembler is None:
            return None
        rest, bad = _decode(self.pending + tail + b"\n")
        capture = assembler.capture
        try:
            if self.assembly_error is None:
                return assembler.chunks(rest, self.bad + bad)
        except Exception as exc:  # noqa: BLE001 - as capture.assemble_answer: recorded, never raised
            self.assembly_error = f"{type(exc).__name__}: {exc}"
        capture.token_ids_missing_reason = f"the answer could not be assembled: {self.assembly_error}"
        return capture

    def _translate(self, lines: bytes) -> bytes:
        chunks, bad = _decode(lines)
        if not chunks and not bad:
            return b""
        if self.assembler is not None and self.assembly_error is None:
            self.bad += bad
            try:
                self.assembler.add(chunks)
            except Exception as exc:  # noqa: BLE001 - the capture says why; the agent still gets its answer
                self.assembly_error = f"{type(exc).__name__}: {exc}"
        self.started = True
        return self.translator.events(coalesce(chunks) if len(chunks) > 1 else chunks)

    def _whole(self, body: bytes) -> bytes:
        if self.status >= 400:
            message, kind = chat_error_message(body)
            return self.dialect.error_body(self.status, message, kind)
        try:
            answer = _chunk.decode(body)
        except msgspec.DecodeError:
            return self.dialect.error_body(502, "pi-env gateway: the upstream's answer is not JSON", "api_error")
        if not self.call.streamed:
            return self.translator.whole(answer)
        # A streamed call answered whole (a fallback of the gateway's own): its events at once.
        choices = [Choice(index=c.index, delta=c.message, finish_reason=c.finish_reason) for c in answer.choices or ()]
        events = self.translator.events([ChatChunk(id=answer.id, model=answer.model, choices=choices)])
        if answer.usage:
            events += self.translator.events(
                [ChatChunk(id=answer.id, model=answer.model, choices=[], usage=answer.usage)]
            )
        return events + self.translator.close()
