"""What every strategy shares to answer the agent: one call in flight (`Call`: open the
upstream request, relay its answer per read, read an error body) and the small HTTP helpers
around it, plus what a strategy is (`Strategy`) and what it may use of its session
(`StrategySession`). It imports none of the gateway's other modules but records.py,
policy.py (the header allow-list, secrets masked) and dialects/base.py (an answer translated
for an agent of another dialect): the strategies (black_box.py,
transparent.py, token_in.py, gate.py) build on it, and the dispatcher (gateway.py) on them.

Hot path: the answer is relayed per upstream read (never per SSE line, never buffered whole),
through the gateway's one pooled aiohttp client session; pieces of a fast stream are gathered
for a short window (`relay_window`) so that one read and one send carry many tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from pi_env._urls import without_userinfo
from pi_env.errors import EndpointFailure
from pi_env.proxy.dialects.base import AnswerStream, Dialect, DialectCall
from pi_env.proxy.policy import relayed_request_headers, scrub
from pi_env.proxy.records import (
    PolicyVersion,
    Routing,
    SessionStop,
    TokenInSpec,
    TurnRecord,
    Upstream,
    cache_salt,
    engine_version,
)
from pi_env.proxy.replicas import (
    FAILOVER_STATUSES,
    Replica,
    ReplicaSet,
    failure_kind,
    retry_after,
)
from pi_env.proxy.rewrite import CaptureOptions

ERROR_BODY_LIMIT = 4096  # bytes of an upstream error body kept in the TurnRecord
ERROR_RELAY_LIMIT = 1 << 20  # bytes of it relayed to the agent (read whole, to mask secrets)
# Pieces of an answer that arrive less than a window apart are relayed together: the upstream's
# socket is left unread for that long, so one read and one send carry what a fast stream sent
# meanwhile. The window is RELAY_BATCH_S, and grows to RELAY_BATCH_SHARE of the time the answer
# has streamed so far, at most RELAY_BATCH_MAX_S: waking once a token costs a Python process
# 40-90 us on a VM, so a paced stream (an engine at ~1,000 tokens/s) cost the gateway that much a
# token, while a pause adds at most that share to an answer's duration. The first piece never waits.
RELAY_BATCH_S = 0.001
RELAY_BATCH_SHARE = 0.02
RELAY_BATCH_MAX_S = 0.02
# After a pause, the next read takes what came meanwhile; pieces that keep coming within a window
# of it mean the stream still flows. A pause that gathered less than this is followed by another
# (a paced stream: reading at once would catch the next token alone, a wake-up for one token);
# one that gathered more is not, so a fast engine never finds the socket buffers full (loopback
# and TCP both start at 128 KB).
RELAY_REPAUSE_MAX_BYTES = 32 << 10


def relay_window(streamed_s: float) -> float:
    """How long pieces are gathered once an answer has streamed for `streamed_s` seconds."""
    return min(RELAY_BATCH_MAX_S, max(RELAY_BATCH_S, RELAY_BATCH_SHARE * streamed_s))


# aiohttp's StreamReader keeps an answer as one buffer item per HTTP chunk (an engine sends one a
# token), and readany() pops them one by one, running its flow control for each pop: ~2-3 us a
# token on the gateway's loop (bench/proxy_overhead.py). read_buffered() takes what is buffered
# in one join, through the reader internals it was measured against; any other reader (another
# aiohttp) gets readany(), and tests/test_gateway.py fails if the installed aiohttp loses the
# fast path.
_DRAINABLE = {"_buffer", "_buffer_offset", "_size", "_cursor", "_http_chunk_splits", "_protocol", "_eof",
              "_exception", "_timer"} <= set(getattr(aiohttp.StreamReader, "__slots__", ())) and callable(
    getattr(aiohttp.StreamReader, "_wait", None))  # fmt: skip


async def read_buffered(content: aiohttp.StreamReader) -> bytes:
    """The answer's next bytes: at least one, everything the reader holds, in one piece; b"" at
    its end. What readany() returns, without its per-chunk cost (see _DRAINABLE)."""
    if not _DRAINABLE or type(content) is not aiohttp.StreamReader:
        return await content.readany()
    if content._exception is not None:
        raise content._exception
    while not content._buffer and not content._eof:
        await content._wait("readany")
    buffer = content._buffer
    if len(buffer) < 2 or content._buffer_offset:
        return content.read_nowait(-1)
    content._timer.assert_timeout()
    data = b"".join(buffer)
    buffer.clear()
    content._size -= len(data)
    content._cursor += len(data)
    if content._http_chunk_splits:  # chunk ends already read (readchunk() drops them the same way)
        content._http_chunk_splits.clear()
    content._protocol.resume_reading()  # as readany() does once the buffer is below its low water
    return data


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


class StrategySession(Protocol):
    """What a strategy (and its `Call`s) may use of the session it serves: gateway.py's
    `GatewaySession` is the one implementation."""

    id: str
    upstream: Upstream
    secrets: tuple[bytes, ...]  # masked in all the gateway relays
    capture_options: CaptureOptions
    token_in: TokenInSpec | None  # the renderer, when the gateway renders
    gate_timeout_s: float | None  # interception_gate: how long a held call waits (None: its default)
    policy: PolicyVersion  # the policy version in force (shared with whoever sets it)
    routing: Routing  # the session id header, the cache salt, the engine's version header
    replicas: ReplicaSet | None  # several base URLs (replicas.py); None: upstream.base_url alone
    replica: Replica | None  # the replica the session sticks to (None: before its first call)
    closed: bool

    def set_waiting(self, waiting: bool) -> None: ...


class Strategy(Protocol):
    """How a session answers the agent's chat/completions calls (one per mode). A strategy
    subclasses it to inherit `stopped` and `close`, which only interception_gate overrides."""

    def __init__(self, session: StrategySession) -> None: ...

    async def chat_completions(self, call: Call, body: bytes, turn: TurnRecord) -> web.StreamResponse: ...

    def stopped(self) -> SessionStop | None:
        """Why every call is now answered with a stop; None while calls are answered."""
        return None

    def close(self) -> None:
        """The session closed: release what the strategy holds."""
        return None  # a body, so mypy does not take it for abstract (subclasses inherit it)


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


class DialectResponse(RelayedResponse):
    """A streamed answer for an agent that speaks another dialect (proxy/dialects): what the
    strategy writes in Chat Completions leaves translated (`AnswerStream`), with the dialect's
    content type; a whole answer or an error is translated at its end."""

    def __init__(self, translation: AnswerStream, **kwargs):
        super().__init__(**kwargs)
        self.translation = translation
        self.headers.popall("Content-Length", None)
        self.content_type = translation.content_type

    async def write(self, data) -> None:
        translated = self.translation.feed(bytes(data))
        if translated:
            await super().write(translated)

    async def write_eof(self, data: bytes = b"") -> None:
        tail, self.tail = self.tail, b""
        await web.StreamResponse.write_eof(self, self.translation.finish(tail + data))


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class ReplicasFailed(EndpointFailure, aiohttp.ClientError):
    """Every replica of the session's endpoint failed a call before answering it."""

    def __init__(self, failures: list[str]):
        super().__init__(f"every replica failed before answering ({'; '.join(failures)})")


class Call:
    """One agent call in flight: how a strategy talks to the upstream and answers the agent."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        timeout: aiohttp.ClientTimeout,
        session: StrategySession,
        request: web.Request,
        started: float,
        path: str = "/chat/completions",
        dialect: tuple[Dialect, DialectCall] | None = None,
    ):
        # The gateway's pooled client and its default timeout (an Upstream's own one wins).
        self.client, self.timeout = client, timeout
        self.session, self.request, self.started = session, request, started
        self.path = path  # on the upstream, after its base URL (see policy.ALLOWED_ROUTES)
        self.finishing: asyncio.Task | None = None  # see finish_record_later
        self.replica: Replica | None = None  # the replica this call was last sent to (several URLs)
        self.dialect = dialect  # the agent's own API shape, when not Chat Completions (proxy/dialects)

    def stream_response(self, status: int, headers, reason: str | None = None) -> RelayedResponse:
        """The response a strategy streams its answer to the agent through (in Chat Completions;
        translated on the way out when the agent speaks another dialect)."""
        if self.dialect is None:
            return RelayedResponse(status=status, reason=reason, headers=headers)
        dialect, call = self.dialect
        content_type = CIMultiDict(headers).get("Content-Type")
        translation = AnswerStream(dialect, call, status, content_type)
        return DialectResponse(translation, status=status, reason=reason, headers=headers)

    def finish_record_later(self, work: Awaitable[None]) -> None:
        """Complete the turn's record in a task of its own, after the handler returned: work done
        once the agent has its whole answer must neither delay the agent nor be cut short when
        the agent then closes its connection (which cancels the handler). The turn is recorded
        when `work` ends; GatewaySession.wait_idle() waits for it."""
        self.finishing = asyncio.ensure_future(work)

    async def relay(self, body: bytes, turn: TurnRecord, *, keep: list[bytes] | None = None) -> web.StreamResponse:
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

    def upstream_headers(self, turn: TurnRecord, body: dict | None = None) -> CIMultiDict:
        """The headers of a request about to leave for the upstream (call it just before sending,
        with no await in between): the agent's allowed ones, the gateway's own, and the session's
        id header. Stamps `turn` with the policy version in force now (each send stamps anew,
        so a resent call records the version of the send that answered) and, when the session
        salts, puts that version's `cache_salt` into `body`, in place."""
        session = self.session
        headers = upstream_request_headers(self.request.headers, session.upstream)
        routing = session.routing
        if routing.session_header is not None:
            headers[routing.session_header] = session.id  # replaces any value the agent sent
        turn.policy_version, turn.policy_version_source = session.policy.value, "gateway"
        if body is not None and routing.cache_salt:
            body["cache_salt"] = cache_salt(turn.policy_version)
        return headers

    def engine_reported(self, answer: aiohttp.ClientResponse, turn: TurnRecord) -> None:
        """The version a served engine reported in its answer's headers wins over the one in
        force when the call was sent: the engine knows which weights answered."""
        name = self.session.routing.version_header
        value = answer.headers.get(name) if name is not None else None
        if value is not None and value.strip():
            turn.policy_version, turn.policy_version_source = engine_version(value.strip()), "engine"

    async def open(self, body: bytes | dict, turn: TurnRecord) -> aiohttp.ClientResponse | web.Response:
        """Send the request upstream (a dict: JSON-encoded once the session's cache salt is in
        it); a 502 answer for the agent when the upstream is unreachable."""
        headers = self.upstream_headers(turn, body if isinstance(body, dict) else None)
        data = msgspec.json.encode(body) if isinstance(body, dict) else body
        try:
            answer = await self.send(self.request.method, self.path, data, headers, turn)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            turn.upstream_error = self.unreachable(exc)
            return json_error(502, f"pi-env gateway: {turn.upstream_error}", "upstream_unreachable")
        self.engine_reported(answer, turn)
        return answer

    async def send(
        self, method: str, path: str, data: bytes, headers: CIMultiDict, turn: TurnRecord
    ) -> aiohttp.ClientResponse:
        """The upstream's answer to one request (`path` after the base URL), as it begins; raises
        what aiohttp raised when there is none. With several replicas (replicas.py), the
        session's own replica first; one that fails before answering (no answer, or a
        FAILOVER_STATUSES status while another is left) gets the same bytes re-sent to another,
        and the session moves there. `turn` records the replica that answered."""
        upstream, replicas = self.session.upstream, self.session.replicas
        timeout = upstream.timeout() or self.timeout
        if replicas is None:
            turn.replica = upstream.host
            url = URL(upstream.base_url.rstrip("/") + path)
            return await self.client.request(method, url, data=data, headers=headers,
                                             allow_redirects=False, timeout=timeout)  # fmt: skip
        session, previous = self.session, self.session.replica
        tried: set[int] = set()
        failures: list[str] = []
        while (replica := replicas.route(session.replica, tried)) is not None:
            tried.add(replica.index)
            if replica is not session.replica:
                replicas.stick(session, replica)
            turn.replica = replica.host
            # Flagged when another replica answers than the one the session was on: this call
            # (or an earlier send of it) failed there, or that one is in back-off.
            turn.failed_over |= len(tried) > 1 or (previous is not None and replica is not previous)
            self.done()
            replicas.begin(replica)
            self.replica = replica
            url = URL(replica.base_url.rstrip("/") + path)
            try:
                answer = await self.client.request(method, url, data=data, headers=headers,
                                                   allow_redirects=False, timeout=timeout)  # fmt: skip
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                kind = failure_kind(exc)
                replicas.failed(replica, kind)
                failures.append(f"{replica.host}: {kind}")
                continue
            if answer.status not in FAILOVER_STATUSES:
                replicas.answered(replica)
                return answer
            replicas.failed(replica, f"http_{answer.status}", retry_after(answer.headers.get("Retry-After")))
            if len(tried) == len(replicas.replicas):
                return answer  # the last one's refusal is the agent's answer, as with one URL
            failures.append(f"{replica.host}: http_{answer.status}")
            answer.close()
        raise ReplicasFailed(failures)

    def unreachable(self, exc: BaseException) -> str:
        """Why no upstream answered (the turn's upstream_error), never a URL's user:password."""
        if isinstance(exc, ReplicasFailed):
            return f"upstream unreachable: {exc}"
        return without_userinfo(f"upstream {self.session.upstream.host} unreachable: {describe(exc)}")

    def broke(self, turn: TurnRecord) -> None:
        """The upstream's answer broke after its first byte, not by the agent's doing: the turn
        says so (the rollout is then unscored: judge.py) and its replica is in back-off."""
        turn.upstream_broke = True
        if self.replica is not None and self.session.replicas is not None:
            self.session.replicas.failed(self.replica, "stream_broken")

    def done(self) -> None:
        """The call is over at its replica (the gateway calls it when the handler ends)."""
        if self.replica is not None and self.session.replicas is not None:
            self.session.replicas.end(self.replica)
        self.replica = None

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
        self, answer: aiohttp.ClientResponse, turn: TurnRecord, *, keep: list[bytes] | None = None, finish: bool = False
    ) -> web.StreamResponse:
        """Stream the answer back per upstream read, filling `turn`; `keep` collects the raw
        bytes (each read's piece); `finish` ends the agent's response here rather than after the
        handler returns (so work done afterwards does not delay the agent)."""
        request, started = self.request, self.started
        response = self.stream_response(answer.status, self.agent_headers(answer), answer.reason)
        completed = False
        response_bytes = 0
        error_body = bytearray() if answer.status >= 400 else None
        try:
            await response.prepare(request)
            content = answer.content
            upstream = answer.connection.transport if answer.connection is not None else None
            loop, first_read = asyncio.get_running_loop(), None
            # When the relay last became ready to read: the previous read's send, or the end of
            # the pause that followed it (`paused`).
            ready, paused = -1.0, False
            while chunk := await read_buffered(content):
                if not response_bytes:
                    turn.ttfb_s = time.perf_counter() - started
                response_bytes += len(chunk)
                if keep is not None:
                    keep.append(chunk)
                if error_body is not None and len(error_body) < ERROR_BODY_LIMIT:
                    error_body += chunk[: ERROR_BODY_LIMIT - len(error_body)]
                # at_eof, not is_eof: a relay that fell behind sees the upstream's end while
                # bytes are still buffered, and those must reach the agent too.
                if content.at_eof():
                    response.tail = chunk  # goes out with the terminating chunk
                    break
                await response.write(chunk)
                now = loop.time()
                first_read = now if first_read is None else first_read
                window = relay_window(now - first_read)
                close = now - ready < window and not (paused and len(chunk) >= RELAY_REPAUSE_MAX_BYTES)
                ready, paused = now, False
                if close and upstream is not None and upstream.is_reading():
                    upstream.pause_reading()
                    try:
                        await asyncio.sleep(window)
                    finally:
                        if not upstream.is_closing():
                            upstream.resume_reading()
                    ready, paused = loop.time(), True
            completed = True
            if finish:
                await response.write_eof()
            return response
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if request.transport is None or request.transport.is_closing():
                turn.client_disconnected = True
            else:
                turn.upstream_error = f"upstream stream broken: {describe(exc)}"
                self.broke(turn)
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
