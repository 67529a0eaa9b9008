"""An upstream's 2xx answer relayed to the agent, then assembled into the turn's `TurnCapture`
(message, ids, logprobs, usage) once the agent has it: how every mode that relays an answer
(black_box, transparent_proxy) records what the model answered. A small answer is parsed inline
(`assemble_inline`), one past OFFLOAD_MIN_BYTES in the capture worker pool
(capture_worker.py) in a task of its own (`Call.finish_record_later`), so a long parse never
holds the event loop every other stream shares.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from pi_env.proxy.capture import TurnCapture, assemble_answer
from pi_env.proxy.capture_worker import CapturePoolClosed, CaptureWorkerError, capture_pool
from pi_env.proxy.dialects.base import AnswerStream
from pi_env.proxy.records import TurnRecord
from pi_env.proxy.wire import Call

log = logging.getLogger(__name__)
OFFLOAD_MIN_BYTES = 64 << 10  # below this, a round trip to the worker costs more than parsing


async def assemble_after(
    call: Call, answer, capture: TurnCapture, turn: TurnRecord, streaming: bool, *, finish: bool = True
) -> web.StreamResponse:
    """Stream the answer to the agent, then assemble it into `capture` (every mode records what
    the model answered): inline when small, in a worker process when large. `finish`: the agent
    has the whole answer before the assembly (else its last bytes wait for an inline one)."""
    pieces: list[bytes] = []  # as read: joined only to parse inline, never to hand to a worker
    try:
        response = await call.stream(answer, turn, keep=pieces, finish=finish)
    except asyncio.CancelledError:  # the agent hung up: keep what had arrived
        assemble_inline(capture, turn, b"".join(pieces), streaming)
        raise
    translation = getattr(response, "translation", None)  # a dialect's answer (wire.DialectResponse)
    # Decoded already, piece by piece, to be translated: assembled from those, never parsed again.
    assembled = translation.assembled(response.tail) if isinstance(translation, AnswerStream) and streaming else None  # type: ignore[attr-defined]
    if assembled is not None:
        _merge(capture, assembled)
        _count_tokens(capture, turn)
    elif turn.response_bytes < OFFLOAD_MIN_BYTES:
        assemble_inline(capture, turn, b"".join(pieces), streaming)
    else:
        call.finish_record_later(_assemble_in_worker(capture, turn, pieces, streaming))
    return response


async def _assemble_in_worker(capture: TurnCapture, turn: TurnRecord, pieces: list[bytes], streaming: bool) -> None:
    """Large answers are parsed in a capture worker process: milliseconds of decoding would
    otherwise hold the gateway's event loop, and with it every other stream. When the
    worker fails the answer is parsed inline (rather than lost), and the capture says why
    (`worker_error`). Cancellation is never swallowed."""
    try:
        assembled = await capture_pool().assemble(pieces, streaming)
    except CaptureWorkerError as error:
        level = logging.DEBUG if isinstance(error, CapturePoolClosed) else logging.WARNING  # exiting: no fault
        log.log(level, "turn %s parsed on the event loop: %s", turn.turn, error)
        capture.worker_error = str(error)
        return assemble_inline(capture, turn, b"".join(pieces), streaming)
    _merge(capture, assembled)
    _count_tokens(capture, turn)


def assemble_inline(capture: TurnCapture, turn: TurnRecord, raw: bytes, streaming: bool) -> None:
    """Parse the answer's bytes on this thread into `capture`, and count its tokens on `turn`."""
    _merge(capture, assemble_answer(raw, streaming))
    _count_tokens(capture, turn)


def _merge(capture: TurnCapture, assembled: TurnCapture) -> None:
    """Fill `capture` (which already holds the request and any fallback) from an assembly."""
    for name, value in vars(assembled).items():
        if name not in ("request", "fallback", "worker_error"):
            setattr(capture, name, value)


def _count_tokens(capture: TurnCapture, turn: TurnRecord) -> None:
    if capture.usage and isinstance(capture.usage.get("total_tokens"), int):
        turn.total_tokens = capture.usage["total_tokens"]
