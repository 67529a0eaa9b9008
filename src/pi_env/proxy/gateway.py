"""The host-side model gateway: the only way a sandboxed agent reaches a model.

One `Gateway` per process listens on a Unix socket (bind-mounted into sandboxes, which have no
network) and on 127.0.0.1 TCP (unsandboxed use, benchmarks). Each rollout opens a
`GatewaySession`; the agent authenticates with the session's random token, and the gateway
relays its calls to the session's `Upstream` with the real API key, which never enters the
sandbox. Per chat/completions call it records a `TurnRecord`, enforces the `max_turns` budget
and, if asked, appends the record to a JSONL trace file as soon as the turn ends.

Before any mode sees a call, the gateway applies the rules of policy.py to it, the same in
every mode: the exact routes, the session's limits (request bodies read incrementally within
its byte budget and time limit, a cap on its calls in flight), the allow-list of headers
relayed upstream, and the body rules (the session's model, one choice, capped token limits,
`stream` a boolean, no engine extra the config did not allow). What a session then does with
a chat/completions call is its mode's `Strategy`. "black_box" relays the policed body: a
well-formed call (Pi's) byte for byte, a call that breaks a rule rewritten (the model, `n`,
token limits) or refused with a 400; it adds no capture parameters and records what was asked
and answered. Capturing modes (transparent_proxy, interception_gate) plug in as further
strategies.

Hot path: the answer is relayed per upstream read (never per SSE line, never buffered whole),
through one pooled aiohttp client session; pieces of a fast stream are gathered for up to
RELAY_BATCH_S so that one read and one send carry many tokens.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import logging
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Protocol

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict
from yarl import URL

from pi_env._aio import run_sync
from pi_env.proxy.capture import TurnCapture
from pi_env.proxy.policy import (
    PolicyError,
    SessionLimits,
    check_allow_fields,
    police_request,
    relayed_request_headers,
    scrub,
    secrets_of,
    upstream_path,
)
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.sandbox.hostdir import discard_host_dir, make_owned_dir, sweep_stale_host_dirs

if TYPE_CHECKING:
    from pi_env.proxy.token_in import TokenInSpec

log = logging.getLogger(__name__)

BASE_URL_PATH = "/v1"
GATEWAY_DIR_PREFIX = "pi-env-gateway-"  # <tmp>/pi-env-gateway-<id>/: the Unix socket's dir
ERROR_BODY_LIMIT = 4096  # bytes of an upstream error body kept in the TurnRecord
ERROR_RELAY_LIMIT = 1 << 20  # bytes of it relayed to the agent (read whole, to mask secrets)
# A refused call's unread body is drained (read and discarded, never kept) this long so the
# agent can read its error, then the connection is closed (aiohttp's default: 10 s).
LINGER_S = 2.0
# Pieces of an answer that arrive less than this apart are relayed together: the upstream's
# socket is left unread for this long, so one read and one send carry what a fast stream (an
# engine at thousands of tokens a second) sent meanwhile. A slow stream is relayed piece by
# piece as before; the first piece never waits.
RELAY_BATCH_S = 0.001

# RFC 9110 section 7.6.1: meaningful for one connection only, never relayed back to the agent.
# (What reaches the upstream of the agent's own headers is an allow-list: see policy.py.)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


@dataclass
class Upstream:
    """Where a session's model calls go. The key (and extra headers, which may hold secrets
    too) stay out of repr so they cannot leak through logs or tracebacks."""

    base_url: str  # e.g. "http://127.0.0.1:8000/v1"; "/<rest>" of /v1/<rest> is appended
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    # Per session; None: the gateway's defaults. read bounds each wait for upstream bytes,
    # headers included: long enough for a slow prefill, short enough to free a stuck agent.
    connect_timeout_s: float | None = None
    read_timeout_s: float | None = None

    def timeout(self) -> aiohttp.ClientTimeout | None:
        if self.connect_timeout_s is None and self.read_timeout_s is None:
            return None
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s)

    @property
    def host(self) -> str:
        """host:port only: the base URL may carry user:password."""
        url = URL(self.base_url)
        return f"{url.host}:{url.port}"


@dataclass
class TurnRecord:
    """One chat/completions call as the gateway saw it."""

    turn: int  # 0-based index of the call within its session
    started_at: float  # unix time
    latency_s: float | None = None  # until the last byte was relayed (or the call failed)
    ttfb_s: float | None = None  # until the first upstream body byte
    upstream_status: int | None = None  # None: no answer from upstream at all
    upstream_error: str | None = None  # a non-2xx body (first 4 KB), or why the call failed
    request_bytes: int = 0
    response_bytes: int = 0
    client_disconnected: bool = False  # the agent hung up before the answer ended
    streamed: bool | None = None  # the agent asked for a streamed answer (None: the body was refused)
    total_tokens: int | None = None  # usage.total_tokens, when the answer reported it
    reserved_tokens: int = 0  # held against max_total_tokens while the call ran
    capture: TurnCapture | None = None  # transparent_proxy: request, answer, ids, logprobs

    def to_json(self) -> dict:
        data = {k: v for k, v in vars(self).items() if k != "capture"}
        data["capture"] = self.capture.to_json() if self.capture else None
        return data


class Strategy(Protocol):
    """How a session answers the agent's chat/completions calls (one per mode)."""

    def __init__(self, session: GatewaySession) -> None: ...

    async def chat_completions(self, call: Call, body: bytes, turn: TurnRecord) -> web.StreamResponse: ...


class BlackBox:
    """Relay the policed body as it is (no capture parameters; a well-formed call is the
    agent's bytes), and record what was asked and answered: the conversation comes from the
    gateway, never from the agent's own files (see transparent.assemble_after: a small answer
    is parsed inline, a large one in a worker)."""

    def __init__(self, session: GatewaySession):
        self.session = session

    async def chat_completions(self, call: Call, body: bytes, turn: TurnRecord) -> web.StreamResponse:
        from pi_env.proxy.transparent import assemble_after  # parses: loaded only when used

        request = agent_request(body)
        if request is None:
            return await call.relay(body, turn)
        answer = await call.open(body, turn)
        if isinstance(answer, web.Response):
            return answer
        if answer.status >= 400:  # as relay(): read whole (bounded), secrets echoed in it masked
            error = await call.read_error(answer, turn)
            return web.Response(status=answer.status, body=error, headers=call.agent_headers(answer))
        turn.capture = capture = TurnCapture(request=request)
        # finish=False: a small answer is recorded before the agent sees its end, as before
        # black_box parsed anything.
        return await assemble_after(call, answer, capture, turn, request.get("stream") is True, finish=False)


def _transparent_proxy(session: GatewaySession) -> Strategy:
    if session.token_in is not None:  # the gateway renders: ids in, ids out (proxy/token_in.py)
        from pi_env.proxy.token_in import TokenIn

        return TokenIn(session, session.token_in)
    from pi_env.proxy.transparent import TransparentProxy  # parses: loaded only when used

    return TransparentProxy(session)


def _interception_gate(session: GatewaySession) -> Strategy:
    from pi_env.proxy.gate import InterceptionGate  # loaded only when used

    return InterceptionGate(session)


STRATEGIES: dict[str, Callable[[GatewaySession], Strategy]] = {
    "black_box": BlackBox,
    "transparent_proxy": _transparent_proxy,
    "interception_gate": _interception_gate,
}


class GatewaySession:
    """One agent run's view of the gateway: its token, upstream, budget and recorded turns."""

    base_url_path = BASE_URL_PATH

    def __init__(
        self,
        upstream: Upstream,
        mode: str,
        max_turns: int | None,
        trace_path: str | None,
        capture: CaptureOptions | None = None,
        max_total_tokens: int | None = None,
        token_in: TokenInSpec | None = None,
        max_tokens_cap: int | None = None,
        limits: SessionLimits | None = None,
        allow_fields: Iterable[str] = (),
    ):
        if mode not in STRATEGIES:
            raise ValueError(f"unknown gateway mode {mode!r}; supported: {sorted(STRATEGIES)}")
        self.id = secrets.token_hex(8)
        self.token = secrets.token_urlsafe(32)
        self.upstream = upstream
        self.mode = mode
        self.capture_options = capture or CaptureOptions(model=upstream.model)
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.token_in = token_in  # the renderer, when the gateway renders (transparent_proxy, interception_gate)
        self.max_tokens_cap = max_tokens_cap  # per call (max_tokens / max_completion_tokens)
        self.limits = limits or SessionLimits()
        self.allow_fields = check_allow_fields(allow_fields)  # policy.RESTRICTED_FIELDS let through
        self.calls_open = 0  # requests of any route in the handler now (at most limits.max_concurrent_calls)
        self.body_bytes_held = 0  # request body bytes those calls hold (at most limits.max_request_bytes)
        self.secrets = secrets_of(upstream.api_key, upstream.headers)  # masked in all it relays
        self.strategy: Strategy = STRATEGIES[mode](self)
        self.trace_path = trace_path
        self.turns: list[TurnRecord] = []
        self.on_record: Callable[[TurnRecord], None] | None = None  # told of each turn as it is recorded
        self.budget_exhausted: str | None = None  # why calls are refused: "max_turns" / "max_total_tokens"
        self.tokens_used = 0
        self.tokens_reserved = 0  # by calls in flight: what they may still generate
        self._calls_started = 0
        self._in_flight = 0
        self._idle = threading.Condition()
        self._trace_lock = threading.Lock()  # close_session() runs on the caller's thread
        self._trace: IO[str] | None = None
        if trace_path:  # turns hold prompts and answers: for this user only (0700 dir, 0600 file)
            os.makedirs(os.path.dirname(os.path.abspath(trace_path)), mode=0o700, exist_ok=True)
            fd = os.open(trace_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self._trace = os.fdopen(fd, "a", encoding="utf-8")

    def __repr__(self) -> str:  # no token
        return f"GatewaySession(id={self.id!r}, mode={self.mode!r}, upstream={self.upstream!r})"

    def open_call(self) -> bool:
        """A slot for one more request, False when limits.max_concurrent_calls are open (on the
        gateway's loop, like claim_turn: checking and taking are one step)."""
        if self.calls_open >= self.limits.max_concurrent_calls:
            return False
        self.calls_open += 1
        return True

    def close_call(self, body_bytes: int) -> None:
        self.calls_open -= 1
        self.body_bytes_held -= body_bytes

    def hold_body_bytes(self, count: int) -> bool:
        """Charge `count` more request body bytes to the session's budget; False if they do not fit."""
        if self.body_bytes_held + count > self.limits.max_request_bytes:
            return False
        self.body_bytes_held += count
        return True

    def tokens_left(self) -> int | None:
        """What max_total_tokens still allows a new call, counting what the calls in flight
        may yet generate; None without a token budget."""
        if self.max_total_tokens is None:
            return None
        return self.max_total_tokens - self.tokens_used - self.tokens_reserved

    def claim_turn(self, reserve: int | None = None) -> int | None:
        """The index of a new chat/completions call, or None once a budget is spent. `reserve`:
        the completion tokens the call may generate, held against max_total_tokens until it is
        recorded (called on the gateway's loop, so checking and reserving are one step)."""
        left = self.tokens_left()
        if self.max_turns is not None and self._calls_started >= self.max_turns:
            self.budget_exhausted = "max_turns"
        elif left is not None and left <= 0:
            self.budget_exhausted = "max_total_tokens"
        if self.budget_exhausted:
            return None
        with self._idle:
            self._in_flight += 1
        self._calls_started += 1
        if left is not None:
            self.tokens_reserved += reserve or 0
        return self._calls_started - 1

    def record(self, turn: TurnRecord) -> None:
        """Keep the finished turn, and put it on disk at once so a crash loses nothing. `turns`
        stays in the order the agent made its calls: a long answer whose record is finished
        later (in the capture worker, or a slow call overtaken by a faster one) keeps its place."""
        if not self.turns or self.turns[-1].turn < turn.turn:
            self.turns.append(turn)
        else:
            bisect.insort(self.turns, turn, key=lambda t: t.turn)
        if self.max_total_tokens is not None:
            self.tokens_reserved -= turn.reserved_tokens
            if turn.total_tokens is None and turn.upstream_status is not None and turn.upstream_status < 400:
                # An answer without usage: charge all it was allowed to generate, plus its
                # prompt at 4 bytes a token, so leaving usage out never buys extra tokens.
                turn.total_tokens = turn.reserved_tokens + turn.request_bytes // 4
        self.tokens_used += turn.total_tokens or 0
        with self._trace_lock:
            if self._trace is not None:
                self._trace.write(msgspec.json.encode(turn.to_json()).decode() + "\n")
                self._trace.flush()
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()
        if self.on_record is not None:
            try:
                self.on_record(turn)
            except Exception:
                log.exception("on_record listener failed for turn %s", turn.turn)

    def set_waiting(self, waiting: bool) -> None:
        """A call held for someone outside the gateway (interception_gate's trainer) is not in
        flight for wait_idle(): nothing can be recorded until it is answered."""
        with self._idle:
            self._in_flight += -1 if waiting else 1
            self._idle.notify_all()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no call is in flight. A capturing mode finishes its record after the agent
        saw the answer's end, so read `turns` only after this."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)

    def close(self) -> None:
        release = getattr(self.strategy, "close", None)
        if release is not None:  # interception_gate: answer every held call
            release()
        with self._trace_lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None


def json_error(status: int, message: str, error_type: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": error_type}}, status=status, headers=headers)


def agent_request(body: bytes) -> dict | None:
    """The agent's chat/completions body as a JSON object; None when it is not one (answer
    with `not_a_json_object()`)."""
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    return request if isinstance(request, dict) else None


def not_a_json_object() -> web.Response:
    return json_error(400, "pi-env gateway: the request body is not a JSON object", "invalid_request")


def bearer_token(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    return value[7:].strip() if value[:7].lower() == "bearer " else None


def connection_listed(headers) -> set[str]:
    """Header names a `Connection:` header declares hop-by-hop for this message."""
    return {name.strip().lower() for name in headers.get("Connection", "").split(",")}


def upstream_request_headers(agent_headers, upstream: Upstream) -> CIMultiDict:
    """The agent's allowed headers (policy.relayed_request_headers), then the gateway's own."""
    headers = CIMultiDict(relayed_request_headers(agent_headers))
    # Uncompressed answers cost nothing on SSE streams and keep error bodies readable.
    headers["Accept-Encoding"] = "identity"
    if upstream.api_key is not None:
        headers["Authorization"] = f"Bearer {upstream.api_key}"
    headers.update(upstream.headers)
    return headers


def agent_response_headers(upstream_headers) -> CIMultiDict:
    # Content-Length goes too: the answer is re-sent chunked, so the agent sees it end only at
    # the terminating chunk, which is written after the turn is recorded.
    drop = HOP_BY_HOP | {"content-length"} | connection_listed(upstream_headers)
    return CIMultiDict((k, v) for k, v in upstream_headers.items() if k.lower() not in drop)


class RelayedResponse(web.StreamResponse):
    """A streamed answer that costs one send (a syscall, and a wake-up of the agent) fewer at
    each end: the headers leave with the first body bytes, and the last body piece (`tail`)
    leaves with the terminating chunk, which aiohttp writes after the handler returned, i.e.
    after the turn was recorded."""

    _send_headers_immediately = False  # aiohttp's own switch; web.Response sets it likewise

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tail = b""

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(self.tail + data)


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class Gateway:
    """The model gateway (see module docstring). Runs on pi-env's background event loop."""

    def __init__(self, *, connect_timeout_s: float = 30.0, read_timeout_s: float = 600.0):
        # read_timeout_s bounds each wait for upstream bytes, headers included: long enough for
        # a slow prefill, short enough that a dead upstream frees the agent.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._sessions: dict[str, GatewaySession] = {}
        self._dir: str | None = None
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None
        self.socket_path = ""
        self.tcp_port = 0
        self.pid = os.getpid()  # the process that serves it

    def __repr__(self) -> str:
        return f"Gateway(socket_path={self.socket_path!r}, tcp_port={self.tcp_port})"

    @property
    def tcp_base_url(self) -> str:
        """OpenAI base URL of the TCP listener: "http://127.0.0.1:PORT/v1"."""
        return f"http://127.0.0.1:{self.tcp_port}{BASE_URL_PATH}"

    # -- sessions (callable from any thread)

    def open_session(
        self,
        upstream: Upstream,
        *,
        mode: str = "black_box",
        max_turns: int | None = None,
        trace_path: str | None = None,
        capture: CaptureOptions | None = None,
        max_total_tokens: int | None = None,
        token_in: TokenInSpec | None = None,
        max_tokens_cap: int | None = None,
        limits: SessionLimits | None = None,
        allow_fields: Iterable[str] = (),
    ) -> GatewaySession:
        """`limits`: the session's body budget, calls in flight and body time limit (None: the
        defaults of policy.SessionLimits); `allow_fields`: policy.RESTRICTED_FIELDS its calls
        may carry."""
        session = GatewaySession(
            upstream,
            mode,
            max_turns,
            trace_path,
            capture,
            max_total_tokens,
            token_in,
            max_tokens_cap,
            limits,
            allow_fields,
        )
        self._sessions[session.token] = session
        return session

    def close_session(self, session: GatewaySession) -> None:
        """Revoke the session's token and close its trace file. Idempotent."""
        self._sessions.pop(session.token, None)
        session.close()

    # -- lifecycle

    def start(self) -> Gateway:
        if self._runner is None:
            self.pid = os.getpid()
            run_sync(self._start(), timeout=30)
        return self

    def close(self) -> None:
        if self._runner is not None and self.pid == os.getpid():  # not a forked copy
            run_sync(self._stop(), timeout=30)
        for session in list(self._sessions.values()):
            self.close_session(session)

    async def _start(self) -> None:
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            cookie_jar=aiohttp.DummyCookieJar(),  # one session serves all: never share cookies
            timeout=self._timeout,
            auto_decompress=False,  # relay bytes exactly as upstream sent them
            skip_auto_headers=("User-Agent",),  # the agent's own User-Agent is relayed
        )
        # Bodies are never read whole by aiohttp (request.read() and its client_max_size), but
        # incrementally within the session's budget: see read_body.
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_route("*", BASE_URL_PATH + "/{rest:.*}", self._handle)
        # handler_cancellation: an agent that hangs up cancels its upstream request at once.
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0, lingering_time=LINGER_S
        )
        await runner.setup()

        # Sandboxed agents run as other uids: the directory is traversable but not listable,
        # the socket world-writable; the per-session token is the authentication.
        # Locked while this process lives, so a process killed before close() leaves a dir
        # that the next gateway sweeps (as sandbox dirs are swept).
        root = tempfile.gettempdir()
        sweep_stale_host_dirs(root, prefix=GATEWAY_DIR_PREFIX)
        self._dir, self._dir_lock = make_owned_dir(root, GATEWAY_DIR_PREFIX)
        self.socket_path = os.path.join(self._dir, "gateway.sock")
        unix_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix_sock.bind(self.socket_path)
        os.chmod(self.socket_path, 0o666)
        tcp_sock = socket.create_server(("127.0.0.1", 0))
        self.tcp_port = tcp_sock.getsockname()[1]
        for sock in (unix_sock, tcp_sock):
            await web.SockSite(runner, sock, backlog=4096).start()
        self._runner = runner

    async def _stop(self) -> None:
        runner, self._runner = self._runner, None
        await runner.cleanup()
        await self._client.close()
        discard_host_dir(self._dir, self._dir_lock)

    # -- request handling (on the loop)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        session = self._sessions.get(bearer_token(request) or "")
        if session is None:
            return json_error(401, "pi-env gateway: unknown or missing session token",
                              "invalid_session_token")  # fmt: skip
        path = upstream_path(request.method, request.raw_path)
        if path is None:
            # The token must not unlock the rest of the upstream API (files, fine-tuning, ...)
            # with the real key, nor reach another host or path through an odd request target.
            return json_error(
                403,
                "pi-env gateway: only POST /v1/chat/completions and GET /v1/models "
                "(exactly, without a query) are relayed",
                "route_not_allowed",
            )
        if not session.open_call():
            limit = session.limits.max_concurrent_calls
            return json_error(
                429,
                f"pi-env gateway: this session already has {limit} calls open, its limit; "
                "wait for one to end before making another",
                "too_many_concurrent_calls",
                headers={"Retry-After": "1"},
            )
        body_bytes = 0
        try:
            if path == "/models":
                # Harmless and sometimes probed; relayed, but not a turn: not recorded.
                untracked = TurnRecord(turn=-1, started_at=time.time())
                return await Call(self, session, request, time.perf_counter(), path).relay(b"", untracked)
            body = await read_body(request, session)
            if isinstance(body, web.Response):
                return body
            body_bytes = len(body)
            return await self._chat_completions(session, request, body)
        finally:
            session.close_call(body_bytes)

    async def _chat_completions(self, session: GatewaySession, request: web.Request, body: bytes) -> web.StreamResponse:
        received, refusal, streamed = len(body), None, None
        try:
            body, allowed, streamed = police_request(
                body,
                cap=session.max_tokens_cap,
                budget_left=session.tokens_left(),
                model=session.upstream.model,
                allow_fields=session.allow_fields,
            )
        except PolicyError as error:
            allowed, body, refusal = 0, None, error
        index = session.claim_turn(reserve=allowed)  # no await since tokens_left(): one step
        if index is None:
            # End the agent's turn cleanly (an empty final answer), so it stops rather than
            # failing; the rollout reads session.budget_exhausted.
            return budget_answer(body or b"", session.budget_exhausted)
        turn = TurnRecord(turn=index, started_at=time.time(), streamed=streamed)
        if refusal is not None:  # a call, but not one to relay: recorded, never sent upstream
            turn.request_bytes = received
            turn.latency_s = 0.0
            session.record(turn)
            return json_error(400, f"pi-env gateway: {refusal}", refusal.error_type)
        if session.max_total_tokens is not None:
            turn.reserved_tokens = allowed or 0
        started = time.perf_counter()
        call = Call(self, session, request, started)
        try:
            turn.request_bytes = len(body)
            return await session.strategy.chat_completions(call, body, turn)
        except asyncio.CancelledError:
            turn.client_disconnected = True  # handler cancelled: the agent hung up
            raise
        finally:
            if turn.latency_s is None:
                turn.latency_s = time.perf_counter() - started
            if call.finishing is None:
                session.record(turn)
            else:  # the strategy finishes the record after the agent has its answer
                call.finishing.add_done_callback(lambda _: session.record(turn))


async def read_body(request: web.Request, session: GatewaySession) -> bytes | web.Response:
    """The request body, read as it arrives and charged to the session's byte budget (shared by
    its calls in flight), or the refusal the agent gets instead: 413 when the body (announced
    or received) is larger than the whole budget, 429 when it would fit but the session's other
    calls hold the rest, 408 when it is not all in within limits.body_timeout_s, 400 when it is
    malformed. A body's bytes stay charged until its call ends (the handler's close_call); a
    refused one's are released here."""
    limits = session.limits
    budget = limits.max_request_bytes
    declared = request.content_length
    if declared is not None and declared > budget:
        return _body_too_large(f"announces {declared} bytes (Content-Length)", budget)
    held, received, chunks, body = 0, 0, [], None
    try:
        if declared:  # all of it, before reading any
            if not session.hold_body_bytes(declared):
                return _budget_in_use(session, declared)
            held = declared
        async with asyncio.timeout(limits.body_timeout_s):
            while chunk := await request.content.readany():
                received += len(chunk)
                if received > held:  # chunked, or decompressed beyond what was announced
                    if received > budget:
                        return _body_too_large(f"holds more than {budget} bytes", budget)
                    if not session.hold_body_bytes(received - held):
                        return _budget_in_use(session, received)
                    held = received
                chunks.append(chunk)
        body = b"".join(chunks)
        return body
    except TimeoutError:
        return json_error(
            408,
            f"pi-env gateway: the request body was not all received within "
            f"{limits.body_timeout_s:g} s ({received} bytes arrived); send it at once",
            "request_body_timeout",
        )
    except (HttpProcessingError, OSError) as exc:
        return json_error(
            400, f"pi-env gateway: the request body could not be read: {describe(exc)}", "invalid_request"
        )
    finally:  # keep the charge for what is returned, no more
        session.body_bytes_held -= held - (len(body) if body is not None else 0)


def _body_too_large(what: str, budget: int) -> web.Response:
    return json_error(
        413,
        f"pi-env gateway: the request body {what}; a session's calls in flight may hold "
        f"{budget} bytes of request bodies together (PiConfig.gateway_max_request_bytes)",
        "request_too_large",
    )


def _budget_in_use(session: GatewaySession, size: int) -> web.Response:
    return json_error(
        429,
        f"pi-env gateway: this body ({size} bytes so far) does not fit in what the session's "
        f"other calls in flight leave of its {session.limits.max_request_bytes} bytes of request "
        "bodies; retry when one has ended",
        "request_budget_in_use",
        headers={"Retry-After": "1"},
    )


class Call:
    """One agent call in flight: how a strategy talks to the upstream and answers the agent."""

    def __init__(
        self,
        gateway: Gateway,
        session: GatewaySession,
        request: web.Request,
        started: float,
        path: str = "/chat/completions",
    ):
        self.gateway, self.session, self.request, self.started = gateway, session, request, started
        self.path = path  # on the upstream, after its base URL (see policy.ALLOWED_ROUTES)
        self.finishing: asyncio.Task | None = None  # see finish_record_later

    def finish_record_later(self, work: Awaitable[None]) -> None:
        """Complete the turn's record in a task of its own, after the handler returned: work done
        once the agent has its whole answer must neither delay the agent nor be cut short when
        the agent then closes its connection (which cancels the handler). The turn is recorded
        when `work` ends; GatewaySession.wait_idle() waits for it."""
        self.finishing = asyncio.ensure_future(work)

    async def relay(self, body: bytes, turn: TurnRecord, *, keep: bytearray | None = None) -> web.StreamResponse:
        """Forward the body upstream and stream the answer back as it arrives."""
        answer = await self.open(body, turn)
        if isinstance(answer, web.Response):
            return answer
        if answer.status >= 400:  # read whole (bounded) so that secrets echoed in it are masked
            error = await self.read_error(answer, turn)
            return web.Response(status=answer.status, body=error, headers=self.agent_headers(answer))
        return await self.stream(answer, turn, keep=keep)

    def agent_headers(self, answer: aiohttp.ClientResponse) -> CIMultiDict:
        """The upstream's answer headers for the agent, minus any that carry a secret."""
        headers = agent_response_headers(answer.headers)
        for name in [k for k, v in headers.items() if any(s.decode() in v for s in self.session.secrets)]:
            headers.popall(name, None)
        return headers

    async def open(self, body: bytes, turn: TurnRecord) -> aiohttp.ClientResponse | web.Response:
        """Send the request upstream; a 502 answer for the agent when the upstream is unreachable."""
        request, upstream = self.request, self.session.upstream
        url = URL(upstream.base_url.rstrip("/") + self.path)
        headers = upstream_request_headers(request.headers, upstream)
        try:
            timeout = upstream.timeout() or self.gateway._timeout
            return await self.gateway._client.request(request.method, url, data=body, headers=headers,
                                                       allow_redirects=False, timeout=timeout)  # fmt: skip
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            turn.upstream_error = f"upstream {upstream.host} unreachable: {describe(exc)}"
            return json_error(502, f"pi-env gateway: {turn.upstream_error}", "upstream_unreachable")

    async def read_error(self, answer: aiohttp.ClientResponse, turn: TurnRecord) -> bytes:
        """Read a non-2xx answer's body (bounded), masking the upstream's secrets, and record it."""
        try:
            body = await answer.content.readexactly(ERROR_RELAY_LIMIT)
        except asyncio.IncompleteReadError as short:
            body = short.partial
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            body = f"(error body unreadable: {describe(exc)})".encode()
        finally:
            answer.close()
        body = scrub(body, self.session.secrets)
        turn.upstream_status = answer.status
        turn.upstream_error = body[:ERROR_BODY_LIMIT].decode(errors="replace") or f"HTTP {answer.status} (empty body)"
        return body

    async def stream(
        self, answer: aiohttp.ClientResponse, turn: TurnRecord, *, keep: bytearray | None = None, finish: bool = False
    ) -> web.StreamResponse:
        """Stream the answer back per upstream read, filling `turn`; `keep` collects the raw
        bytes; `finish` ends the agent's response here rather than after the handler returns
        (so work done afterwards does not delay the agent)."""
        request, started = self.request, self.started
        response = RelayedResponse(status=answer.status, reason=answer.reason, headers=self.agent_headers(answer))
        completed = False
        response_bytes = 0
        error_body = bytearray() if answer.status >= 400 else None
        try:
            await response.prepare(request)
            content = answer.content
            upstream = answer.connection.transport if answer.connection is not None else None
            loop, last_read = asyncio.get_running_loop(), -1.0
            while chunk := await content.readany():
                if not response_bytes:
                    turn.ttfb_s = time.perf_counter() - started
                response_bytes += len(chunk)
                if keep is not None:
                    keep += chunk
                if error_body is not None and len(error_body) < ERROR_BODY_LIMIT:
                    error_body += chunk[: ERROR_BODY_LIMIT - len(error_body)]
                # at_eof, not is_eof: a relay that fell behind sees the upstream's end while
                # bytes are still buffered, and those must reach the agent too.
                if content.at_eof():
                    response.tail = chunk  # goes out with the terminating chunk
                    break
                await response.write(chunk)
                now = loop.time()
                if now - last_read < RELAY_BATCH_S and upstream is not None and upstream.is_reading():
                    upstream.pause_reading()
                    try:
                        await asyncio.sleep(RELAY_BATCH_S)
                    finally:
                        if not upstream.is_closing():
                            upstream.resume_reading()
                last_read = now
            completed = True
            if finish:
                await response.write_eof()
            return response
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if request.transport is None or request.transport.is_closing():
                turn.client_disconnected = True
            else:
                turn.upstream_error = f"upstream stream broken: {describe(exc)}"
                # Close without the final chunk: the agent must see a failed answer, not a
                # cleanly truncated one.
                request.transport.close()
            return response
        finally:
            if completed:
                answer.release()
            else:  # never pool a connection with an unread answer on it
                answer.close()
            turn.upstream_status = answer.status
            turn.response_bytes = response_bytes
            turn.latency_s = time.perf_counter() - started
            if error_body is not None and not turn.upstream_error:
                text = scrub(bytes(error_body), self.session.secrets).decode(errors="replace")
                turn.upstream_error = text or f"HTTP {answer.status} (empty body)"


def budget_answer(body: bytes, reason: str) -> web.Response:
    """A clean, empty final answer (finish_reason "stop"), streamed if the agent asked for a
    stream, marked as the gateway's own in `system_fingerprint`."""
    try:
        request = msgspec.json.decode(body)
        streaming = isinstance(request, dict) and request.get("stream") is True
    except msgspec.DecodeError:
        streaming = False
    envelope = {
        "id": f"pi-env-budget-{secrets.token_hex(6)}",
        "created": int(time.time()),
        "model": "pi-env-gateway",
        "system_fingerprint": f"pi-env-budget:{reason}",
    }
    headers = {"x-pi-env-budget": reason}
    if not streaming:
        choice = {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}
        return web.json_response({**envelope, "object": "chat.completion", "choices": [choice]}, headers=headers)
    chunks = [
        {
            **envelope,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
        {
            **envelope,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        },
    ]
    sse = b"".join(b"data: " + msgspec.json.encode(chunk) + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"
    return web.Response(body=sse, content_type="text/event-stream", headers=headers)


_gateway: Gateway | None = None
_gateway_lock = threading.Lock()


def get_gateway() -> Gateway:
    """The process-wide gateway, started on first use and closed at interpreter exit. A forked
    child gets a gateway of its own: the parent's serving thread does not survive the fork."""
    global _gateway
    with _gateway_lock:
        if _gateway is None or _gateway.pid != os.getpid():
            _gateway = Gateway().start()
            atexit.register(_gateway.close)
        return _gateway
