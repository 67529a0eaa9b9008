"""What the gateway lets through, in every mode (black_box, transparent_proxy, interception_gate),
before any mode's own handling:
- the exact routes;
- per session, bounded request bodies and calls in flight (`SessionLimits`; enforced as the body
  is read, in gateway.read_body);
- the headers relayed upstream: an allow-list (`relayed_request_headers`), so nothing that
  authenticates, routes or names an account reaches the upstream from the agent;
- a sane chat/completions body (`police_request`): the session's model, one choice, integer
  token limits within the caps and the session's token budget, usage reported when a budget
  must count it, `stream` a boolean, and no engine extra the config did not allow;
- no upstream secret in anything relayed back.

The agent holds its session token and can call the gateway directly with any request it likes,
so none of this may rely on Pi's requests looking like Pi's."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import quote, quote_plus

import msgspec

from pi_env.errors import BadInputError

# (method, raw request target) -> the path appended to the upstream base URL. Compared with
# the raw target exactly: no query string, no percent-encoding, no `..`, no absolute form.
ALLOWED_ROUTES = {
    ("POST", "/v1/chat/completions"): "/chat/completions",
    ("GET", "/v1/models"): "/models",
}
TOKEN_LIMIT_KEYS = ("max_tokens", "max_completion_tokens")
SECRET_MASK = b"***"
_MIN_SECRET_CHARS = 8  # shorter header values ("1", "true") are not worth masking everywhere

# -- per-session limits (defaults; PiConfig.gateway.max_request_bytes / max_concurrent_calls)

# Request body bytes one session's calls in flight may hold together (a single body at most
# this). A long agent conversation is a few MB of JSON: a full 1M-token context is ~4-5 MB
# (about 4 bytes a token, a little more once JSON-escaped), Pi's default 32k context ~150 kB.
# 16 MiB is three times the largest context served today, and what the host can hold for
# every concurrent session (64 sessions: 1 GiB at worst).
MAX_REQUEST_BYTES = 16 << 20
# Calls (any route) one session may have open at once. Pi makes one model call at a time; 8
# leaves room for an agent's own helper calls and retries, and bounds the sockets, upstream
# connections and held bodies one sandbox can pin.
MAX_CONCURRENT_CALLS = 8
# Seconds to receive a whole request body once its headers are in. Local sandboxes send over
# a Unix socket (16 MiB in well under a second), remote ones over the network: 60 s allows a
# full budget at ~300 kB/s, and ends a body that trickles in.
BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SessionLimits:
    """What one session (one sandbox) may hold of the gateway at once."""

    max_request_bytes: int = MAX_REQUEST_BYTES  # bodies in flight, together; larger: 413
    max_concurrent_calls: int = MAX_CONCURRENT_CALLS  # more at once: 429
    body_timeout_s: float = BODY_TIMEOUT_S  # a body not in by then: 408

    def __post_init__(self):
        if self.max_request_bytes < 1 or self.max_concurrent_calls < 1 or not self.body_timeout_s > 0:
            raise ValueError(f"session limits must be positive, got {self}")


# -- headers relayed upstream

# The agent's request headers that reach the upstream: what an OpenAI client sends to describe
# its request (Pi: the OpenAI JS SDK over node's fetch). Everything else is dropped: hop-by-hop
# and forwarding headers (Connection, X-Forwarded-*, Forwarded, Via), credentials (api-key,
# X-Api-Key, Cookie, Proxy-Authorization), account and routing headers (OpenAI-Organization,
# OpenAI-Project, session affinity), Content-Encoding (aiohttp has already decoded the body).
# The gateway then sets Authorization (the real key), Accept-Encoding, Host, Content-Length and
# the upstream's own configured headers.
RELAYED_REQUEST_HEADERS = frozenset({"accept", "accept-language", "content-type", "user-agent", "sec-fetch-mode"})
RELAYED_HEADER_PREFIXES = ("x-stainless-",)  # the OpenAI SDKs' client description (lang, os, retry count)


def relayed_request_headers(agent_headers) -> list[tuple[str, str]]:
    """The agent's headers that may reach the upstream (see RELAYED_REQUEST_HEADERS); a header
    that its own `Connection:` header names is hop-by-hop, and dropped too."""
    listed = {name.strip().lower() for name in agent_headers.get("Connection", "").split(",")}
    return [
        (name, value)
        for name, value in agent_headers.items()
        if (name.lower() in RELAYED_REQUEST_HEADERS or name.lower().startswith(RELAYED_HEADER_PREFIXES))
        and name.lower() not in listed
    ]


# -- chat/completions body fields the agent may not send unless the config allows them

# Engine extras outside what the trainer forces (rewrite.SAMPLING_KEYS) that change what is
# generated, how the prompt is rendered, what a call costs, or which model, adapter or replica
# serves it (vLLM, SGLang, llama.cpp names). Pi sends none of them. A call naming one (with a
# value other than null) is refused with a 400 that names it, in every mode, unless the session
# allows it (PiConfig.gateway.allow_fields).
RESTRICTED_FIELDS: dict[str, str] = {
    **dict.fromkeys(
        (
            "ignore_eos",
            "min_tokens",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
            "stop_token_ids",
            "include_stop_str_in_output",
            "no_stop_trim",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "use_beam_search",
            "length_penalty",
            "logits_processors",
            "custom_logit_processor",
            "custom_params",
            "vllm_xargs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_decoding_backend",
            "guided_whitespace_pattern",
            "structured_outputs",
            "structural_tag",
            "regex",
            "ebnf",
            "grammar",
            "json_schema",
            "mirostat",
            "mirostat_tau",
            "mirostat_eta",
            "typical_p",
            "dynatemp_range",
            "samplers",
        ),
        "changes what is generated",
    ),
    **dict.fromkeys(
        (
            "chat_template",
            "add_generation_prompt",
            "continue_final_message",
            "add_special_tokens",
            "echo",
            "documents",
            "truncate_prompt_tokens",
            "mm_processor_kwargs",
        ),
        "changes how the prompt is rendered",
    ),
    **dict.fromkeys(
        ("prompt_logprobs", "return_hidden_states", "n_probs", "service_tier"), "costs far more than the answer"
    ),
    **dict.fromkeys(
        (
            "lora_path",
            "lora",
            "priority",
            "data_parallel_rank",
            "kv_transfer_params",
            "id_slot",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
        ),
        "picks the adapter, replica or scheduling that serves it",
    ),
}


def check_allow_fields(names: Iterable[str], where: str = "gateway_allow_fields") -> frozenset[str]:
    """Restricted fields a session lets through, checked: a name that is not restricted is
    relayed anyway, so naming one is a mistake (a typo would silently allow nothing)."""
    names = frozenset(names)
    unknown = sorted(names - RESTRICTED_FIELDS.keys())
    if unknown:
        raise ValueError(
            f"{where}: {unknown} are not restricted fields (anything else is relayed already); "
            f"restricted: {', '.join(sorted(RESTRICTED_FIELDS))}"
        )
    return names


_Fields = msgspec.defstruct(
    "_Fields",
    [
        (name, Any, None)
        for name in (
            "model",
            "n",
            "best_of",
            "max_tokens",
            "max_completion_tokens",
            "stream",
            "stream_options",
            *RESTRICTED_FIELDS,
        )
    ],
)
_Fields.__doc__ = "The fields the policy reads; msgspec skips the rest of the body without building it."


class PolicyError(BadInputError, ValueError):
    """The body cannot be relayed: the message says what to fix, `error_type` names the rule
    (the JSON error's "type")."""

    def __init__(self, message: str, error_type: str = "invalid_request"):
        super().__init__(message)
        self.error_type = error_type


def upstream_path(method: str, raw_path: str) -> str | None:
    """The upstream path for an allowed route, None for anything else."""
    return ALLOWED_ROUTES.get((method, raw_path))


class Policed(NamedTuple):
    """A chat/completions call as the gateway relays it."""

    body: bytes
    allowed: int | None  # the completion tokens it may generate (None: unbounded)
    streamed: bool  # the agent asked for a streamed answer (Pi always does)


def police_request(
    body: bytes,
    *,
    cap: int | None,
    budget_left: int | None,
    model: str | None = None,
    allow_fields: frozenset[str] = frozenset(),
) -> Policed:
    """The chat/completions body to send upstream, and the completion tokens it may generate
    (None: unbounded). Rewrites only what breaks the rules, so a well-formed call is relayed
    byte for byte:
    - `model` other than the session's (`model`; None: no rule) becomes it: the config fixes
      the model, whatever the agent names (an unknown name would fail like a broken endpoint,
      another served model would be paid for with the real key);
    - `n` other than 1 becomes 1 (one call, one answer: the budget and the records count so);
    - a token limit that is not a positive integer (1e6, "1000000", true) or exceeds `cap` or
      what is left of the budget is clamped; with a cap or a budget, a call without one gets one;
    - with a budget, a streamed call is made to report its usage (stream_options.include_usage).
    Raises PolicyError (the agent gets a 400 saying what to fix) when the body is not a JSON
    object, when `stream` is not a JSON boolean (the upstream might read "true" or 1 as a
    stream that the gateway, reading the JSON, would record as no answer; OpenAI refuses them
    too), or when it names a RESTRICTED_FIELDS field not in `allow_fields`."""
    lenient = False
    try:
        # Any: _Fields is built by defstruct at runtime, so mypy cannot see its attributes
        fields: Any = msgspec.json.decode(body, type=_Fields)
    except msgspec.ValidationError:  # valid JSON, but not an object
        raise PolicyError("the request body is not a JSON object") from None
    except RecursionError:
        raise PolicyError(
            f"the request body nests deeper than JSON parsers go ({sys.getrecursionlimit()} levels)"
        ) from None
    except msgspec.DecodeError:
        # msgspec refuses a lone surrogate escape ("\ud83d"), which node's JSON.stringify
        # writes for a string cut inside a pair: valid JSON, so the slower parser reads it.
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise PolicyError("the request body is not a JSON object") from None
        if not isinstance(request, dict):
            raise PolicyError("the request body is not a JSON object") from None
        fields = _Fields(**{name: request.get(name) for name in _Fields.__struct_fields__})
        lenient = True
    if fields.stream is not None and not isinstance(fields.stream, bool):
        raise PolicyError(f"`stream` must be a JSON boolean (true or false), not {_shown(fields.stream)}")
    refused = [name for name in RESTRICTED_FIELDS if name not in allow_fields and getattr(fields, name) is not None]
    if refused:
        raise PolicyError(
            "these fields are not allowed in this session: "
            + "; ".join(f"`{name}` ({RESTRICTED_FIELDS[name]})" for name in refused)
            + "; send the call without them "
            "(the trainer allows them with PiConfig.gateway.allow_fields)",
            "field_not_allowed",
        )
    limit = cap if budget_left is None else max(1, budget_left if cap is None else min(cap, budget_left))
    changes: dict[str, Any] = {}
    if model is not None and fields.model != model:
        changes["model"] = model
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
    if limit is not None and not present:  # an agent that sends no limit (Codex) is capped too
        changes["max_tokens"] = limit
    if budget_left is not None and fields.stream is True:
        options = fields.stream_options if isinstance(fields.stream_options, dict) else {}
        if options.get("include_usage") is not True:
            changes["stream_options"] = {**options, "include_usage": True}
    streamed = fields.stream is True
    if not changes:
        return Policed(body, allowed, streamed)
    try:
        request = json.loads(body) if lenient else msgspec.json.decode(body)
        for key, value in changes.items():
            if value is None:
                request.pop(key, None)
            else:
                request[key] = value
        body = json.dumps(request).encode() if lenient else msgspec.json.encode(request)
    except RecursionError:
        raise PolicyError(
            f"the request body nests deeper than JSON parsers go ({sys.getrecursionlimit()} levels)"
        ) from None
    return Policed(body, allowed, streamed)


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


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
    return {
        value,
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        quote(value, safe=""),
        quote_plus(value, safe=""),
    }


def scrub(data: bytes, secrets: tuple[bytes, ...]) -> bytes:
    for secret in secrets:
        if secret in data:
            data = data.replace(secret, SECRET_MASK)
    return data
