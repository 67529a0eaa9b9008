"""interception_gate: trainer-owned generation.

The agent's chat/completions call is held at the gateway and handed to the trainer as a
`GateRequest` (`next_request`); the trainer generates with its own engine and hands back a
`GateCompletion` (`deliver`): token ids, logprobs, and either text (parsed, see
`parse_hermes`) or a structured message. The gateway answers the agent with a normal OpenAI
answer (SSE when it asked for a stream: role, reasoning, content, tool calls with `index`,
finish reason, usage when `include_usage`, [DONE]) and records the turn as a `TurnCapture`
whose ids and logprobs are the trainer's (`token_ids_source="trainer"`), so the trace files,
`fetch_proxy_trace()` and the training view read it like any captured turn.

Ending cleanly, whatever the trainer does:
  - a held call not delivered within `timeout_s` (the session's `gate_timeout_s`,
    PiConfig.mode.gate_timeout_s; default 600 s) is answered with a
    clean, empty final message (finish_reason "stop"), so the agent stops; the turn is recorded
    with `synthetic_answer="gate_timeout"`, the gate answers every later call the same way at
    once, and the rollout is reported unscored with `error_kind="gate_timeout"`;
  - a late `deliver` raises `RequestNotPending` (reason "expired");
  - closing the session answers every held call the same way (reason "closed") and makes
    `next_request` return None.

Thread-safety: `next_request`/`deliver` may be called from any thread (and `anext_request` from
any event loop); the held call itself waits on pi-env's background loop.
"""

from __future__ import annotations

import asyncio
import enum
import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgspec
from aiohttp import web

from pi_env._aio import background_loop
from pi_env.errors import BadInputError
from pi_env.proxy.capture import ChoiceCapture, TurnCapture, sse_from_capture
from pi_env.proxy.records import SessionStop, TurnRecord, check_policy_version
from pi_env.proxy.rewrite import SAMPLING_KEYS, CaptureOptions
from pi_env.proxy.tool_json import (
    CALL_CLOSE,
    CALL_OPEN,
    MAX_TOOL_CALL_CHARS,
    MAX_TOOL_CALL_DEPTH,
    hermes_blocks,
    json_too_deep,
    load_call_json,
    nests_deeper,
)
from pi_env.proxy.wire import (
    Call,
    Strategy,
    StrategySession,
    agent_request,
    describe,
    not_a_json_object,
)

MAX_ARGUMENTS_DEPTH = MAX_TOOL_CALL_DEPTH - 1  # a call's arguments sit one level inside the call

DEFAULT_TIMEOUT_S = 600.0
ALIVE_POLL_S = 0.02  # how often a waiting next_request asks whether the agent still runs
GATE_TIMEOUT = "gate_timeout"


class GateError(BadInputError):
    """Base of everything `deliver` refuses."""


class CompletionInvalid(GateError, ValueError):
    """The completion cannot be turned into an answer (the message says which field)."""


class RequestNotPending(GateError, LookupError):
    """The request is not waiting for a completion. `reason`: "unknown" (not this session's),
    "delivered" (a second delivery), "expired" (past the deadline; the agent was answered with
    a stop), "agent_disconnected" (the agent hung up), "closed" (the session ended)."""

    def __init__(self, request_id: str, reason: str, message: str):
        super().__init__(message)
        self.request_id, self.reason = request_id, reason


@dataclass(frozen=True)
class GateRequest:
    """One held agent call. Attribute names follow OpenEnv's draft intercept dict
    (`request_id`, `messages`, `tools`)."""

    request_id: str
    session_id: str  # the gateway session (one rollout)
    turn: int  # 0-based index of the call in its session, as in the trace
    messages: list[dict[str, Any]] = field(repr=False)
    tools: list[dict[str, Any]] | None = field(repr=False)
    sampling: dict[str, Any]  # the agent's, max_tokens capped, forced values (mode.sampling) applied
    body: dict[str, Any] = field(repr=False)  # the agent's request after policy.py's rules (its model: the session's)
    stream: bool
    received_at: float  # unix time
    expires_at: float  # unix time: undelivered by then, the agent is answered with a stop
    # Token-in (PiConfig.mode.token_in): the prompt ids to generate from, bridged from the
    # previous turn's prompt + delivered ids (or a full render: `token_in` says which and why).
    # Deliver only `token_ids` (+ logprobs): the same renderer parses them for the agent.
    prompt_token_ids: list[int] | None = field(default=None, repr=False)
    token_in: dict[str, Any] | None = None
    # The policy version in force when the call was handed over (what the turn records unless
    # the completion names the version that generated it).
    policy_version: Any = None


@dataclass
class GateCompletion:
    """What the trainer generated for one request. Give `text` (parsed by `parse_hermes`) or a
    structured `message` ({content, reasoning_content, tool_calls: [{name, arguments} or the
    OpenAI {id, type, function: {name, arguments}}]}; arguments a dict or a JSON object string).
    `logprobs`, when given, align 1:1 with `token_ids` (a None in place is allowed).
    `finish_reason` defaults to "tool_calls" when there are tool calls, else "stop"; `usage`
    defaults to the counts of the ids given."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    text: str | None = None
    message: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    # The version of the weights that generated it (a JSON scalar); recorded on the turn (source
    # "trainer") in place of the version in force when the call was handed over. None: that one.
    policy_version: Any = None

    @classmethod
    def coerce(cls, value: GateCompletion | dict | str) -> GateCompletion:
        """A GateCompletion, a dict of its fields, or plain text (no ids: the draft's shape)."""
        if isinstance(value, GateCompletion):
            return value
        if isinstance(value, str):
            return cls(text=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise CompletionInvalid(
                    f"unknown completion fields {unknown}; allowed: {sorted(cls.__dataclass_fields__)}"
                )
            return cls(**value)
        raise CompletionInvalid(f"a completion is a GateCompletion, a dict or a str, not {type(value).__name__}")


# --------------------------------------------------------------------------- text parsing


def parse_hermes(text: str) -> dict[str, Any]:
    """A message from generated text, the way vLLM's `hermes` tool parser (Qwen2.5/3, Hermes)
    reads it: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block becomes a tool
    call and leaves the content; a leading `<think>...</think>` (or text up to a first
    `</think>`, when the template opened the tag) becomes `reasoning_content`. A block that is not
    a JSON object with a string `name`, or is over the limits of pi_env.proxy.tool_json (larger
    than MAX_TOOL_CALL_CHARS, nested deeper than MAX_TOOL_CALL_DEPTH), stays in the content as
    text, as the model wrote it. Linear in the text; never raises."""
    message: dict[str, Any] = {}
    head, closed, rest = text.partition("</think>")
    if closed and (head.lstrip().startswith("<think>") or "<think>" not in head):
        message["reasoning_content"] = head.lstrip().removeprefix("<think>").strip()
        text = rest
    calls, kept, position = [], [], 0
    for start, end in hermes_blocks(text):
        if end < 0:  # never closed: text
            break
        call, _ = load_call_json(text[start + len(CALL_OPEN) : end - len(CALL_CLOSE)].strip())
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"name": call["name"], "arguments": arguments})
        kept.append(text[position:start])
        position = end
    kept.append(text[position:])
    content = "".join(kept).strip()
    message["content"] = content or None
    if calls:
        message["tool_calls"] = calls
    return message


# ------------------------------------------------------------------ completion -> capture


# Checked in C (msgspec), about 10x faster than a Python loop over thousands of prompt ids.
_TokenIds = list[Annotated[int, msgspec.Meta(ge=0)]]
_Logprobs = list[Annotated[float, msgspec.Meta(le=1e-6)] | None]  # NaN fails the bound too


def _int_list(value: Any, name: str) -> list[int]:
    if hasattr(value, "tolist"):  # a numpy array or a torch tensor
        value = value.tolist()
    try:
        return msgspec.convert(value, _TokenIds)
    except msgspec.ValidationError as error:
        raise CompletionInvalid(f"{name} must be a list of non-negative ints: {error}") from None


def _logprob_list(value: Any, count: int) -> list[float | None]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    try:
        logprobs = msgspec.convert(value, _Logprobs)
    except msgspec.ValidationError as error:
        raise CompletionInvalid(f"logprobs must be log-probabilities (<= 0, not NaN) or None: {error}") from None
    if len(logprobs) != count:
        raise CompletionInvalid(f"{count} token ids but {len(logprobs)} logprobs: they must align 1:1")
    return logprobs


def _tool_call(call: Any, position: int) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise CompletionInvalid(f"tool_calls[{position}] must be an object")
    function = call.get("function")
    function = function if isinstance(function, dict) else call
    name, arguments = function.get("name"), function.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise CompletionInvalid(f"tool_calls[{position}] has no name")
    where = f"tool_calls[{position}] ({name[:100]})"
    as_text = "the limit of a tool call; deliver such output as text, where it stays the assistant's content"
    if isinstance(arguments, str):
        if len(arguments) > MAX_TOOL_CALL_CHARS:
            raise CompletionInvalid(
                f"{where}: arguments are larger than {MAX_TOOL_CALL_CHARS:,} characters ({as_text})"
            )
        if json_too_deep(arguments, MAX_ARGUMENTS_DEPTH):
            raise CompletionInvalid(f"{where}: arguments nest deeper than {MAX_ARGUMENTS_DEPTH} levels ({as_text})")
        try:
            parsed = json.loads(arguments)
        except ValueError as error:
            raise CompletionInvalid(f"{where}: arguments are not JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise CompletionInvalid(f"{where}: arguments must be a JSON object")
    elif isinstance(arguments, dict):
        if nests_deeper(arguments, MAX_ARGUMENTS_DEPTH):
            raise CompletionInvalid(f"{where}: arguments nest deeper than {MAX_ARGUMENTS_DEPTH} levels ({as_text})")
        try:
            arguments = json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError) as error:
            raise CompletionInvalid(f"{where}: arguments must be JSON-serialisable: {error}") from None
        if len(arguments) > MAX_TOOL_CALL_CHARS:
            raise CompletionInvalid(
                f"{where}: arguments are larger than {MAX_TOOL_CALL_CHARS:,} characters as JSON ({as_text})"
            )
    else:
        raise CompletionInvalid(f"{where}: arguments must be a dict or a JSON object string")
    call_id = call.get("id") or f"call_{secrets.token_hex(12)}"
    return {"id": str(call_id), "type": "function", "function": {"name": name, "arguments": arguments}}


def _check_json(name: str, value: Any) -> None:
    """`value` goes into the agent's answer and the record as JSON: it must encode, shallowly."""
    if nests_deeper(value, MAX_TOOL_CALL_DEPTH):
        raise CompletionInvalid(f"{name} nests deeper than {MAX_TOOL_CALL_DEPTH} levels")
    try:
        msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError) as error:
        raise CompletionInvalid(f"{name} must be JSON-serialisable: {error}") from None


def _text_field(message: dict, key: str) -> str:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise CompletionInvalid(f"message.{key} must be a string or None")
    return value or ""


def build_capture(body: dict[str, Any], completion: GateCompletion) -> TurnCapture:
    """The turn's record (and the agent's answer) from a delivered completion; raises
    CompletionInvalid, naming the field, for anything that cannot be answered faithfully."""
    if (completion.text is None) == (completion.message is None):
        raise CompletionInvalid("give exactly one of `text` (parsed as Hermes-style tool calls) or `message`")
    if completion.text is not None and not isinstance(completion.text, str):
        raise CompletionInvalid("text must be a string")
    message = parse_hermes(completion.text) if completion.text is not None else completion.message
    if not isinstance(message, dict):
        raise CompletionInvalid("message must be an object {content, reasoning_content, tool_calls}")
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise CompletionInvalid("message.tool_calls must be a list")
    ids = _int_list(completion.token_ids, "token_ids")
    logprobs: list[float | None] = (
        [None] * len(ids) if completion.logprobs is None else _logprob_list(completion.logprobs, len(ids))
    )
    prompt = [] if completion.prompt_token_ids is None else _int_list(completion.prompt_token_ids, "prompt_token_ids")
    tool_calls = [_tool_call(call, i) for i, call in enumerate(raw_calls)]
    finish = completion.finish_reason or ("tool_calls" if tool_calls else "stop")
    if not isinstance(finish, str):
        raise CompletionInvalid("finish_reason must be a string")
    usage = completion.usage
    if usage is not None and not isinstance(usage, dict):
        raise CompletionInvalid("usage must be an object")
    if usage is not None:
        _check_json("usage", usage)
    if completion.model is not None and not isinstance(completion.model, str):
        raise CompletionInvalid("model must be a string or None")
    if usage is None and ids:
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    choice = ChoiceCapture(
        index=0,
        content=_text_field(message, "content"),
        reasoning_content=_text_field(message, "reasoning_content"),
        reasoning=_text_field(message, "reasoning"),
        tool_calls=tool_calls,
        finish_reason=finish,
        token_ids=ids,
        logprobs=logprobs,
    )
    capture = TurnCapture(
        request=body, choices=[choice], prompt_token_ids=prompt, usage=usage, model=completion.model or _model(body)
    )
    if not ids:
        capture.token_ids_missing_reason = "the trainer delivered no completion token ids"
    else:
        capture.token_ids_source = "trainer"
        if not prompt:
            capture.token_ids_missing_reason = "the trainer delivered completion ids but no prompt_token_ids"
    return capture


def _model(body: dict) -> str | None:
    return body.get("model") if isinstance(body.get("model"), str) else None


def stop_capture(body: dict[str, Any], reason: str, note: str) -> TurnCapture:
    """The gateway's own clean, empty final answer (the agent stops), marked as such."""
    return TurnCapture(
        request=body,
        choices=[ChoiceCapture(index=0, finish_reason="stop")],
        model=_model(body),
        synthetic_answer=reason,
        token_ids_missing_reason=note,
    )


def request_sampling(body: dict[str, Any], options: CaptureOptions) -> dict[str, Any]:
    """What the trainer should sample with: the agent's own parameters, `max_tokens` (from
    max_tokens or max_completion_tokens, which the gateway's policy has capped at the session's
    cap), then the forced ones."""
    sampling = {key: body[key] for key in (*SAMPLING_KEYS, "stop") if body.get(key) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        max_tokens = None
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    sampling.update(options.sampling)
    return sampling


def answer_body(capture: TurnCapture) -> bytes:
    """A non-streamed chat.completion for an agent that did not ask for a stream."""
    choice = capture.choices[0]
    return msgspec.json.encode(
        {
            "id": f"pi-env-gate-{secrets.token_hex(6)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": capture.model or "",
            "choices": [{"index": 0, "message": choice.message(), "finish_reason": choice.finish_reason or "stop"}],
            **({"usage": capture.usage} if capture.usage else {}),
        }
    )


# --------------------------------------------------------------------------- the strategy

_QUEUED, _TAKEN, _DELIVERED = "queued", "taken", "delivered"


class _Nothing(enum.Enum):
    """The type of _NOTHING, so that `outcome is not _NOTHING` narrows for mypy."""

    NOTHING = enum.auto()


_NOTHING: Final = _Nothing.NOTHING


class _Held:
    __slots__ = ("request", "record_body", "loop", "future", "state", "capture", "plan", "policy_version")

    def __init__(self, request: GateRequest, record_body: dict, loop: asyncio.AbstractEventLoop, plan=None):
        self.request, self.record_body, self.loop, self.plan = request, record_body, loop, plan
        self.future: asyncio.Future = loop.create_future()
        self.state = _QUEUED
        self.capture: TurnCapture | None = None
        self.policy_version: Any = None  # the delivered completion's, if it named one

    @property
    def pending(self) -> bool:
        return self.state in (_QUEUED, _TAKEN)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class InterceptionGate(Strategy):
    """The interception_gate strategy of one gateway session (see the module docstring)."""

    def __init__(self, session: StrategySession):
        self.session = session
        self.timeout_s = DEFAULT_TIMEOUT_S if session.gate_timeout_s is None else session.gate_timeout_s
        self.stop_reason: str | None = None  # "gate_timeout" once a held call expired
        self.stop_message: str | None = None
        self.ended: str | None = None  # "closed" / "agent_exited": no more requests
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: deque[_Held] = deque()
        self._requests: dict[str, _Held] = {}  # every request of the session, by id
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.ledger = None  # token-in: the session's prompt ids and parser (proxy/token_in.py)
        if session.token_in is not None:
            from pi_env.proxy.token_in import TokenLedger

            self.ledger = TokenLedger(session.token_in)

    # -- the agent's side (on the gateway's loop)

    async def chat_completions(self, call: Call, body: bytes, turn: TurnRecord) -> web.StreamResponse:
        request = agent_request(body)
        if request is None:
            return not_a_json_object()
        if self.stop_reason or self.ended:  # after a timeout or the end: stop at once
            reason = self.stop_reason or self.ended
            assert reason is not None  # one of them is set: the test just above
            turn.upstream_error = self.stop_message or f"interception_gate: the session ended ({reason})"
            return await self._answer(call, turn, request, stop_capture(request, reason, turn.upstream_error))
        mine = msgspec.json.decode(body)  # the trainer's own copy: what it does to it is not recorded
        plan = None
        if self.ledger is not None:
            plan = await self.ledger.aplan(request.get("messages") or [], request.get("tools") or None)
        now = time.time()
        # Handing the call to the trainer is what sending it upstream is in the other modes.
        turn.policy_version, turn.policy_version_source = self.session.policy.value, "gateway"
        held = _Held(
            GateRequest(
                request_id=f"gate-{secrets.token_hex(12)}",
                session_id=self.session.id,
                turn=turn.turn,
                messages=mine.get("messages") or [],
                tools=mine.get("tools"),
                sampling=request_sampling(mine, self.session.capture_options),
                body=mine,
                stream=mine.get("stream") is True,
                received_at=now,
                expires_at=now + self.timeout_s,
                prompt_token_ids=list(plan.token_ids) if plan else None,
                # a plan comes only from the ledger, which exists only with token_in
                token_in=plan.record(self.session.token_in) if plan and self.session.token_in is not None else None,
                policy_version=turn.policy_version,
            ),
            request,
            asyncio.get_running_loop(),
            plan,
        )
        # Until it is settled (delivered, expired, withdrawn, released) the call is the trainer's,
        # not in flight for wait_idle(): whoever settles it makes it in flight again.
        self.session.set_waiting(True)
        try:
            self._offer(held)
            try:
                await asyncio.wait_for(asyncio.shield(held.future), self.timeout_s)
            except TimeoutError:
                if not self._settle(held, GATE_TIMEOUT):
                    await held.future  # delivered (or closed) just now: the wake-up is on its way
        except asyncio.CancelledError:
            self._settle(held, "agent_disconnected")
            raise
        if held.state != _DELIVERED and self.ledger is not None:
            self.ledger.forget(f"the call was not delivered ({held.state})")
        if held.state == _DELIVERED:
            capture = held.capture
            assert capture is not None  # deliver() sets it before marking the call delivered
            if held.policy_version is not None:  # the trainer said which weights generated it
                turn.policy_version, turn.policy_version_source = held.policy_version, "trainer"
        elif held.state == GATE_TIMEOUT:
            self.stop_reason = GATE_TIMEOUT
            self.stop_message = turn.upstream_error = (
                f"interception_gate: the trainer did not deliver request {held.request.request_id} "
                f"(turn {turn.turn}) within {self.timeout_s:g} s; the agent was answered with a stop"
            )
            capture = stop_capture(request, GATE_TIMEOUT, self.stop_message)
        else:  # closed while held
            turn.upstream_error = f"interception_gate: the session ended ({held.state}) while the call was held"
            capture = stop_capture(request, held.state, turn.upstream_error)
        return await self._answer(call, turn, request, capture)

    async def _answer(self, call: Call, turn: TurnRecord, request: dict, capture: TurnCapture) -> web.StreamResponse:
        """Send the whole answer at once (headers, body and the terminating chunk in one write)
        before the handler returns, so recording the turn never delays the agent."""
        turn.capture = capture
        if request.get("stream") is True:
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            payload, content_type = sse_from_capture(capture, include_usage=include_usage), "text/event-stream"
        else:
            payload, content_type = answer_body(capture), "application/json"
        if capture.usage and isinstance(capture.usage.get("total_tokens"), int):
            turn.total_tokens = capture.usage["total_tokens"]
        response = call.stream_response(200, {"Content-Type": content_type})
        turn.upstream_status = 200
        try:
            await response.prepare(call.request)
            await response.write_eof(payload)
            turn.response_bytes = len(payload)
        except (ConnectionError, OSError) as error:
            turn.client_disconnected = True
            turn.upstream_error = turn.upstream_error or f"the agent hung up before the answer: {describe(error)}"
        turn.ttfb_s = turn.latency_s = time.perf_counter() - call.started
        return response

    def _offer(self, held: _Held) -> None:
        with self._lock:
            self._requests[held.request.request_id] = held
            if self.ended:  # ended since the check in chat_completions: released at once
                self._settled(held, self.ended)
                _wake(held.future)
                return
            self._queue.append(held)
            self._notify()

    def _settle(self, held: _Held, state: str) -> bool:
        """Move a still pending request to a final state; False when it was already settled."""
        with self._lock:
            if not held.pending:
                return False
            self._settled(held, state)
            return True

    def _settled(self, held: _Held, state: str) -> None:  # with the lock held
        held.state = state
        self.session.set_waiting(False)

    def _notify(self) -> None:  # with the lock held
        self._ready.notify_all()
        waiters, self._async_waiters = self._async_waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_wake, future)

    # -- the trainer's side (any thread)

    def next_request(
        self, timeout_s: float | None = None, *, alive: Callable[[], bool] | None = None
    ) -> GateRequest | None:
        """The next held call, oldest first. None once the session ended or `alive()` says the
        agent is gone; TimeoutError when `timeout_s` passes first (nothing is lost: call again)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is background_loop():
            raise RuntimeError("next_request() blocks; on pi-env's event loop use `await anext_request()`")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._ready:
            while True:
                outcome = self._take(alive)
                if outcome is not _NOTHING:
                    return outcome
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise TimeoutError(f"no agent request within {timeout_s} s")
                if alive is not None:
                    wait = ALIVE_POLL_S if wait is None else min(wait, ALIVE_POLL_S)
                self._ready.wait(wait)

    async def anext_request(
        self, timeout_s: float | None = None, *, alive: Callable[[], bool] | None = None
    ) -> GateRequest | None:
        """`next_request` for async code, on any event loop."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                outcome = self._take(alive)
                if outcome is not _NOTHING:
                    return outcome
                waiter = loop.create_future()
                self._async_waiters.append((loop, waiter))
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                self._forget(waiter)
                raise TimeoutError(f"no agent request within {timeout_s} s")
            if alive is not None:
                wait = ALIVE_POLL_S if wait is None else min(wait, ALIVE_POLL_S)
            try:
                await asyncio.wait_for(waiter, wait)
            except TimeoutError:
                pass
            finally:
                self._forget(waiter)

    def _forget(self, waiter: asyncio.Future) -> None:
        with self._lock:
            self._async_waiters = [(loop, w) for loop, w in self._async_waiters if w is not waiter]

    def _take(self, alive: Callable[[], bool] | None) -> GateRequest | None | Literal[_Nothing.NOTHING]:
        """With the lock held: a request, None (no more will come), or _NOTHING (not yet)."""
        if self.ended:
            return None
        if alive is not None and not alive():
            self._end("agent_exited")
            return None
        while self._queue:
            held = self._queue.popleft()
            if held.state == _QUEUED:
                held.state = _TAKEN
                return held.request
        return _NOTHING

    def deliver(self, request: GateRequest | str | dict, completion: GateCompletion | dict | str) -> None:
        """Answer a held call. Raises RequestNotPending (unknown id, second delivery, expired,
        agent gone, closed) or CompletionInvalid (naming the field), and nothing else for any
        completion; the parse runs on the caller's thread, then the agent receives the answer
        from the gateway's loop."""
        request_id = _request_id(request)
        with self._lock:
            held = self._check_pending(request, request_id)
        try:
            completion = GateCompletion.coerce(completion)
            version = _completion_version(completion.policy_version)
            if held.plan is not None:
                capture = self._token_in_capture(held, completion)
            else:
                capture = build_capture(held.record_body, completion)
        except GateError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever the trainer sends, it learns what to fix
            raise CompletionInvalid(
                f"the completion cannot be turned into an answer ({type(error).__name__}: "
                f"{str(error)[:300]}); see GateCompletion for what each field takes"
            ) from None
        with self._lock:
            self._check_pending(request, request_id)
            held.capture, held.policy_version = capture, version
            if held.plan is not None:
                assert self.ledger is not None  # a held call has a plan only when the session has a ledger
                self.ledger.remember(held.plan, capture.choices[0].token_ids, capture.choices[0].message())
            self._settled(held, _DELIVERED)  # in flight again at once: a trace read now waits for it
        held.loop.call_soon_threadsafe(_wake, held.future)

    async def adeliver(self, request: GateRequest | str | dict, completion: GateCompletion | dict | str) -> None:
        """`deliver` from async code: validation and parsing run in a worker thread, so a long
        answer never stalls the caller's loop (which may be the gateway's own)."""
        await asyncio.get_running_loop().run_in_executor(None, self.deliver, request, completion)

    def _token_in_capture(self, held: _Held, completion: GateCompletion) -> TurnCapture:
        """With a renderer: the trainer's ids, parsed by the same renderer into the agent's answer."""
        if completion.text is not None or completion.message is not None:
            raise CompletionInvalid(
                "this session renders (token-in): deliver token_ids (and logprobs); the "
                "renderer parses them, so text and message must be left out"
            )
        ids = _int_list(completion.token_ids, "token_ids")
        if not ids:
            raise CompletionInvalid("token_ids is empty: a token-in completion is its ids")
        plan = held.plan
        if (
            completion.prompt_token_ids is not None
            and _int_list(completion.prompt_token_ids, "prompt_token_ids") != plan.token_ids
        ):
            raise CompletionInvalid(
                "prompt_token_ids differ from the request's: generate from "
                "GateRequest.prompt_token_ids (or leave prompt_token_ids out)"
            )
        assert self.ledger is not None  # held.plan is set: it came from the ledger
        message, unparsed, parse_error = self.ledger.parse(ids, plan.token_ids, held.request.tools)
        stops = set(self.ledger.renderer.get_stop_token_ids())
        finish = completion.finish_reason or (
            "tool_calls" if message.get("tool_calls") else "stop" if ids[-1] in stops else "length"
        )
        capture = build_capture(
            held.record_body,
            GateCompletion(
                token_ids=ids,
                logprobs=completion.logprobs,
                message=message,
                finish_reason=finish,
                prompt_token_ids=plan.token_ids,
                usage=completion.usage,
                model=completion.model,
            ),
        )
        capture.token_in = {
            **plan.record(self.session.token_in),
            **({"unparsed_tool_calls": unparsed} if unparsed else {}),
        }
        if parse_error:
            capture.token_in["parse_error"] = (
                f"the renderer could not parse the ids ({parse_error}); the agent got their decoded text"
            )
        return capture

    def _check_pending(self, request: Any, request_id: str) -> _Held:
        held = self._requests.get(request_id)
        if held is None:
            owner = getattr(request, "session_id", None)
            elsewhere = f" (it belongs to session {owner})" if owner and owner != self.session.id else ""
            raise RequestNotPending(
                request_id, "unknown", f"request {request_id!r} is not one of session {self.session.id}'s{elsewhere}"
            )
        if not held.pending:
            why = {
                _DELIVERED: "was already delivered",
                GATE_TIMEOUT: f"expired after {self.timeout_s:g} s; the agent was answered with a stop",
                "agent_disconnected": "was withdrawn: the agent hung up",
            }.get(held.state, f"was released when the session ended ({held.state})")
            reason = "expired" if held.state == GATE_TIMEOUT else held.state
            raise RequestNotPending(request_id, reason, f"request {request_id} (turn {held.request.turn}) {why}")
        return held

    # -- the end

    def stopped(self) -> SessionStop | None:
        """After a held call expired: the reason ("gate_timeout") and what it says."""
        if self.stop_reason is None:
            return None
        return SessionStop(self.stop_reason, self.stop_message or self.stop_reason)

    def end(self, reason: str = "closed") -> None:
        """No more requests will be handed out; every held call is answered with a stop."""
        with self._lock:
            self._end(reason)

    def close(self) -> None:  # GatewaySession.close()
        self.end("closed")

    def _end(self, reason: str) -> None:  # with the lock held
        if self.ended:
            return
        self.ended = reason
        for held in self._requests.values():
            if held.pending:
                self._settled(held, reason)
                held.loop.call_soon_threadsafe(_wake, held.future)
        self._queue.clear()
        self._notify()


def _completion_version(version: Any) -> Any:
    try:
        return check_policy_version(version)
    except (TypeError, ValueError) as error:
        raise CompletionInvalid(f"policy_version: {error}") from None


def _request_id(request: GateRequest | str | dict) -> str:
    if isinstance(request, GateRequest):
        return request.request_id
    if isinstance(request, str):
        return request
    if isinstance(request, dict) and isinstance(request.get("request_id"), str):
        return request["request_id"]
    raise TypeError(f"a request is a GateRequest, its request_id, or a dict with one, not {type(request).__name__}")
