"""transparent_proxy: rewrite each request for capture, stream the answer to the agent as it
arrives, and assemble the turn (ids, logprobs, message) on the side, after the agent has its
answer (assembly.py), so capture costs the agent no latency.

An upstream that rejects a capture parameter gets one well-defined fallback, remembered for
the rest of the session once it worked, and recorded in every turn it affects:
  1. "non_streaming": the same request unstreamed, with capture, replayed to the agent as SSE
     (llama.cpp: "logprobs is not supported with tools + stream");
  2. "without_capture": the request without logprobs/top_logprobs/return_token_ids, streamed
     (Groq rejects logprobs); the capture then says why it has no ids.
"""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from pi_env.proxy.assembly import assemble_after, assemble_inline
from pi_env.proxy.capture import TurnCapture, sse_from_capture
from pi_env.proxy.records import TurnRecord
from pi_env.proxy.rewrite import rejects_capture, rewrite_request, without_capture
from pi_env.proxy.wire import (
    Call,
    Strategy,
    StrategySession,
    agent_request,
    describe,
    json_error,
    not_a_json_object,
)

NON_STREAMING = "non_streaming"
WITHOUT_CAPTURE = "without_capture"


class TransparentProxy(Strategy):
    """transparent_proxy without token-in (see the module docstring)."""

    def __init__(self, session: StrategySession):
        self.session = session
        self.options = session.capture_options
        self.fallback: str | None = None  # sticky for the session once it worked
        self.fallback_reason: str | None = None

    async def chat_completions(self, call: Call, body: bytes, turn: TurnRecord) -> web.StreamResponse:
        request = agent_request(body)
        if request is None:
            return not_a_json_object()
        rewritten = rewrite_request(request, self.options)
        turn.capture = capture = TurnCapture(request=rewritten)
        streaming = rewritten.get("stream") is True
        if self.fallback == NON_STREAMING and streaming:
            return await self._non_streaming(call, rewritten, capture, turn)
        if self.fallback == WITHOUT_CAPTURE:
            rewritten = capture.request = without_capture(rewritten)
            capture.fallback = f"{WITHOUT_CAPTURE}: {self.fallback_reason}"

        answer = await call.open(rewritten, turn)  # salted and stamped as it leaves
        if isinstance(answer, web.Response):
            return answer
        if answer.status >= 400:
            error = await call.read_error(answer, turn)
            if self.fallback is None and rejects_capture(answer.status, error.decode(errors="replace")):
                self.fallback_reason = f"upstream answered {answer.status}: {error[:300].decode(errors='replace')}"
                return await self._fall_back(call, rewritten, capture, turn, streaming)
            return _error_answer(answer.status, error, answer.content_type)
        return await assemble_after(call, answer, capture, turn, streaming)

    async def _fall_back(
        self, call: Call, rewritten: dict, capture: TurnCapture, turn: TurnRecord, streaming: bool
    ) -> web.StreamResponse:
        # A fallback sticks only once the upstream accepted it: an error that merely mentions
        # logprobs, whatever the request, must not cost the rest of the session its capture.
        if streaming:
            response = await self._non_streaming(call, rewritten, capture, turn)
            if turn.upstream_status is not None and turn.upstream_status < 400:
                self.fallback = NON_STREAMING
                return response
            if not rejects_capture(turn.upstream_status or 0, turn.upstream_error or ""):
                return response
        capture.fallback = f"{WITHOUT_CAPTURE}: {self.fallback_reason}"
        plain = capture.request = without_capture(rewritten)
        turn.upstream_status = turn.upstream_error = None
        answer = await _send(call, plain, turn)
        if isinstance(answer, web.Response):
            return answer
        self.fallback = WITHOUT_CAPTURE
        return await assemble_after(call, answer, capture, turn, streaming)

    async def _non_streaming(
        self, call: Call, rewritten: dict, capture: TurnCapture, turn: TurnRecord
    ) -> web.StreamResponse:
        """Ask unstreamed with capture, answer the agent with an SSE stream rebuilt from it."""
        capture.fallback = f"{NON_STREAMING}: {self.fallback_reason}"
        body = capture.request = {k: v for k, v in rewritten.items() if k not in ("stream", "stream_options")}
        turn.upstream_status = turn.upstream_error = None
        answer = await _send(call, body, turn)
        if isinstance(answer, web.Response):
            return answer
        turn.upstream_status = answer.status
        try:
            raw = await answer.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            answer.close()
            call.broke(turn)
            turn.upstream_error = f"upstream answer broken: {describe(exc)}"
            return json_error(502, f"pi-env gateway: {turn.upstream_error}", "upstream_error")
        answer.release()
        turn.ttfb_s = time.perf_counter() - call.started  # the agent's first byte leaves only now
        turn.response_bytes = len(raw)
        assemble_inline(capture, turn, raw, streaming=False)
        include_usage = bool((rewritten.get("stream_options") or {}).get("include_usage"))
        return web.Response(
            body=sse_from_capture(capture, include_usage=include_usage), content_type="text/event-stream"
        )


async def _send(call: Call, body: dict, turn: TurnRecord) -> aiohttp.ClientResponse | web.Response:
    """The upstream's 2xx answer to `body`, or what the agent gets instead (a 502 when the
    upstream is unreachable, else the upstream's own error)."""
    answer = await call.open(body, turn)
    if isinstance(answer, web.Response) or answer.status < 400:
        return answer
    return _error_answer(answer.status, await call.read_error(answer, turn), answer.content_type)


def _error_answer(status: int, body: bytes, content_type: str | None) -> web.Response:
    """The upstream's error, as the agent should see it (same status, same body)."""
    return web.Response(status=status, body=body, content_type=content_type or "application/json")
