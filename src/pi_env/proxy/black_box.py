"""black_box: relay the agent's call as the gateway's rules (policy.py) left it, and record what
was asked and answered.

What it sends: the policed body, unchanged (a well-formed call is the agent's bytes; nothing
added, no capture parameters, the agent's own sampling). What it parses and records on the
turn (`TurnRecord`, whose `capture` is a `TurnCapture`):
  - the request: the body decoded as JSON (`capture.request`); a body the policy let through
    that does not decode here (a lone surrogate escape) is relayed with no capture at all;
  - an error answer (status >= 400): read whole (at most 1 MB), the upstream's secrets masked,
    relayed, and its first 4 KB kept as `upstream_error`; no capture;
  - a 2xx answer: relayed per upstream read as it arrives (`Call.stream`) and kept, then
    parsed as SSE or JSON (capture.assemble_answer, through assembly.py) into the message,
    finish reason and usage, plus whatever ids and logprobs the upstream sent unasked;
    `usage.total_tokens` counts against the session's token budget. An answer under
    assembly.OFFLOAD_MIN_BYTES is parsed before the agent gets its terminating chunk; a
    larger one in the capture worker pool, after the agent has it all.
So the conversation (conversation.py) comes from the gateway, never from the agent's files.
"""

from __future__ import annotations

from aiohttp import web

from pi_env.proxy.assembly import assemble_after
from pi_env.proxy.capture import TurnCapture
from pi_env.proxy.records import TurnRecord
from pi_env.proxy.wire import Call, Strategy, StrategySession, agent_request


class BlackBox(Strategy):
    """The black_box strategy of one gateway session (see the module docstring)."""

    def __init__(self, session: StrategySession):
        self.session = session

    async def chat_completions(self, call: Call, body: bytes, turn: TurnRecord) -> web.StreamResponse:
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
