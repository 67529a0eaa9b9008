"""A scripted OpenAI-compatible chat-completions server: the oracle endpoint's engine, and
pi-env's one sanctioned test double.

Each API key selects a script (a list of `ScriptedTurn`). Which turn answers a request is the
number of assistant messages already in its `messages`, so the server is stateless and a
retried request gets the same answer. Streams have exactly the shape the Pi CLI needs: a role
chunk, reasoning/content deltas, tool-call deltas carrying `index`, a finish_reason chunk, a
usage chunk with `choices: []` (when `stream_options.include_usage`), then `data: [DONE]`.

EVERYTHING it emits is synthetic and marked so: the `x-pi-env-synthetic: 1` header and
`"system_fingerprint": "pi-env-synthetic"` in every chunk and body. The engine-like extras
(`logprobs`, `prompt_token_ids`, `token_ids`) come from a made-up tokenizer, documented at
`synthetic_tokens` (script.py, beside the script itself); they are deterministic so tests can
assert exact values.

Engine-like modes (imitations of what real engines and providers do, still synthetic):
  - per turn: `ScriptedTurn.null_logprob_every=k` sends every k-th logprob as `null`;
  - per server (`EngineQuirks`): vLLM's `--return-tokens-as-token-ids` ("token_id:N" logprob
    tokens), an engine that ignores `logprobs` (ids without logprobs) or `return_token_ids`
    (logprobs without ids), one that rejects logprobs always (Groq) or only with tools + stream
    (llama.cpp), and answers whose id/created derive from the request, so identical requests get
    byte-identical answers.

CLI: `python -m pi_env.scripted --port P --script FILE.json` (see `load_script_file`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import secrets
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

from pi_env._aio import run_sync
from pi_env.scripted.script import (
    FINISHED_TURN,
    SYNTHETIC_CREATED,
    SYNTHETIC_FINGERPRINT,
    Fault,
    Script,
    ScriptAdapter,
    ScriptedToolCall,
    ScriptedTurn,
    coerce_script,
    synthetic_logprob,
    synthetic_token_id,
    synthetic_tokens,
)

if TYPE_CHECKING:
    from pi_env.scripted.token_engine import TokenEngine

SYNTHETIC_HEADERS = {"x-pi-env-synthetic": "1"}
MAX_RECORDED_REQUESTS = 1000
MAX_RECORDED_BYTES = 32 << 20  # request bodies kept for tests, in all (each holds the whole conversation)
MAX_RENDERED_BYTES = 32 << 20  # rendered answers cached, in all
SYNTHETIC_VLLM_VERSION = "0.11.0+pi-env-synthetic"
TOKEN_ID_PREFIX = "token_id:"  # vLLM --return-tokens-as-token-ids
GROQ_LOGPROBS_ERROR = "`logprobs` is not supported with this model"
LLAMA_CPP_LOGPROBS_ERROR = "logprobs is not supported with tools + stream"


@dataclass(frozen=True)
class EngineQuirks:
    """Server-wide imitations of real engines' and providers' behaviour (all off by default)."""

    tokens_as_token_ids: bool = False  # vLLM --return-tokens-as-token-ids: tokens are "token_id:N"
    ignore_logprobs: bool = False  # never sends logprobs (some providers drop them silently)
    ignore_return_token_ids: bool = False  # no token_ids/prompt_token_ids (OpenAI, vLLM < 0.10.2)
    # Answer `reject_status` with the engine's own message when logprobs are asked for:
    # "always" like Groq, "tools_stream" only with tools + stream like llama.cpp.
    reject_logprobs: Literal["always", "tools_stream"] | None = None
    reject_status: int = 400  # llama.cpp answers 400; older builds answered 500
    deterministic_ids: bool = False  # id and created derive from the request body
    # Headers sent with every model answer, e.g. (("X-Policy-Version", "7"),): an engine (or the
    # router before it) that reports the version of the weights that answered.
    answer_headers: tuple[tuple[str, str], ...] = ()

    def rejection(self, body: dict[str, Any]) -> web.Response | None:
        """The error this engine answers `body` with, if it refuses a logprobs parameter."""
        if self.reject_logprobs == "always" and (body.get("logprobs") is True or body.get("top_logprobs") is not None):
            message, error_type = GROQ_LOGPROBS_ERROR, "invalid_request_error"
        elif (
            self.reject_logprobs == "tools_stream"
            and body.get("logprobs") is True
            and body.get("stream") is True
            and body.get("tools")
        ):
            message = LLAMA_CPP_LOGPROBS_ERROR
            error_type = "invalid_request_error" if self.reject_status < 500 else "server_error"
        else:
            return None
        return openai_error(self.reject_status, message, error_type)


# ------------------------------------------------------------------------ synthetic tokenizer


def logprob_entry(
    token: str, position: int, top_n: int, *, as_token_id: bool = False, null: bool = False
) -> dict[str, Any]:
    """One OpenAI/vLLM `logprobs.content` entry; the sampled token is always the top-1.
    `as_token_id`: tokens are spelled "token_id:N" (vLLM --return-tokens-as-token-ids);
    `null`: the logprob is missing (null, with no alternatives)."""

    def spelled(text: str) -> str:
        return f"{TOKEN_ID_PREFIX}{synthetic_token_id(text)}" if as_token_id else text

    shown = spelled(token)
    if null:
        return {"token": shown, "logprob": None, "bytes": list(shown.encode()), "top_logprobs": []}
    logprob = synthetic_logprob(token, position)
    top = [{"token": shown, "logprob": logprob, "bytes": list(shown.encode())}]
    for k in range(1, top_n):
        alt = spelled(f"<alt{k}>")
        top.append({"token": alt, "logprob": logprob - k, "bytes": list(alt.encode())})
    return {"token": shown, "logprob": logprob, "bytes": list(shown.encode()), "top_logprobs": top}


def render_message(message: dict[str, Any]) -> str:
    """A stable text rendering of one prompt message (a stand-in for a chat template)."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    rendered = f"<|{message.get('role')}|>{content or ''}"
    if message.get("tool_calls"):
        rendered += json.dumps(message["tool_calls"], sort_keys=True)
    return rendered


def synthetic_prompt_token_ids(messages: list[dict[str, Any]], script: Script | None = None) -> list[int]:
    """Messages are tokenized one by one, so a longer conversation's ids extend a shorter one's.
    Like a real engine whose chat template renders history faithfully, the k-th assistant
    message becomes exactly the tokens this server generated for script turn k, so each
    turn's prompt ids extend the previous turn's prompt + completion ids (append-only)."""
    ids: list[int] = []
    assistant_index = 0
    for message in messages:
        if message.get("role") == "assistant" and script is not None and assistant_index < len(script):
            tokens = [t for d in answer_deltas(script[assistant_index], assistant_index) for t in d.tokens]
        else:
            tokens = synthetic_tokens(render_message(message))
        assistant_index += message.get("role") == "assistant"
        ids.extend(synthetic_token_id(tok) for tok in tokens)
    return ids


# -------------------------------------------------------------------------- answer rendering


@dataclass(frozen=True)
class TokenOptions:
    """The request's asks that add per-token fields to the answer."""

    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    tokens_as_token_ids: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any], quirks: EngineQuirks | None = None) -> TokenOptions:
        quirks = quirks or EngineQuirks()
        return cls(
            logprobs=body.get("logprobs") is True and not quirks.ignore_logprobs,
            top_logprobs=int(body.get("top_logprobs") or 0),
            return_token_ids=body.get("return_token_ids") is True and not quirks.ignore_return_token_ids,
            tokens_as_token_ids=quirks.tokens_as_token_ids,
        )

    def fields(self, tokens: list[str], first_position: int, null_every: int | None = None) -> dict[str, Any]:
        """A choice's `logprobs` / `token_ids`, aligned 1:1 with `tokens` (vLLM's shape)."""
        fields: dict[str, Any] = {}
        if self.logprobs:
            entries = [
                logprob_entry(
                    tok,
                    first_position + i,
                    self.top_logprobs,
                    as_token_id=self.tokens_as_token_ids,
                    null=null_every is not None and (first_position + i + 1) % null_every == 0,
                )
                for i, tok in enumerate(tokens)
            ]
            fields["logprobs"] = {"content": entries} if entries else None
        if self.return_token_ids:
            fields["token_ids"] = [synthetic_token_id(tok) for tok in tokens]
        return fields


@dataclass
class Delta:
    """One streamed piece: a delta dict plus the synthetic tokens of the text it carries."""

    delta: dict[str, Any]
    tokens: list[str]


def answer_deltas(turn: ScriptedTurn, turn_index: int) -> list[Delta]:
    """The assistant message as stream deltas: reasoning, then content, then tool calls."""

    def pieces(text: str) -> list[str]:
        size = turn.chunk_chars
        return [text[i : i + size] for i in range(0, len(text), size)]

    deltas = [Delta({turn.reasoning_field: p}, synthetic_tokens(p)) for p in pieces(turn.reasoning)]
    deltas += [Delta({"content": p}, synthetic_tokens(p)) for p in pieces(turn.text)]
    for index, call in enumerate(turn.tool_calls):
        header = {
            "index": index,
            "id": tool_call_id(call, turn_index, index),
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        deltas.append(Delta({"tool_calls": [header]}, []))
        for p in pieces(call.arguments_json()):
            arg_delta = {"index": index, "function": {"arguments": p}}
            deltas.append(Delta({"tool_calls": [arg_delta]}, synthetic_tokens(p)))
    return deltas


def tool_call_id(call: ScriptedToolCall, turn_index: int, index: int) -> str:
    return call.id or f"call_{turn_index}_{index}"


@dataclass(frozen=True)
class RenderedStream:
    choices: list[bytes]  # JSON of each chunk's choices[0]: role, deltas, finish_reason
    completion_tokens: int


def render_stream(turn: ScriptedTurn, turn_index: int, opts: TokenOptions) -> RenderedStream:
    """Every chunk's choice of the turn's stream: role, deltas, finish_reason."""
    parts: list[tuple[dict[str, Any], list[str], str | None]] = [({"role": "assistant", "content": ""}, [], None)]
    parts += [(d.delta, d.tokens, None) for d in answer_deltas(turn, turn_index)]
    parts.append(({}, [], turn.effective_finish_reason()))
    choices, position = [], 0
    for delta, tokens, finish in parts:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        choice.update(opts.fields(tokens, position, turn.null_logprob_every))
        choices.append(json.dumps(choice).encode())
        position += len(tokens)
    return RenderedStream(choices, position)


class RenderCache:
    """Rendered streams by (turn, turn index, token options). json.dumps of a 1,000-chunk
    answer costs milliseconds, which would dominate benchmarks of the gateway; turns are
    immutable, so a rendering stays valid. Bounded in entries and bytes: cleared when full."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = MAX_RENDERED_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._bytes = 0
        # Values keep their turn alive, so the id() in a key cannot be reused meanwhile.
        self._entries: dict[tuple, tuple[ScriptedTurn, RenderedStream]] = {}

    def get(self, turn: ScriptedTurn, turn_index: int, opts: TokenOptions) -> RenderedStream:
        key = (id(turn), turn_index, opts)
        entry = self._entries.get(key)
        if entry is None:
            rendered = render_stream(turn, turn_index, opts)
            size = sum(len(choice) for choice in rendered.choices)
            if len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes:
                self._entries.clear()
                self._bytes = 0
            if size <= self.max_bytes:
                self._entries[key] = (turn, rendered)
                self._bytes += size
            return rendered
        return entry[1]


class Answer:
    """One request's answer to one scripted turn, as SSE events or a chat.completion body."""

    def __init__(
        self,
        turn: ScriptedTurn,
        turn_index: int,
        body: dict[str, Any],
        cache: RenderCache,
        script: Script | None = None,
        quirks: EngineQuirks | None = None,
    ):
        quirks = quirks or EngineQuirks()
        self.turn = turn
        self.cache = cache
        self.turn_index = turn_index
        self.model = str(body.get("model") or "scripted")
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.token_options = TokenOptions.from_body(body, quirks)
        self.prompt_token_ids = synthetic_prompt_token_ids(body.get("messages") or [], script)
        if quirks.deterministic_ids:
            digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
            self.id, self.created = f"chatcmpl-synthetic-{digest[:16]}", SYNTHETIC_CREATED
        else:
            self.id, self.created = f"chatcmpl-synthetic-{secrets.token_hex(8)}", int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYNTHETIC_FINGERPRINT,
        }

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def sse_events(self) -> list[bytes]:
        """Every `data:` event of the stream, [DONE] included, as wire bytes."""
        rendered = self.cache.get(self.turn, self.turn_index, self.token_options)
        envelope = self._envelope("chat.completion.chunk")

        def event_prefix(env: dict[str, Any]) -> bytes:  # `data: {...envelope, "choices": [`
            return b"data: " + json.dumps(env)[:-1].encode() + b', "choices": ['

        prefix = event_prefix(envelope)
        events = [prefix + choice + b"]}\n\n" for choice in rendered.choices]
        if self.token_options.return_token_ids:  # vLLM puts them on the first chunk only
            first = event_prefix({**envelope, "prompt_token_ids": self.prompt_token_ids})
            events[0] = first + rendered.choices[0] + b"]}\n\n"
        if self.include_usage:
            usage_chunk = {**envelope, "choices": [], "usage": self._usage(rendered.completion_tokens)}
            events.append(b"data: " + json.dumps(usage_chunk).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events

    def completion(self) -> dict[str, Any]:
        """The non-streaming chat.completion body."""
        turn = self.turn
        message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
        if turn.reasoning:
            message[turn.reasoning_field] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [
                {
                    "id": tool_call_id(call, self.turn_index, index),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_json()},
                }
                for index, call in enumerate(turn.tool_calls)
            ]
        tokens = [tok for d in answer_deltas(turn, self.turn_index) for tok in d.tokens]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": turn.effective_finish_reason(),
        }
        choice.update(self.token_options.fields(tokens, 0, turn.null_logprob_every))
        body = {
            **self._envelope("chat.completion"),
            "choices": [choice],
            "usage": self._usage(len(tokens)),
        }
        if self.token_options.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body


# ---------------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: Any  # the parsed JSON body, or None

    @property
    def api_key(self) -> str | None:
        return bearer_token(self.headers.get("authorization"))


def bearer_token(authorization: str | None) -> str | None:
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


def openai_error(status: int, message: str, error_type: str, code: str | None = None):
    error = {"message": message, "type": error_type, "code": code}
    return web.json_response({"error": error}, status=status, headers=SYNTHETIC_HEADERS)


class ScriptedServer:
    """An OpenAI-compatible server on 127.0.0.1 answering from scripts (see module docstring).

    Runs on pi-env's background event loop; use as a context manager or call start()/stop().
    """

    def __init__(
        self,
        *,
        port: int = 0,
        default: list[ScriptedTurn | dict] | None = None,
        quirks: EngineQuirks | None = None,
        token_engine: TokenEngine | None = None,
        record_requests: int = MAX_RECORDED_REQUESTS,
        record_bytes: int = MAX_RECORDED_BYTES,
    ):
        """`record_requests`/`record_bytes`: how many received requests `requests` keeps, and
        their bodies' bytes in all (oldest dropped first); 0 keeps none (a long-lived server)."""
        self._port = port
        self._record_requests, self._record_bytes = record_requests, record_bytes
        self._recorded_bytes = 0
        self.quirks = quirks or EngineQuirks()  # may be replaced between requests
        # With a real tokenizer (pi_env.scripted.token_engine): real prompt ids, non-canonical
        # answer ids, and a token-in /v1/completions.
        self.token_engine = token_engine
        self._scripts: dict[str, Script | ScriptAdapter] = {}
        self._default: Script | None = coerce_script(default) if default is not None else None
        self._received: deque[tuple[ReceivedRequest, int]] = deque()
        self.version_probes = 0  # GET /version requests, counted apart: `requests` holds the model calls
        self._render_cache = RenderCache()
        self._runner: web.AppRunner | None = None

    # -- scripts

    def add_script(self, turns: list[ScriptedTurn | dict] | ScriptAdapter, *, api_key: str | None = None) -> str:
        """Serve `turns` to requests bearing `api_key` (generated when None); returns the key.
        `turns` may be a `ScriptAdapter`: a callable mapping each request body to its script."""
        key = api_key or f"sk-scripted-{secrets.token_hex(12)}"
        self._scripts[key] = turns if callable(turns) else coerce_script(turns)
        return key

    def remove_script(self, api_key: str) -> None:
        """Forget the script of `api_key` (its requests then get the default, or 401)."""
        self._scripts.pop(api_key, None)

    def set_default(self, turns: list[ScriptedTurn | dict] | None) -> None:
        """The script for any key that has none of its own (None: such keys get 401)."""
        self._default = coerce_script(turns) if turns is not None else None

    @property
    def requests(self) -> list[ReceivedRequest]:
        """The most recent received requests (see `record_requests`), oldest first."""
        return [received for received, _ in list(self._received)]

    # -- lifecycle

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._port}/v1"

    def start(self) -> ScriptedServer:
        if self._runner is None:
            run_sync(self._start(), timeout=30)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            run_sync(runner.cleanup(), timeout=30)

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        # Engine-like: answers the probe that tells vLLM >= 0.10.2 (it honours return_token_ids).
        app.router.add_get("/version", self._version)
        # handler_cancellation: a client that hangs up cancels a hanging/delayed answer.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", self._port), backlog=1024)
        await web.SockSite(runner, sock, backlog=1024).start()
        self._port = sock.getsockname()[1]
        self._runner = runner

    # -- handlers

    async def _version(self, request: web.Request) -> web.Response:
        self.version_probes += 1
        return web.json_response({"version": SYNTHETIC_VLLM_VERSION}, headers=SYNTHETIC_HEADERS)

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request, None)
        data = [{"id": "scripted", "object": "model", "owned_by": SYNTHETIC_FINGERPRINT}]
        return web.json_response({"object": "list", "data": data}, headers=SYNTHETIC_HEADERS)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self._record(request, body, len(raw))
        if not isinstance(body, dict):
            return openai_error(400, "request body is not a JSON object", "invalid_request_error")

        key = bearer_token(request.headers.get("Authorization"))
        script = self._script_for(key, body)
        if not isinstance(script, list):
            return script

        rejection = self.quirks.rejection(body)
        if rejection is not None:
            return rejection

        messages = body.get("messages") or []
        turn_index = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        turn, fault = script_turn(script, turn_index)
        if (failed := await answer_fault(fault)) is not None:
            return failed

        if self.token_engine is not None:
            from pi_env.scripted.token_engine import with_engine_tokens

            plain = {k: v for k, v in body.items() if k not in ("logprobs", "return_token_ids")}
            answer = Answer(turn, turn_index, plain, self._render_cache, script, self.quirks)
            if not body.get("stream"):
                return web.json_response(
                    with_engine_tokens(self.token_engine, body, turn, answer.completion()),
                    headers=self._answer_headers(),
                )
            return await self._stream(
                request, with_engine_tokens(self.token_engine, body, turn, answer.sse_events()), fault
            )
        answer = Answer(turn, turn_index, body, self._render_cache, script, self.quirks)
        if not body.get("stream"):
            if fault.truncate_body_at is not None:
                return await self._truncated(request, json.dumps(answer.completion()).encode(), fault.truncate_body_at)
            return web.json_response(answer.completion(), headers=self._answer_headers())
        return await self._stream(request, answer.sse_events(), fault)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        """Token-in (vLLM's /v1/completions with a token-id prompt), with a token engine only."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self._record(request, body, len(raw))
        if self.token_engine is None:
            return openai_error(
                404, "this scripted server has no token engine: /v1/completions is not served", "not_found"
            )
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("prompt"), list)
            or not all(isinstance(i, int) for i in body["prompt"])
        ):
            return openai_error(400, "prompt must be a list of token ids", "invalid_request_error")
        script = self._script_for(bearer_token(request.headers.get("Authorization")), body)
        if not isinstance(script, list):
            return script
        from pi_env.scripted.token_engine import completion_events

        engine = self.token_engine
        turn_index = engine.turn_index(body["prompt"])
        turn, fault = script_turn(script, turn_index)
        if (failed := await answer_fault(fault)) is not None:
            return failed
        events = completion_events(engine, body, turn)
        if not body.get("stream"):
            return web.json_response(events, headers=self._answer_headers())
        assert isinstance(events, list)  # a stream was asked for: SSE events, not a body
        return await self._stream(request, events, fault)

    def _script_for(self, key: str | None, body: dict[str, Any]) -> Script | web.Response:
        """The script answering `body` under `key` (an adapter's for this request), or the error."""
        script = self._scripts.get(key or "", self._default)
        if script is None:
            return openai_error(401, "Incorrect API key provided", "invalid_request_error", "invalid_api_key")
        return script if isinstance(script, list) else script(body)

    async def _stream(self, request: web.Request, events: list[bytes], fault: Fault):
        if fault.malformed_chunk:
            events.insert(len(events) // 2, b"data: {this is not json\n\n")
        if fault.disconnect_after_chunks is not None:
            events = events[: fault.disconnect_after_chunks]
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                **self._answer_headers(),
            }
        )
        await response.prepare(request)
        try:
            for i, event in enumerate(events):
                if fault.delay_s and i:
                    await asyncio.sleep(fault.delay_s)
                await response.write(event)
        except ConnectionError:  # the client hung up: nothing left to answer
            return response
        if fault.disconnect_after_chunks is not None:
            # Close without the terminating chunk, like an engine that crashed mid-answer.
            if request.transport is not None:  # None: the client hung up after the last chunk
                request.transport.close()
        return response

    def _answer_headers(self) -> dict[str, str]:
        return {**SYNTHETIC_HEADERS, **dict(self.quirks.answer_headers)}

    @staticmethod
    async def _truncated(request: web.Request, body: bytes, length: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json", **SYNTHETIC_HEADERS})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[:length])
        if request.transport is not None:  # None: the client hung up already
            request.transport.close()
        return response

    def _record(self, request: web.Request, body: Any, size: int = 0) -> None:
        if self._record_requests <= 0 or size > self._record_bytes:
            return
        received = ReceivedRequest(
            request.method, request.path_qs, {name.lower(): value for name, value in request.headers.items()}, body
        )
        self._received.append((received, size))
        self._recorded_bytes += size
        while len(self._received) > self._record_requests or self._recorded_bytes > self._record_bytes:
            self._recorded_bytes -= self._received.popleft()[1]


def script_turn(script: Script, turn_index: int) -> tuple[ScriptedTurn, Fault]:
    """The turn that answers a request with `turn_index` assistant turns before it, and its fault."""
    turn = script[turn_index] if turn_index < len(script) else FINISHED_TURN
    return turn, turn.fault or Fault()


async def answer_fault(fault: Fault) -> web.Response | None:
    """A fault that happens before any answer: the hang, then the error status (returned)."""
    if fault.hang_s:
        await asyncio.sleep(fault.hang_s)
    return fault_response(fault) if fault.http_status is not None else None


def fault_response(fault: Fault) -> web.Response:
    status = fault.http_status
    assert status is not None  # answer_fault calls it only for a fault with an HTTP status
    if fault.body is None:
        return openai_error(status, f"scripted fault: HTTP {status}", "scripted_fault")
    if isinstance(fault.body, str):
        return web.Response(status=status, text=fault.body, headers=SYNTHETIC_HEADERS)
    return web.json_response(fault.body, status=status, headers=SYNTHETIC_HEADERS)


# ------------------------------------------------------------------------------------- the CLI


def load_script_file(server: ScriptedServer, path: str) -> None:
    """A JSON file holding either a list of turns (served to any key) or
    `{"default": [turns], "scripts": {"<api key>": [turns], ...}, "quirks": {EngineQuirks fields}}`."""
    with open(path) as f:
        spec = json.load(f)
    if isinstance(spec, list):
        spec = {"default": spec}
    if "quirks" in spec:
        server.quirks = EngineQuirks(**spec["quirks"])
    if "default" in spec:
        server.set_default(spec["default"])
    for key, turns in (spec.get("scripts") or {}).items():
        server.add_script(turns, api_key=key)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pi_env.scripted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    parser.add_argument("--script", required=True, help="JSON file (see load_script_file)")
    args = parser.parse_args(argv)

    server = ScriptedServer(port=args.port)
    load_script_file(server, args.script)
    server.start()
    print(f"scripted server listening on {server.base_url}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the server like Ctrl-C does


if __name__ == "__main__":
    main()
