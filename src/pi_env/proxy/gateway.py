"""The host-side model gateway: the only way a sandboxed agent reaches a model. This module is
the dispatcher: the server, the sessions, and which strategy answers a session's calls.

One `Gateway` per process listens on a Unix socket (bind-mounted into sandboxes, which have no
network) and on 127.0.0.1 TCP (unsandboxed use, benchmarks). Each rollout opens a
`GatewaySession`; the agent authenticates with the session's random token, and the gateway
relays its calls to the session's `Upstream` with the real API key, which never enters the
sandbox. Per chat/completions call it records a `TurnRecord`, enforces the budgets
(`max_turns`, `max_total_tokens`: past them, a clean empty answer ends the agent's turn) and,
if asked, appends the record to a JSONL trace file as soon as the turn ends.

Before any mode sees a call, the gateway applies the rules of policy.py to it, the same in
every mode: the exact routes, the session's limits (request bodies read incrementally within
its byte budget and time limit, a cap on its calls in flight), the allow-list of headers
relayed upstream, and the body rules (the session's model, one choice, capped token limits,
`stream` a boolean, no engine extra the config did not allow). What a session then does with
a chat/completions call is its mode's `Strategy` (STRATEGIES): black_box.py, transparent.py
(token_in.py when the gateway renders), gate.py. They build on the leaf modules records.py
(what is recorded), wire.py (`Call`: the streaming relay, and the HTTP helpers) and
assembly.py (an answer parsed into its capture); this module imports them, never the reverse.
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
from collections.abc import Callable, Iterable
from typing import IO, Any

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pi_env._aio import run_sync
from pi_env.proxy.black_box import BlackBox
from pi_env.proxy.dialects import match_route
from pi_env.proxy.dialects.base import AnswerStream, Dialect, DialectCall, DialectError, Route, chat_error_message
from pi_env.proxy.policy import (
    PolicyError,
    SessionLimits,
    check_allow_fields,
    police_request,
    secrets_of,
    upstream_path,
)
from pi_env.proxy.records import PolicyVersion, Routing, SessionStop, TokenInSpec, TurnRecord, Upstream
from pi_env.proxy.replicas import Replica, ReplicaSet
from pi_env.proxy.rewrite import CaptureOptions
from pi_env.proxy.wire import Call, Strategy, describe, json_error
from pi_env.sandbox.hostdir import discard_host_dir, make_owned_dir, sweep_stale_host_dirs

log = logging.getLogger(__name__)

BASE_URL_PATH = "/v1"
GEMINI_BASE_PATH = "/v1beta"
GATEWAY_DIR_PREFIX = "pi-env-gateway-"  # <tmp>/pi-env-gateway-<id>/: the Unix socket's dir
# A refused call's unread body is drained (read and discarded, never kept) this long so the
# agent can read its error, then the connection is closed (aiohttp's default: 10 s).
LINGER_S = 2.0


def _transparent_proxy(session: GatewaySession) -> Strategy:
    if session.token_in is not None:  # the gateway renders: ids in, ids out (proxy/token_in.py)
        from pi_env.proxy.token_in import TokenIn  # loaded only when a session uses it

        return TokenIn(session, session.token_in)
    from pi_env.proxy.transparent import TransparentProxy  # loaded only when a session uses it

    return TransparentProxy(session)


def _interception_gate(session: GatewaySession) -> Strategy:
    from pi_env.proxy.gate import InterceptionGate  # loaded only when a session uses it

    return InterceptionGate(session)


_REWRITES_BODIES = frozenset({"transparent_proxy"})  # the modes that may put a cache_salt in
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
        gate_timeout_s: float | None = None,
        policy: PolicyVersion | None = None,
        routing: Routing | None = None,
    ):
        if mode not in STRATEGIES:
            raise ValueError(f"unknown gateway mode {mode!r}; supported: {sorted(STRATEGIES)}")
        # The session's id, sent upstream in routing.session_header: random and apart from the
        # token (the secret the agent authenticates with), stable for the session.
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
        self.gate_timeout_s = gate_timeout_s  # interception_gate: a held call's deadline (None: gate's default)
        self.policy = policy or PolicyVersion()  # the version in force: shared with whoever sets it
        self.routing = routing or Routing()
        if self.routing.cache_salt and mode not in _REWRITES_BODIES:
            raise ValueError(
                f"cache_salt goes into request bodies, which a {mode} session relays as the agent "
                "sent them (or, interception_gate, never sends to an engine): use transparent_proxy"
            )
        # Several base URLs (proxy/replicas.py): the set the gateway shares between the sessions
        # of that endpoint (open_session sets it), and the replica this session sticks to.
        self.replicas: ReplicaSet | None = None
        self.replica: Replica | None = None
        self.closed = False
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
        self._trace: IO[bytes] | None = None
        if trace_path:  # turns hold prompts and answers: for this user only (0700 dir, 0600 file)
            os.makedirs(os.path.dirname(os.path.abspath(trace_path)), mode=0o700, exist_ok=True)
            fd = os.open(trace_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self._trace = os.fdopen(fd, "ab")

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
                self._trace.write(msgspec.json.encode(turn.to_json()) + b"\n")  # UTF-8 JSON as it is
                self._trace.flush()
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()
        if self.on_record is not None:
            try:
                self.on_record(turn)
            except Exception:
                log.exception("on_record listener failed for turn %s", turn.turn)

    @property
    def policy_version(self) -> Any:
        """The policy version in force: what the next call sent upstream records."""
        return self.policy.value

    def set_policy_version(self, version: Any) -> None:
        """Set the version for calls sent from now on (a JSON scalar). The holder is shared with
        whoever opened the session with it: a factory's sessions all follow its version."""
        self.policy.set(version)

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

    def stopped(self) -> SessionStop | None:
        """Why the session's strategy answers every call with a stop (interception_gate: a held
        call was never delivered); None while it answers them."""
        return self.strategy.stopped()

    def replica_health(self) -> list[dict[str, Any]] | None:
        """The health of this session's endpoint's replicas (shared with every session on it);
        None for an endpoint of one base URL."""
        return self.replicas.health() if self.replicas is not None else None

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.leave(self)
        self.closed = True
        self.strategy.close()  # interception_gate: answer every held call
        with self._trace_lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None


# Where each dialect's SDK puts its key: the session token arrives in whichever the agent uses.
KEY_HEADERS = ("x-api-key", "x-goog-api-key")


def bearer_token(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    if value[:7].lower() == "bearer ":
        return value[7:].strip()
    for name in KEY_HEADERS:
        if name in request.headers:
            return request.headers[name].strip()
    return None


class Gateway:
    """The model gateway (see module docstring). Runs on pi-env's background event loop."""

    def __init__(self, *, connect_timeout_s: float = 30.0, read_timeout_s: float = 600.0):
        # read_timeout_s bounds each wait for upstream bytes, headers included: long enough for
        # a slow prefill, short enough that a dead upstream frees the agent.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._sessions: dict[str, GatewaySession] = {}
        self._replica_sets: dict[tuple[str, ...], ReplicaSet] = {}  # several base URLs -> their shared state
        self._replica_lock = threading.Lock()
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
        gate_timeout_s: float | None = None,
        policy: PolicyVersion | None = None,
        routing: Routing | None = None,
    ) -> GatewaySession:
        """`limits`: the session's body budget, calls in flight and body time limit (None: the
        defaults of policy.SessionLimits); `allow_fields`: policy.RESTRICTED_FIELDS its calls
        may carry; `gate_timeout_s`: interception_gate's deadline for a held call (None: the
        gate's default); `policy`: the policy version holder the session reads at each call
        (None: its own, at None; share one to set the version of many sessions at once);
        `routing`: its session id header, cache salt and engine version header (None: the
        defaults of records.Routing)."""
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
            gate_timeout_s,
            policy,
            routing,
        )
        if len(upstream.base_urls) > 1:  # several replicas: one shared state per list of URLs
            with self._replica_lock:
                session.replicas = self._replica_sets.setdefault(upstream.base_urls, ReplicaSet(upstream.base_urls))
        self._sessions[session.token] = session
        return session

    def close_session(self, session: GatewaySession) -> None:
        """Revoke the session's token and close its trace file. Idempotent."""
        self._sessions.pop(session.token, None)
        session.close()

    def replica_health(self) -> list[dict[str, Any]]:
        """Every endpoint of several base URLs this gateway has served, each replica's health
        (host:port only, never credentials): what /endpoints shows."""
        with self._replica_lock:
            sets = list(self._replica_sets.values())
        return [{"replicas": replicas.health()} for replicas in sets]

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
        app.router.add_route("*", GEMINI_BASE_PATH + "/{rest:.*}", self._handle)  # Gemini's dialect
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
        if runner is None:  # two close() calls from two threads: the other one stopped it
            return
        assert self._client is not None and self._dir is not None  # _start set both before the runner
        await runner.cleanup()
        await self._client.close()
        discard_host_dir(self._dir, self._dir_lock)

    # -- request handling (on the loop)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = upstream_path(request.method, request.raw_path)
        dialect = None
        if path is None and (dialect := match_route(request.method, request.raw_path)) is not None:
            path = "/chat/completions"
        session = self._sessions.get(bearer_token(request) or "")
        if session is None:
            return in_dialect(json_error(401, "pi-env gateway: unknown or missing session token",
                                         "invalid_session_token"), dialect)  # fmt: skip
        if path is None:
            # The token must not unlock the rest of the upstream API (files, fine-tuning, ...)
            # with the real key, nor reach another host or path through an odd request target.
            return json_error(
                403,
                "pi-env gateway: only POST /v1/chat/completions, GET /v1/models (exactly, without a "
                "query) and the dialects' model calls (POST /v1/responses, POST /v1/messages, POST "
                "/v1beta/models/{model}:generateContent or :streamGenerateContent) are relayed",
                "route_not_allowed",
            )
        if not session.open_call():
            limit = session.limits.max_concurrent_calls
            busy = json_error(
                429,
                f"pi-env gateway: this session already has {limit} calls open, its limit; "
                "wait for one to end before making another",
                "too_many_concurrent_calls",
                headers={"Retry-After": "1"},
            )
            return in_dialect(busy, dialect)
        body_bytes = 0
        try:
            if path == "/models":
                # Harmless and sometimes probed; relayed, but not a turn: not recorded.
                untracked = TurnRecord(turn=-1, started_at=time.time())
                assert self._client is not None  # handlers run only after _start
                listing = Call(self._client, self._timeout, session, request, time.perf_counter(), path)
                try:
                    return await listing.relay(b"", untracked)
                finally:
                    listing.done()
            body = await read_body(request, session)
            if isinstance(body, web.Response):
                return in_dialect(body, dialect)
            body_bytes = len(body)
            if dialect is None:
                return await self._chat_completions(session, request, body)
            return await self._dialect_call(session, request, body, *dialect)
        finally:
            session.close_call(body_bytes)

    async def _dialect_call(
        self, session: GatewaySession, request: web.Request, body: bytes, dialect: Dialect, route: Route
    ) -> web.StreamResponse:
        """A call in another API's shape (proxy/dialects): made the Chat Completions call every
        mode handles, then answered in the agent's shape (what the strategy streams is
        translated as it leaves; a whole answer or an error here)."""
        error = None
        try:
            request_json = msgspec.json.decode(body)
            if not isinstance(request_json, dict):
                raise DialectError(400, "pi-env gateway: the request body is not a JSON object")
            call = dialect.to_chat(request_json, route)
            call.notes += dialect.header_notes(request.headers)
        except msgspec.DecodeError:
            call = None
            error = DialectError(400, "pi-env gateway: the request body is not JSON")
        except DialectError as refused:
            call, error = None, refused
        if call is None:
            assert error is not None
            return web.Response(
                status=error.status, body=dialect.error_body(error.status, error.message, error.kind),
                content_type="application/json",
            )  # fmt: skip
        answer = await self._chat_completions(session, request, msgspec.json.encode(call.chat), (dialect, call))
        if answer.prepared:  # streamed through a DialectResponse: translated already
            return answer
        assert isinstance(answer, web.Response)  # what strategies return unstreamed
        translation = AnswerStream(dialect, call, answer.status, answer.content_type)
        return web.Response(
            status=answer.status, body=translation.finish(bytes(answer.body or b"")),  # type: ignore[arg-type]
            content_type=translation.content_type, headers=_kept_headers(answer),
        )  # fmt: skip

    async def _chat_completions(
        self,
        session: GatewaySession,
        request: web.Request,
        body: bytes,
        dialect: tuple[Dialect, DialectCall] | None = None,
    ) -> web.StreamResponse:
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
            allowed, body, refusal = 0, b"", error
        index = session.claim_turn(reserve=allowed)  # no await since tokens_left(): one step
        if index is None:
            # End the agent's turn cleanly (an empty final answer), so it stops rather than
            # failing; the rollout reads session.budget_exhausted.
            assert session.budget_exhausted is not None  # claim_turn returns None only once it is set
            return budget_answer(body or b"", session.budget_exhausted)
        turn = TurnRecord(turn=index, started_at=time.time(), streamed=streamed)
        if dialect is not None:
            turn.dialect, turn.dialect_notes = dialect[1].dialect, dialect[1].notes or None
        if refusal is not None:  # a call, but not one to relay: recorded, never sent upstream
            turn.request_bytes = received
            turn.latency_s = 0.0
            session.record(turn)
            return json_error(400, f"pi-env gateway: {refusal}", refusal.error_type)
        if session.max_total_tokens is not None:
            turn.reserved_tokens = allowed or 0
        started = time.perf_counter()
        assert self._client is not None  # handlers run only after _start
        call = Call(self._client, self._timeout, session, request, started, dialect=dialect)
        try:
            turn.request_bytes = len(body)
            return await session.strategy.chat_completions(call, body, turn)
        except asyncio.CancelledError:
            turn.client_disconnected = True  # handler cancelled: the agent hung up
            raise
        finally:
            call.done()
            if turn.latency_s is None:
                turn.latency_s = time.perf_counter() - started
            if call.finishing is None:
                session.record(turn)
            else:  # the strategy finishes the record after the agent has its answer
                call.finishing.add_done_callback(lambda _: session.record(turn))


def in_dialect(refusal: web.Response, dialect: tuple[Dialect, Route] | None) -> web.Response:
    """The gateway's own refusal (json_error's shape) in the agent's dialect, when it speaks one."""
    if dialect is None:
        return refusal
    message, kind = chat_error_message(bytes(refusal.body))  # type: ignore[arg-type]
    body = dialect[0].error_body(refusal.status, message, kind)
    kept = {k: v for k, v in refusal.headers.items() if k.lower() == "retry-after"}
    return web.Response(status=refusal.status, body=body, content_type="application/json", headers=kept)


def _kept_headers(answer: web.Response) -> dict[str, str]:
    """Headers of a translated whole answer: the gateway's own markers (budget), never framing."""
    return {k: v for k, v in answer.headers.items() if k.lower().startswith("x-")}


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
        f"{budget} bytes of request bodies together (PiConfig.gateway.max_request_bytes)",
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


def replica_health() -> list[dict[str, Any]]:
    """`Gateway.replica_health()` of this process's gateway, without starting one."""
    with _gateway_lock:
        gateway = _gateway if _gateway is not None and _gateway.pid == os.getpid() else None
    return gateway.replica_health() if gateway is not None else []


def get_gateway() -> Gateway:
    """The process-wide gateway, started on first use and closed at interpreter exit. A forked
    child gets a gateway of its own: the parent's serving thread does not survive the fork."""
    global _gateway
    with _gateway_lock:
        if _gateway is None or _gateway.pid != os.getpid():
            _gateway = Gateway().start()
            atexit.register(_gateway.close)
        return _gateway
