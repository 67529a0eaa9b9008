"""What the gateway lets through, in every mode: the exact routes, a sane chat/completions body
(one choice, integer token limits within the caps and the session's token budget, usage
reported when a budget must count it), and no upstream secret in anything relayed back.

The agent holds its session token and can call the gateway directly with any request it likes,
so none of this may rely on Pi's requests looking like Pi's."""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import quote, quote_plus

import msgspec

# (method, raw request target) -> the path appended to the upstream base URL. Compared with
# the raw target exactly: no query string, no percent-encoding, no `..`, no absolute form.
ALLOWED_ROUTES = {
    ("POST", "/v1/chat/completions"): "/chat/completions",
    ("GET", "/v1/models"): "/models",
}
TOKEN_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")
SECRET_MASK = b"***"
_MIN_SECRET_CHARS = 8  # shorter header values ("1", "true") are not worth masking everywhere


class _Fields(msgspec.Struct):
    """The few fields the policy reads; msgspec skips the rest of the body without building it."""

    n: Any = None
    best_of: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    stream: Any = None
    stream_options: Any = None


class PolicyError(ValueError):
    """The body cannot be relayed at all (not a JSON object)."""


def upstream_path(method: str, raw_path: str) -> str | None:
    """The upstream path for an allowed route, None for anything else."""
    return ALLOWED_ROUTES.get((method, raw_path))


def police_request(body: bytes, *, cap: int | None, budget_left: int | None) -> tuple[bytes, int | None]:
    """The chat/completions body to send upstream, and the completion tokens it may generate
    (None: unbounded). Rewrites only what breaks the rules, so a well-formed call is relayed
    byte for byte:
    - `n` other than 1 becomes 1 (one call, one answer: the budget and the records count so);
    - a token limit that is not a positive integer (1e6, "1000000", true) or exceeds `cap` or
      what is left of the budget is clamped; with a budget, a call without one gets one;
    - with a budget, a streamed call is made to report its usage (stream_options.include_usage).
    Raises PolicyError when the body is not a JSON object."""
    lenient = False
    try:
        fields = msgspec.json.decode(body, type=_Fields)
    except msgspec.ValidationError:  # valid JSON, but not an object
        raise PolicyError("the request body is not a JSON object") from None
    except msgspec.DecodeError:
        # msgspec refuses a lone surrogate escape ("\ud83d"), which node's JSON.stringify
        # writes for a string cut inside a pair: valid JSON, so the slower parser reads it.
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise PolicyError("the request body is not a JSON object") from None
        if not isinstance(request, dict):
            raise PolicyError("the request body is not a JSON object") from None
        fields = _Fields(**{name: request.get(name) for name in _Fields.__struct_fields__})
        lenient = True
    limit = cap if budget_left is None else max(1, budget_left if cap is None else min(cap, budget_left))
    changes: dict[str, Any] = {}
    for key in ("n", "best_of"):  # vLLM's best_of samples that many sequences too
        value = getattr(fields, key)
        if value is not None and not (type(value) is int and value == 1):
            changes[key] = 1
    present = [key for key in TOKEN_LIMIT_KEYS if getattr(fields, key) is not None]
    allowed = limit
    for key in present:
        value = _as_token_count(getattr(fields, key))
        clamped = value if limit is None or (value is not None and value <= limit) else limit
        if clamped is None:  # not a number at all and no cap to put instead: drop it
            changes[key] = None
        elif clamped != getattr(fields, key) or type(getattr(fields, key)) is not int:
            changes[key] = clamped
        if clamped is not None:
            allowed = clamped if allowed is None else min(allowed, clamped)
    if budget_left is not None and not present:
        changes["max_tokens"] = limit
    if budget_left is not None and fields.stream is True:
        options = fields.stream_options if isinstance(fields.stream_options, dict) else {}
        if options.get("include_usage") is not True:
            changes["stream_options"] = {**options, "include_usage": True}
    if not changes:
        return body, allowed
    request = json.loads(body) if lenient else msgspec.json.decode(body)
    for key, value in changes.items():
        if value is None:
            request.pop(key, None)
        else:
            request[key] = value
    return (json.dumps(request).encode() if lenient else msgspec.json.encode(request)), allowed


def _as_token_count(value: Any) -> int | None:
    """A token limit as a positive int (floats and numeric strings truncated), None if it is
    not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        value = int(value)
    if not isinstance(value, int):
        return None
    return max(1, value)


def secrets_of(api_key: str | None, headers: dict[str, str]) -> tuple[bytes, ...]:
    """The byte strings that must never reach the agent or a record: the upstream key and the
    values of the extra upstream headers, longest first (so a longer secret is masked whole)."""
    values = [api_key or "", *headers.values()]
    found = {form.encode() for value in values if len(value) >= _MIN_SECRET_CHARS for form in _quoted_forms(value)}
    return tuple(sorted(found, key=len, reverse=True))


def _quoted_forms(value: str) -> set[str]:
    """`value` as an upstream may echo it in an error body: as is, JSON-escaped (a key with `"`,
    `\\` or non-ASCII), URL-encoded."""
    return {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1], quote(value, safe=""),
            quote_plus(value, safe="")}


def scrub(data: bytes, secrets: tuple[bytes, ...]) -> bytes:
    for secret in secrets:
        if secret in data:
            data = data.replace(secret, SECRET_MASK)
    return data
