"""The scripted server's script and its made-up tokenizer: plain values that the server
(server.py) and the token engine (token_engine.py) both build on, importing neither.

A script is a list of `ScriptedTurn`s (one assistant answer each, with its `ScriptedToolCall`s
and any injected `Fault`). Everything derived from it is synthetic and marked so
(`SYNTHETIC_FINGERPRINT`); the ids and logprobs come from `synthetic_tokens`, which is no
real model's tokenizer, and are deterministic so tests can assert exact values.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SYNTHETIC_FINGERPRINT = "pi-env-synthetic"
SCRIPT_FINISHED_TEXT = "(script finished)"
TOKEN_CHARS = 4  # the synthetic tokenizer: every 4 characters are one token
SYNTHETIC_CREATED = 1_700_000_000  # `created` of answers under EngineQuirks(deterministic_ids=True)


# --------------------------------------------------------------------------------- the script


class ScriptedToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # a str is sent verbatim
    id: str | None = None  # default: "call_<turn>_<index>"

    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


class Fault(BaseModel):
    """Misbehaviour injected into one turn's answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    http_status: int | None = None  # answer this status with `body` instead of a completion
    body: Any = None  # JSON value (or str sent as-is); default: an OpenAI-style error object
    hang_s: float = 0.0  # sleep before answering at all
    # Streaming answers only:
    malformed_chunk: bool = False  # a non-JSON `data:` line in the middle of the stream
    disconnect_after_chunks: int | None = None  # close the connection after N SSE events
    delay_s: float = 0.0  # sleep between consecutive SSE events
    # Non-streamed answers only: send the first N bytes of the body (Content-Length announces
    # all of it), then close, like an engine that died while sending its answer.
    truncate_body_at: int | None = Field(default=None, ge=0)


class ScriptedTurn(BaseModel):
    """One assistant answer. Immutable, so the server may cache its rendered stream."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = ""
    reasoning: str = ""
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    chunk_chars: int = Field(default=16, ge=1)  # stream text/reasoning/arguments in these pieces
    finish_reason: str | None = None  # default: "tool_calls" if tool_calls else "stop"
    fault: Fault | None = None
    # Engine-like: the logprob of every k-th generated token (positions k-1, 2k-1, ...) is null.
    null_logprob_every: int | None = Field(default=None, ge=1)
    # Token engine only (pi_env.scripted.token_engine): the answer's ids exactly as given, the end
    # id not added, for outputs no text spells (invalid UTF-8 bytes, a loop of one token); `text`
    # and `tool_calls` are then ignored on /v1/completions.
    token_ids: list[int] | None = None

    def effective_finish_reason(self) -> str:
        return self.finish_reason or ("tool_calls" if self.tool_calls else "stop")


Script = list[ScriptedTurn]
# A script chosen per request: given the request body, the script that answers it (its turn is
# still picked by the request's count of assistant messages). It runs on every request, so it
# should be fast, and return the same ScriptedTurn objects for the same request shape (the
# server caches renderings by turn).
ScriptAdapter = Callable[[dict[str, Any]], Script]
FINISHED_TURN = ScriptedTurn(text=SCRIPT_FINISHED_TEXT)


def coerce_script(turns: list[ScriptedTurn | dict]) -> Script:
    return [ScriptedTurn.model_validate(t) for t in turns]


# ------------------------------------------------------------------------ synthetic tokenizer


def synthetic_tokens(text: str) -> list[str]:
    """Made-up tokenization: consecutive 4-character slices. Not any real model's tokenizer."""
    return [text[i : i + TOKEN_CHARS] for i in range(0, len(text), TOKEN_CHARS)]


def synthetic_token_id(token: str) -> int:
    """A stable id in [100, 50100) from the token's text (crc32, so identical across runs)."""
    return 100 + zlib.crc32(token.encode()) % 50_000


def synthetic_logprob(token: str, position: int) -> float:
    """A stable logprob in (-4, 0] that depends on the token and its position."""
    return -(zlib.crc32(f"{position}:{token}".encode()) % 4000) / 1000
