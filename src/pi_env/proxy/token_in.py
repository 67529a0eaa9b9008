"""Token-in: the gateway owns rendering, so a multi-turn rollout is one exact token sequence.

Per session (`TokenLedger`): the first call's messages + tools are rendered to ids with the
model's renderer (PyPI `renderers`); every later call is checked to be exactly the previous
request's messages + the assistant message the gateway gave the agent + new messages (tool
results, a user turn), and then bridged from the previous prompt + completion ids
(`bridge_to_next_turn`), so the sampled ids are never re-tokenised. When the agent's history
diverged (compaction, a retry, an edit), the tools changed, or the renderer cannot prove the
bridge, the call is rendered in full and starts a new sequence, with the reason recorded on the
turn. Nothing is ever spliced.

In transparent_proxy (`TokenIn`), the ids go to the engine's token-in endpoint (vLLM:
`/v1/completions` with a token-id prompt, `return_token_ids`, logprobs, streamed), and the
completion ids come back to the agent as an OpenAI chat answer parsed by the same renderer:
plain text as it arrives, each tool call as soon as it is complete, usage and the finish reason
at the end; a
call that is cut off or does not parse reaches the agent as text, never invented. The record
holds the prompt ids sent, the completion ids and logprobs received, and the bridge outcome.
interception_gate uses the same ledger and parser (pi_env.proxy.gate).

`renderers` (and transformers, for tokenizers) are the optional extra `pi-env[token-in]`,
imported only when a session asks for token-in.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from pi_env.errors import BadInputError
from pi_env.proxy.capture import NO_TOP_LOGPROBS, ChoiceCapture, TurnCapture, json_array
from pi_env.proxy.records import TokenInSpec, TurnRecord, Upstream
from pi_env.proxy.rewrite import SAMPLING_KEYS, rewrite_request
from pi_env.proxy.wire import (
    Call,
    Strategy,
    StrategySession,
    agent_request,
    describe,
    json_error,
    not_a_json_object,
)

CHATML_HERMES = "chatml-hermes"
EXTRA_HINT = "token-in needs the optional extra: pip install 'pi-env[token-in]'"


class TokenInUnavailable(BadInputError, ValueError):
    """Token-in cannot work for this session (no renderer, no tokenizer, no token-in endpoint);
    the message names what is missing and what to pass instead."""


# --------------------------------------------------------------------------- the renderer


_renderers: dict[tuple[str, str], TokenInSpec] = {}
_renderers_lock = threading.Lock()


def load_renderer(name: str, tokenizer: str) -> TokenInSpec:
    """The renderer called `name` ("auto", "chatml-hermes", a `renderers` name such as "qwen3",
    or a custom class as "module.Class" / "file.py:Class") over the tokenizer at `tokenizer` (a
    local directory or a model id). Loaded once per process. Raises TokenInUnavailable."""
    key = (name, tokenizer)
    with _renderers_lock:
        spec = _renderers.get(key)
        if spec is None:
            spec = _renderers[key] = _load_renderer(name, tokenizer)
        return spec


def _load_renderer(name: str, tokenizer_id: str) -> TokenInSpec:
    try:
        import renderers
        from renderers.base import MODEL_RENDERER_MAP, RENDERER_REGISTRY, _populate_registry, load_tokenizer
    except ImportError as error:
        raise TokenInUnavailable(f"{EXTRA_HINT} ({error})") from None
    try:
        tokenizer = load_tokenizer(tokenizer_id)
    except Exception as error:  # noqa: BLE001 - any loader failure: say what to pass instead
        raise TokenInUnavailable(
            f"token-in could not load the tokenizer {tokenizer_id!r} ({type(error).__name__}: "
            f"{str(error)[:300]}); pass --tokenizer (PiConfig.mode.tokenizer) a local "
            "directory with the model's tokenizer files"
        ) from None
    resolved: str | None = name
    if name == "auto":
        resolved = MODEL_RENDERER_MAP.get(getattr(tokenizer, "name_or_path", "")) or _template_renderer(tokenizer)
        if resolved is None:
            _populate_registry()
            known = ", ".join(sorted({*RENDERER_REGISTRY} - {"default"} | {CHATML_HERMES}))
            raise TokenInUnavailable(
                f"token-in: no renderer for the model of tokenizer {tokenizer_id!r} (renderers "
                f"{renderers.__version__} knows it by no name, and its chat template is not one pi-env ships a "
                f"renderer for); pass --renderer NAME (PiConfig.mode.renderer), one of: {known}, or a custom "
                "renderer class as module.Class / file.py:Class"
            )
    assert resolved is not None  # the given name, or the auto branch raised on None
    try:
        renderer = renderers.create_renderer(tokenizer, _renderer_config(resolved))
    except TokenInUnavailable:
        raise
    except Exception as error:  # noqa: BLE001 - a bad name, a tokenizer without the template's tokens
        raise TokenInUnavailable(
            f"token-in: renderer {resolved!r} cannot be built for tokenizer {tokenizer_id!r}: "
            f"{type(error).__name__}: {str(error)[:300]}"
        ) from None
    return TokenInSpec(name=name, resolved=resolved, tokenizer=tokenizer_id, renderer=renderer)


def _renderer_config(name: str):
    from renderers import CustomRendererConfig
    from renderers.configs import config_from_name

    if name == CHATML_HERMES:
        return CustomRendererConfig(import_path="pi_env.proxy.chatml_hermes.ChatMLHermesRenderer")
    try:
        return config_from_name(name)
    except ValueError as error:
        if ":" in name or "." in name:  # module.Class or file.py:Class
            return CustomRendererConfig(import_path=name)
        raise TokenInUnavailable(
            f"token-in: unknown renderer {name!r} ({error}); {CHATML_HERMES} is pi-env's own, "
            "a custom renderer class is module.Class or file.py:Class"
        ) from None


def _template_renderer(tokenizer) -> str | None:
    """A renderer pi-env ships for the tokenizer's own chat template, recognised by its hash."""
    import hashlib

    from pi_env.proxy.chatml_hermes import TEMPLATE_SHA256

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and hashlib.sha256(template.encode()).hexdigest() == TEMPLATE_SHA256:
        return CHATML_HERMES
    return None


# --------------------------------------------------------------------------- the ledger


@dataclass
class PromptPlan:
    """The ids of one call's prompt and how they were made."""

    token_ids: list[int]
    outcome: str  # "first" (full render), "bridged", "full_render" (a new sequence)
    sequence: int  # 0-based: how many times the session started a new sequence before
    reason: str | None = None  # why a later call was not bridged
    bridged_tokens: int = 0  # ids the bridge added after the previous prompt + completion
    messages: list[dict[str, Any]] = field(default_factory=list, repr=False)
    tools: list[dict[str, Any]] | None = field(default=None, repr=False)

    def record(self, spec: TokenInSpec) -> dict[str, Any]:
        return {
            "renderer": spec.resolved,
            "outcome": self.outcome,
            "sequence": self.sequence,
            "reason": self.reason,
            "prompt_tokens": len(self.token_ids),
            "bridged_tokens": self.bridged_tokens,
        }


RECENT_TURNS = 4  # turns a call may be bridged from (the latest it extends)


@dataclass
class _Previous:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    completion_ids: list[int]
    answer: dict[str, Any]  # the assistant message the agent was given
    sequence: int = 0  # the sequence its prompt belongs to


class TokenLedger:
    """One session's token state: what the next call's prompt is, and what the last turn was."""

    def __init__(self, spec: TokenInSpec):
        self.spec = spec
        self.renderer = spec.renderer
        self.sequence = -1
        # The latest turns, newest last: a call is bridged from the latest one whose conversation
        # it extends, so a side call between two of the task's (OpenCode's title) breaks nothing.
        self._recent: list[_Previous] = []
        self._lock = threading.Lock()
        self._broken: str | None = None  # why the next call cannot be bridged (a failed turn)

    def plan(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> PromptPlan:
        """The prompt ids for a call carrying `messages` and `tools`."""
        with self._lock:
            recent, broken = list(self._recent), self._broken
        previous, reason = None, broken
        if broken is None and recent:
            previous = next((turn for turn in reversed(recent) if _divergence(turn, messages, tools) is None), None)
            reason = None if previous is not None else _divergence(recent[-1], messages, tools)
        if previous is not None and reason is None:
            bridged = self.renderer.bridge_to_next_turn(
                previous.prompt_ids, previous.completion_ids, messages[len(previous.messages) + 1 :], tools=tools
            )
            if bridged is not None:
                ids = list(bridged.token_ids)
                base = len(previous.prompt_ids) + len(previous.completion_ids)
                return PromptPlan(
                    ids, "bridged", previous.sequence, bridged_tokens=len(ids) - base, messages=messages, tools=tools
                )
            reason = f"the renderer could not bridge from the previous turn ({self.spec.resolved} returned None)"
        ids = self.renderer.render_ids(messages, tools=tools, add_generation_prompt=True)
        with self._lock:
            self.sequence += 1
            sequence = self.sequence
        return PromptPlan(
            ids,
            "first" if not recent and broken is None else "full_render",
            sequence,
            reason=reason,
            messages=messages,
            tools=tools,
        )

    async def aplan(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> PromptPlan:
        """`plan` from the event loop: a bridge (milliseconds: only the new messages are
        tokenised) runs inline, where a thread hand-off would cost more than it saves; a full
        render (the first call, a divergence) runs in a worker thread, off the loop."""
        with self._lock:
            bridging = bool(self._recent) and self._broken is None
        if bridging:
            return self.plan(messages, tools)
        return await asyncio.get_running_loop().run_in_executor(None, self.plan, messages, tools)

    def remember(self, plan: PromptPlan, completion_ids: list[int], answer: dict[str, Any]) -> None:
        """The turn ended with this answer given to the agent: the next call may bridge from it."""
        with self._lock:
            turn = _Previous(plan.messages, plan.tools, plan.token_ids, list(completion_ids), answer, plan.sequence)
            self._recent = [*self._recent, turn][-RECENT_TURNS:]
            self._broken = None

    def forget(self, why: str) -> None:
        """The turn failed (no complete answer): the next call is rendered in full."""
        with self._lock:
            self._recent = []
            self._broken = f"the previous call failed ({why})"

    def parse(self, completion_ids: list[int], prompt_ids: list[int], tools) -> ParsedAnswer:
        """The assistant message for the agent from completion ids, the raw text of every tool
        call that did not parse (already appended to the content), and why the renderer failed
        when it did: then the message is the decoded text, so whatever the ids are the agent
        gets text and the turn keeps its ids. Never raises. Linear in the ids for chatml-hermes;
        a long answer costs milliseconds, so the gateway calls it off its loop (see TokenIn)."""
        try:
            parsed = self.renderer.parse_response(list(completion_ids), tools=tools, prompt_ids=prompt_ids)
            message, unparsed = answer_message(parsed)
            return ParsedAnswer(message, unparsed, None)
        except Exception as error:  # noqa: BLE001 - a renderer's failure on odd ids must not lose the turn
            why = f"{type(error).__name__}: {str(error)[:300]}"
        return ParsedAnswer({"role": "assistant", "content": self.decode(completion_ids) or None}, [], why)

    def decode(self, completion_ids: list[int]) -> str:
        """The completion's text without its stop ids ("" when it cannot be decoded)."""
        tokenizer = getattr(self.renderer, "_tokenizer", None)
        ids = list(completion_ids)
        try:
            stops = set(self.renderer.get_stop_token_ids())
            while ids and ids[-1] in stops:
                ids.pop()
            return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""
        except Exception:  # noqa: BLE001 - nothing left to try: the ids are recorded all the same
            return ""


class ParsedAnswer(NamedTuple):
    message: dict[str, Any]  # the assistant message for the agent
    unparsed: list[str]  # raw text of the tool calls that did not parse (in the content)
    error: str | None  # the renderer failed: the message is the decoded text


def _divergence(previous: _Previous, messages: list, tools) -> str | None:
    """Why `messages` is not the previous request + the answer given + new messages (None: it is)."""
    if tools != previous.tools:
        return "the request's tools differ from the previous call's"
    count = len(previous.messages)
    if len(messages) < count + 2:
        return (
            f"the agent sent {len(messages)} messages, not the previous call's {count} + its answer + new ones "
            "(a retry or a compaction)"
        )
    for index in range(count):
        if messages[index] != previous.messages[index]:
            return f"the agent's history differs from the previous call's at message {index} (a compaction or an edit)"
    differs = _answer_differs(messages[count], previous.answer)
    if differs:
        return f"message {count} is not the answer the agent was given: {differs}"
    return None


def _answer_differs(sent: Any, given: dict[str, Any]) -> str | None:
    if not isinstance(sent, dict) or sent.get("role") != "assistant":
        return "it is not an assistant message"
    if _text(sent.get("content")) != _text(given.get("content")):
        return "its content differs"
    sent_calls, given_calls = sent.get("tool_calls") or [], given.get("tool_calls") or []
    if len(sent_calls) != len(given_calls):
        return f"it has {len(sent_calls)} tool calls, the answer had {len(given_calls)}"
    for position, (mine, theirs) in enumerate(zip(given_calls, sent_calls)):
        function = theirs.get("function") if isinstance(theirs, dict) else None
        if not isinstance(function, dict) or function.get("name") != mine["function"]["name"]:
            return f"tool call {position} has another name"
        if _arguments(function.get("arguments")) != json.loads(mine["function"]["arguments"]):
            return f"tool call {position} has other arguments"
    return None


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return arguments


def answer_message(parsed) -> tuple[dict[str, Any], list[str]]:
    """An OpenAI assistant message from a `renderers` ParsedResponse: content, reasoning, the
    tool calls that parsed; a call that did not parse (cut off, not JSON, no name) is appended
    to the content as the model wrote it."""
    from renderers import ToolCallParseStatus

    unparsed = [call.raw for call in parsed.tool_calls if call.status != ToolCallParseStatus.OK]
    content = parsed.content or ""
    if unparsed:
        content += ("\n" if content else "") + "\n".join(unparsed)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if parsed.reasoning_content:
        message["reasoning_content"] = parsed.reasoning_content
    calls = [openai_tool_call(call) for call in parsed.tool_calls if call.status == ToolCallParseStatus.OK]
    if calls:
        message["tool_calls"] = calls
    return message, unparsed


def openai_tool_call(call) -> dict[str, Any]:
    """A parsed call in the OpenAI shape (arguments as a JSON string, an id of its own)."""
    arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
    return {
        "id": call.id or f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


# --------------------------------------------------------------------------- the engine side


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: list[float | None] | None = None
    tokens: list[str] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class _CompletionChoice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None


class _CompletionChunk(msgspec.Struct):
    choices: list[_CompletionChoice] | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None


_chunk = msgspec.json.Decoder(_CompletionChunk)
_probed: set[tuple[str, str | None]] = set()


def completions_url(upstream: Upstream) -> URL:
    return URL(upstream.base_url.rstrip("/") + "/completions")


async def check_endpoint(client: aiohttp.ClientSession, upstream: Upstream, probe_ids: list[int]) -> None:
    """Raise TokenInUnavailable unless the upstream answers a token-id prompt with token ids
    (one generated token, once per process and endpoint). Unreachable: aiohttp's own error."""
    key = (upstream.base_url, upstream.model)
    if key in _probed:
        return
    body = {"model": upstream.model, "prompt": probe_ids, "max_tokens": 1, "return_token_ids": True, "logprobs": 0}
    headers = {"Content-Type": "application/json", **upstream.headers}
    if upstream.api_key is not None:
        headers["Authorization"] = f"Bearer {upstream.api_key}"
    async with client.post(
        completions_url(upstream), data=msgspec.json.encode(body), headers=headers, timeout=upstream.timeout()
    ) as answer:
        raw = await answer.content.read(ERROR_LIMIT)
        where = f"the endpoint {upstream.host}"
        if answer.status == 429 or answer.status >= 500:
            return  # busy or failing, not decided: probed again by the next session
        if answer.status >= 400:
            raise TokenInUnavailable(
                f"token-in: {where} has no token-in /v1/completions: POST /v1/completions with a "
                f"token-id prompt answered {answer.status}: {raw[:300].decode(errors='replace')} "
                "(token-in needs vLLM >= 0.10.2 or an engine like it; the plain capture path "
                "works without it)"
            )
    try:
        choices = _chunk.decode(raw).choices
        choice = choices[0] if choices else None
    except msgspec.DecodeError:
        choice = None
    if choice is None or not choice.token_ids or choice.prompt_token_ids != probe_ids:
        raise TokenInUnavailable(
            f"token-in: {where} answered a token-id prompt without its token ids "
            "(it ignores return_token_ids or does not echo prompt_token_ids): it has no "
            "token-in endpoint pi-env can use"
        )
    _probed.add(key)


ERROR_LIMIT = 4096


def check_endpoint_sync(upstream: Upstream, spec: TokenInSpec) -> None:
    """`check_endpoint` from any thread, with a short prompt the renderer makes. An unreachable
    upstream is not decided here: the agent's first call then fails like any other."""
    from pi_env._aio import run_sync

    probe = spec.renderer.render_ids([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

    async def probe_once(one: Upstream) -> None:
        async with aiohttp.ClientSession() as client:
            await check_endpoint(client, one, probe)

    for url in upstream.base_urls or (upstream.base_url,):  # several replicas: the first that answers
        try:
            run_sync(probe_once(replace(upstream, base_url=url)), timeout=(upstream.read_timeout_s or 60) + 30)
            return
        except (aiohttp.ClientError, TimeoutError, OSError):
            continue


@dataclass
class _Stream:
    """The engine's answer as it arrives: ids, logprobs, and the agent's side of it."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    top: list[msgspec.Raw] = field(default_factory=list)
    echoed_prompt: list[int] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    misaligned: bool = False
    streamed_parts: list[str] = field(default_factory=list)  # content already sent to the agent
    pending_space: list[str] = field(default_factory=list)  # trailing whitespace not sent yet
    held: bool = False  # content streaming stopped (markup may follow)
    prompt_ids: list[int] = field(default_factory=list)
    calls_sent: list[dict[str, Any]] = field(default_factory=list)  # tool calls the agent already has
    call_stream: Any = None  # the renderer's incremental call finder (chatml-hermes's stream_parser())
    calls_stopped: bool = False  # no more tool calls are sent before the end (a parse failed)
    parse_cost: int = 0  # ids re-parsed so far looking for complete calls (renderers without call_stream)
    ended: bool = False  # a stop id arrived: nothing more to decode
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def streamed(self) -> str:
        return "".join(self.streamed_parts)


# Characters that may open markup (tool calls, reasoning, JSON calls, special tokens): content is
# streamed only up to the first of them; what follows is sent once the answer is parsed.
MARKUP_START = "<{["
_MARKUP = re.compile("[" + re.escape(MARKUP_START) + "]")
# Ids decoded so far that end inside a character are held back at most this long: an answer of
# invalid UTF-8 would otherwise grow the decoded window without end (a quadratic decode).
MAX_PENDING_IDS = 8
# Renderers without an incremental call finder are re-parsed on a closing `>`; in all, at most
# this many times the answer's length in ids (past it, the complete calls go out at the end).
REPARSE_BUDGET = 8
# An answer longer than this is parsed in a worker thread, off the event loop every rollout shares.
INLINE_PARSE_IDS = 1024
# Reading an answer gives the loop back at least this often (seconds of work in one go): a request
# that arrives meanwhile needs a few loop turns, so /health waits a few of these at most.
YIELD_AFTER_S = 0.002


class TokenIn(Strategy):
    """transparent_proxy with token-in (see the module docstring)."""

    def __init__(self, session: StrategySession, spec: TokenInSpec):
        self.session = session
        self.options = session.capture_options
        self.spec = spec
        self.ledger = TokenLedger(spec)
        self.tokenizer = spec.renderer._tokenizer if hasattr(spec.renderer, "_tokenizer") else None
        self._stops = set(spec.renderer.get_stop_token_ids())

    async def chat_completions(self, call: Call, body: bytes, turn: TurnRecord) -> web.StreamResponse:
        request = agent_request(body)
        if request is None:
            return not_a_json_object()
        rewritten = rewrite_request(request, self.options)
        messages, tools = request.get("messages") or [], request.get("tools") or None
        plan = await self.ledger.aplan(messages, tools)
        engine_request = self._engine_request(rewritten, plan)
        # The version in force as the prompt leaves (stamped on the turn; its cache salt, when the
        # session salts, in the engine's request and so in what the capture records of it).
        headers = call.upstream_headers(turn, engine_request)
        headers["Content-Type"] = "application/json"
        capture = turn.capture = TurnCapture(
            request=rewritten, prompt_token_ids=plan.token_ids, model=self.options.model or request.get("model")
        )
        capture.token_in = {
            **plan.record(self.spec),
            "engine_request": {k: v for k, v in engine_request.items() if k != "prompt"},
        }
        try:  # to the session's replica (with several base URLs, another if it fails before answering)
            answer = await call.send("POST", "/completions", msgspec.json.encode(engine_request), headers, turn)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            turn.upstream_error = call.unreachable(exc)
            self.ledger.forget("upstream unreachable")
            return json_error(502, f"pi-env gateway: {turn.upstream_error}", "upstream_unreachable")
        call.engine_reported(answer, turn)
        if answer.status >= 400:
            error = await call.read_error(answer, turn)
            self.ledger.forget(f"upstream answered {answer.status}")
            return web.Response(
                status=answer.status, body=error, content_type=answer.content_type or "application/json"
            )
        return await self._relay(call, answer, turn, capture, plan, request)

    def _engine_request(self, rewritten: dict[str, Any], plan: PromptPlan) -> dict[str, Any]:
        options = self.options
        body: dict[str, Any] = {
            "model": rewritten.get("model"),
            "prompt": plan.token_ids,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "stop_token_ids": self.spec.renderer.get_stop_token_ids(),
            "skip_special_tokens": False,
        }
        max_tokens = rewritten.get("max_tokens", rewritten.get("max_completion_tokens"))
        if isinstance(max_tokens, int):
            body["max_tokens"] = max_tokens
        if options.logprobs:
            body["logprobs"] = options.top_logprobs
        for key in (*SAMPLING_KEYS, "stop"):
            if rewritten.get(key) is not None:
                body[key] = rewritten[key]
        return body

    async def _relay(
        self,
        call: Call,
        answer: aiohttp.ClientResponse,
        turn: TurnRecord,
        capture: TurnCapture,
        plan: PromptPlan,
        request: dict[str, Any],
    ) -> web.StreamResponse:
        streaming = request.get("stream") is True
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        envelope = {
            "id": f"chatcmpl-pi-env-{secrets.token_hex(8)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": capture.model or "",
        }
        response = call.stream_response(
            200, {"Content-Type": "text/event-stream"} if streaming else {"Content-Type": "application/json"}
        )
        stream_parser = getattr(self.spec.renderer, "stream_parser", None)
        state = _Stream(
            held=self._reasoning_open(plan.token_ids),
            prompt_ids=plan.token_ids,
            call_stream=stream_parser() if callable(stream_parser) else None,
        )
        completed = False
        try:
            if streaming:
                await response.prepare(call.request)
                await response.write(_sse(envelope, {"role": "assistant", "content": ""}))
                turn.ttfb_s = time.perf_counter() - call.started
            slice_started = time.perf_counter()
            async for line in answer.content:
                if time.perf_counter() - slice_started > YIELD_AFTER_S:
                    # Lines already buffered are read without a pause: give the loop back now and
                    # then, so other rollouts (and /health) are served while a long answer is read.
                    await asyncio.sleep(0)
                    slice_started = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if not payload or payload == b"[DONE]":
                    continue
                delta, calls, reparse = self._take(state, payload)
                if reparse:
                    calls = calls + await self._reparse(state)
                if streaming and (delta or calls):
                    offset = len(state.calls_sent) - len(calls)
                    await response.write(
                        (_sse(envelope, {"content": delta}) if delta else b"")
                        + b"".join(
                            _sse(envelope, {"tool_calls": [{"index": offset + k, **c}]}) for k, c in enumerate(calls)
                        )
                    )
            completed = True
        except asyncio.CancelledError:
            turn.client_disconnected = True
            self._finish_later(call, capture, turn, state, plan, request)
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if call.request.transport is None or call.request.transport.is_closing():
                turn.client_disconnected = True  # the agent went away, not the engine
            else:
                call.broke(turn)
            turn.upstream_error = (
                f"{'agent hung up' if turn.client_disconnected else 'upstream stream broken'}: {describe(exc)}"
            )
        finally:
            answer.release() if completed else answer.close()
            turn.upstream_status = answer.status
        try:
            parsed = await self._parse(state, plan, request)
        except asyncio.CancelledError:
            turn.client_disconnected = True
            self._finish_later(call, capture, turn, state, plan, request)
            raise
        message = self._finish(capture, turn, state, plan, request, None if completed else turn.upstream_error, parsed)
        if not completed:
            if streaming and call.request.transport is not None:
                call.request.transport.close()  # the agent must see a failed answer, not a short one
            else:
                return json_error(502, f"pi-env gateway: {turn.upstream_error}", "upstream_error")
            return response
        finish = capture.choices[0].finish_reason or "stop"
        if not streaming:
            body = {
                **envelope,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                **({"usage": capture.usage} if capture.usage else {}),
            }
            turn.ttfb_s = time.perf_counter() - call.started
            return web.json_response(body)
        rest = message.get("content") or ""
        events = []
        streamed = state.streamed
        if rest.startswith(streamed):
            rest = rest[len(streamed) :]
        if rest:
            events.append(_sse(envelope, {"content": rest}))
        if message.get("reasoning_content"):
            events.append(_sse(envelope, {"reasoning_content": message["reasoning_content"]}))
        for position, tool_call in enumerate(message.get("tool_calls") or []):
            if position >= len(state.calls_sent):  # the others went out as soon as they were complete
                events.append(_sse(envelope, {"tool_calls": [{"index": position, **tool_call}]}))
        events.append(_sse(envelope, {}, finish))
        if include_usage and capture.usage:
            events.append(
                b"data: " + msgspec.json.encode({**envelope, "choices": [], "usage": capture.usage}) + b"\n\n"
            )
        events.append(b"data: [DONE]\n\n")
        try:
            await response.write(b"".join(events))
            await response.write_eof()
        except (ConnectionError, OSError):
            turn.client_disconnected = True
        turn.response_bytes = sum(len(e) for e in events)
        return response

    def _reasoning_open(self, prompt_ids: list[int]) -> bool:
        """Does the prompt open a reasoning block (then nothing is content until parsed)?"""
        try:
            parsed = self.spec.renderer.parse_response([], prompt_ids=prompt_ids)
        except Exception:  # noqa: BLE001 - unknown: hold the content back, it is sent at the end
            return True
        return parsed.reasoning_complete is False

    def _take(self, state: _Stream, payload: bytes) -> tuple[str, list[dict[str, Any]], bool]:
        """Add one engine chunk: the content that can go to the agent now, the tool calls it
        completed, and whether the answer so far should be re-parsed for more (`_reparse`)."""
        try:
            chunk = _chunk.decode(payload)
        except msgspec.DecodeError:
            state.misaligned = True
            return "", [], False
        if chunk.usage:
            state.usage = chunk.usage
        if chunk.model and not state.model:
            state.model = chunk.model
        for choice in chunk.choices or ():
            if choice.index != 0:
                continue
            if choice.prompt_token_ids and state.echoed_prompt is None:
                state.echoed_prompt = choice.prompt_token_ids
            ids = choice.token_ids or []
            entries = choice.logprobs
            logprobs = entries.token_logprobs if entries is not None and entries.token_logprobs is not None else None
            if logprobs is not None and len(logprobs) != len(ids):
                state.misaligned = True
                logprobs = None
            state.ids.extend(ids)
            if logprobs is None:
                state.logprobs.extend([None] * len(ids))
                state.tokens.extend([""] * len(ids))
                state.top.extend([NO_TOP_LOGPROBS] * len(ids))
            else:
                state.logprobs.extend(logprobs)
                # logprobs is not None only when entries is not None; mypy cannot correlate the two,
                # and an assert here would run once per chunk
                state.tokens.extend(entries.tokens or [""] * len(ids))  # type: ignore[union-attr]
                tops = entries.top_logprobs or [None] * len(ids)  # type: ignore[union-attr]
                state.top.extend(
                    msgspec.Raw(msgspec.json.encode([{"token": t, "logprob": lp} for t, lp in (top or {}).items()]))
                    for top in tops
                )
            if choice.finish_reason:
                state.finish_reason = choice.finish_reason
        return self._stream_content(state)

    def _stream_content(self, state: _Stream) -> tuple[str, list[dict[str, Any]], bool]:
        """Decode the new ids (incrementally, as engines do) and look at the new text only, so a
        chunk costs what it carries, never what came before. Returns the content that is
        certainly content (text before any markup, without trailing whitespace: a separator
        before a tool call belongs to it), the tool calls this chunk completed, and whether to
        re-parse for calls (renderers without an incremental call finder, on a closing `>`)."""
        if state.ended or self.tokenizer is None or state.read_offset >= len(state.ids):
            return "", [], False
        ids = state.ids
        if any(i in self._stops for i in ids[state.read_offset :]):
            state.ended = True  # the rest is parsed from the whole answer at its end
            return "", [], False
        decode = self.tokenizer.decode
        before = decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=False)
        after = decode(ids[state.prefix_offset :], skip_special_tokens=False)
        if after.endswith("\ufffd") or len(after) <= len(before):
            if len(ids) - state.read_offset <= MAX_PENDING_IDS:
                return "", [], False  # a character split across tokens: wait for its end
            # Not a split character: bytes that are no text. Stream no more content (the final
            # parse is exact); read on, so the decoded window stays short.
            state.held = True
        new_text = after[len(before) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        delta = "" if state.held else self._content_delta(state, new_text)
        calls: list[dict[str, Any]] = []
        reparse = False
        if state.calls_stopped:
            pass
        elif state.call_stream is not None:
            try:
                calls = [openai_tool_call(call) for call in state.call_stream.feed(new_text)]
            except Exception:  # noqa: BLE001 - a finder's failure: the calls go out with the final parse
                state.calls_stopped = True
            state.calls_sent.extend(calls)
        elif state.held and ">" in new_text and state.parse_cost + len(ids) <= REPARSE_BUDGET * len(ids):
            state.parse_cost += len(ids)
            reparse = True
        return delta, calls, reparse

    @staticmethod
    def _content_delta(state: _Stream, new_text: str) -> str:
        """The part of `new_text` that can go out as content: up to the first markup character
        (then streaming stops), trailing whitespace held back until more text follows it."""
        markup = _MARKUP.search(new_text)
        if markup is not None:
            state.held = True
            new_text = new_text[: markup.start()]
        text = new_text.rstrip()
        if not text:
            state.pending_space.append(new_text)
            return ""
        delta = "".join(state.pending_space) + text
        state.pending_space = [new_text[len(text) :]] if len(text) < len(new_text) else []
        state.streamed_parts.append(delta)
        return delta

    async def _reparse(self, state: _Stream) -> list[dict[str, Any]]:
        """Tool calls complete in the ids so far and not yet sent (renderers without an
        incremental call finder): the leading run of calls that parse (one cut off or malformed
        may still be growing, or reaches the agent as text at the end). A long answer is parsed
        in a worker thread."""
        ids = list(state.ids)
        try:
            if len(ids) <= INLINE_PARSE_IDS:
                parsed = self.spec.renderer.parse_response(ids, prompt_ids=state.prompt_ids)
            else:
                parsed = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.spec.renderer.parse_response(ids, prompt_ids=state.prompt_ids)
                )
        except Exception:  # noqa: BLE001 - the final parse decides (and records the failure)
            state.calls_stopped = True
            return []
        from renderers import ToolCallParseStatus

        new = []
        for position, call in enumerate(parsed.tool_calls):
            if call.status != ToolCallParseStatus.OK:
                break
            if position >= len(state.calls_sent):
                new.append(openai_tool_call(call))
        state.calls_sent.extend(new)
        return new

    async def _parse(self, state: _Stream, plan: PromptPlan, request: dict[str, Any]) -> ParsedAnswer:
        """The whole answer parsed (`TokenLedger.parse`); in a worker thread when it is long."""
        tools = request.get("tools")
        if len(state.ids) <= INLINE_PARSE_IDS:
            return self.ledger.parse(state.ids, plan.token_ids, tools)
        ids = list(state.ids)
        return await asyncio.get_running_loop().run_in_executor(None, self.ledger.parse, ids, plan.token_ids, tools)

    def _finish_later(
        self,
        call: Call,
        capture: TurnCapture,
        turn: TurnRecord,
        state: _Stream,
        plan: PromptPlan,
        request: dict[str, Any],
    ) -> None:
        """The agent hung up: the ledger learns it now (the next call must not bridge from this
        turn), the record is completed by a task of its own (the parse may take a worker thread)."""
        self.ledger.forget("the agent hung up")

        async def finish() -> None:
            parsed = await self._parse(state, plan, request)
            self._finish(capture, turn, state, plan, request, None, parsed, ledger=False)

        call.finish_record_later(finish())

    def _finish(
        self,
        capture: TurnCapture,
        turn: TurnRecord,
        state: _Stream,
        plan: PromptPlan,
        request: dict[str, Any],
        failure: str | None,
        parsed: ParsedAnswer,
        *,
        ledger: bool = True,
    ) -> dict[str, Any]:
        """Fill the record with the ids, logprobs and the parsed answer; tell the ledger."""
        assert capture.token_in is not None  # chat_completions sets it before the call goes upstream
        choice = ChoiceCapture(
            index=0,
            token_ids=state.ids,
            logprobs=state.logprobs,
            tokens=state.tokens,
            top_logprobs=json_array(state.top),
            finish_reason=state.finish_reason,
            ids_complete=not state.misaligned,
        )
        capture.choices = [choice]
        capture.usage = state.usage or {
            "prompt_tokens": len(plan.token_ids),
            "completion_tokens": len(state.ids),
            "total_tokens": len(plan.token_ids) + len(state.ids),
        }
        capture.model = state.model or capture.model
        if isinstance(capture.usage.get("total_tokens"), int):
            turn.total_tokens = capture.usage["total_tokens"]
        capture.token_in["engine_prompt_token_ids_match"] = (
            None if state.echoed_prompt is None else state.echoed_prompt == plan.token_ids
        )
        if state.misaligned:
            capture.token_ids_missing_reason = "an engine chunk could not be read or its ids and logprobs disagreed"
        elif state.echoed_prompt is not None and state.echoed_prompt != plan.token_ids:
            capture.token_ids_missing_reason = "the engine echoed other prompt ids than the ones sent"
        elif state.ids:
            capture.token_ids_source = "token_in"
        else:
            capture.token_ids_missing_reason = "the engine generated no tokens"
        message, unparsed, parse_error = parsed
        streamed = state.streamed
        if not message.get("content") and streamed:
            message["content"] = streamed
        elif message.get("content") and not (message["content"]).startswith(streamed):
            # What the agent got first cannot be taken back: it is part of its answer.
            capture.token_in["stream_note"] = "streamed text was not a prefix of the parsed content"
            message["content"] = streamed + message["content"]
        if unparsed:
            capture.token_in["unparsed_tool_calls"] = unparsed
        if parse_error:
            capture.token_in["parse_error"] = (
                f"the renderer could not parse the answer ({parse_error}); the agent got its decoded text"
            )
        final_calls = message.get("tool_calls") or []
        for position, sent in enumerate(state.calls_sent):  # the agent has these already: keep their ids
            if position < len(final_calls) and final_calls[position]["function"] == sent["function"]:
                final_calls[position]["id"] = sent["id"]
            else:
                capture.token_in["stream_note"] = (
                    f"tool call {position} was sent before the answer ended and does not match the final parse"
                )
        finish = state.finish_reason
        if finish != "length":
            finish = "tool_calls" if message.get("tool_calls") else "stop"
        choice.finish_reason = finish
        choice.content = message.get("content") or ""
        choice.reasoning_content = message.get("reasoning_content") or ""
        choice.tool_calls = message.get("tool_calls") or []
        if not ledger:
            pass
        elif failure or turn.client_disconnected or state.misaligned:
            self.ledger.forget(failure or ("the agent hung up" if turn.client_disconnected else "unreadable answer"))
        else:
            self.ledger.remember(plan, state.ids, message)
        return message


def _sse(envelope: dict[str, Any], delta: dict[str, Any], finish: str | None = None) -> bytes:
    chunk = {**envelope, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"
