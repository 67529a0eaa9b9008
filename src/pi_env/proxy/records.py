"""What the gateway's sessions are opened with and what they record: plain values, shared by
the dispatcher (gateway.py) and every strategy, importing no other module of the gateway but
capture.py (a turn's `TurnCapture`).

`Upstream`: where a session's calls go (the key kept out of repr). `TokenInSpec`: the renderer
a token-in session renders with (loaded by token_in.load_renderer). `TurnRecord`: one
chat/completions call as the gateway saw it. `SessionStop`: why a strategy now answers every
call with a stop (interception_gate: the trainer never answered). `PolicyVersion`: the policy
version in force, shared by whoever sets it (a factory) and every session it opened; `Routing`:
what a session tells a router and an engine (its session id header, the version's cache salt,
the answer header an engine reports its version in).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pi_env.proxy.capture import TurnCapture
from pi_env.proxy.replicas import public_host


@dataclass
class Upstream:
    """Where a session's model calls go. The key (and extra headers, which may hold secrets
    too) stay out of repr so they cannot leak through logs or tracebacks, and so do the base
    URLs' user:password (repr shows host:port)."""

    base_url: str  # e.g. "http://127.0.0.1:8000/v1"; "/<rest>" of /v1/<rest> is appended
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    # Per session; None: the gateway's defaults. read bounds each wait for upstream bytes,
    # headers included: long enough for a slow prefill, short enough to free a stuck agent.
    connect_timeout_s: float | None = None
    read_timeout_s: float | None = None
    # Several replicas of one endpoint (proxy/replicas.py): every base URL, `base_url` first;
    # empty or one: just base_url, as always.
    base_urls: tuple[str, ...] = field(default=(), repr=False)

    def __repr__(self) -> str:
        hosts = [public_host(url) for url in self.base_urls] if len(self.base_urls) > 1 else self.host
        return f"Upstream(host={hosts!r}, model={self.model!r})"

    def timeout(self) -> aiohttp.ClientTimeout | None:
        if self.connect_timeout_s is None and self.read_timeout_s is None:
            return None
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s)

    @property
    def host(self) -> str:
        """host:port only: the base URL may carry user:password."""
        return public_host(self.base_url)


@dataclass(frozen=True)
class TokenInSpec:
    """What a session renders with: the renderer's name as configured and as resolved, and the
    renderer itself (shared by every session with the same name and tokenizer)."""

    name: str
    resolved: str
    tokenizer: str
    renderer: Any = field(repr=False, compare=False)


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
    upstream_broke: bool = False  # the upstream's answer broke after its first byte (not the agent's doing)
    streamed: bool | None = None  # the agent asked for a streamed answer (None: the body was refused)
    total_tokens: int | None = None  # usage.total_tokens, when the answer reported it
    reserved_tokens: int = 0  # held against max_total_tokens while the call ran
    # The policy version that produced the answer: the one in force when the call was sent
    # upstream (handed to the trainer in interception_gate), unless the engine (or the trainer)
    # reported its own; `policy_version_source` says which: "gateway", "engine", "trainer".
    policy_version: Any = None
    policy_version_source: str | None = None
    # Which replica answered (host:port, never credentials; the last one tried when none did),
    # and whether it is not the replica the session was on before this call: it failed (or was
    # in back-off), and the call went to another (docs/async-rl.md, "Several replicas").
    replica: str | None = None
    failed_over: bool = False
    # The API shape the agent spoke when not Chat Completions ("responses", "messages", "gemini":
    # proxy/dialects; the capture holds the Chat Completions call it became), and what it sent
    # that the engine cannot honour, accepted and not forwarded.
    dialect: str | None = None
    dialect_notes: list[str] | None = None
    # What was asked and answered (every mode that had an answer); ids and logprobs where
    # captured (transparent_proxy, interception_gate).
    capture: TurnCapture | None = None

    def to_json(self) -> dict:
        data = {k: v for k, v in vars(self).items() if k != "capture"}
        data["capture"] = self.capture.to_json() if self.capture else None
        return data


@dataclass(frozen=True)
class SessionStop:
    """Why a session's strategy answers every call with a clean stop from now on; the rollout
    reports it (`GatewaySession.stopped()`)."""

    reason: str  # interception_gate: "gate_timeout"
    message: str


# -- the policy version and what a session sends for routing (docs/async-rl.md)

SESSION_HEADER = "X-Session-ID"  # what common routers hash on to keep a session on one replica
# Headers the gateway sets itself or that frame the request: never a session header's name.
_RESERVED_HEADERS = frozenset(
    {"authorization", "host", "content-length", "content-type", "accept-encoding", "transfer-encoding", "connection"}
)
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token: a header's name


def check_policy_version(version: Any) -> Any:
    """A policy version as the gateway records it: a JSON scalar (None, a bool, an int, a finite
    float, a string). Anything else is a TypeError/ValueError naming what to give."""
    if version is None or isinstance(version, (bool, int, str)):
        return version
    if isinstance(version, float):
        if not math.isfinite(version):
            raise ValueError(f"a policy version must be a finite number, not {version!r}")
        return version
    raise TypeError(
        f"a policy version is a JSON scalar (an int such as the training step, a string, a float, "
        f"a bool or None), not {type(version).__name__}"
    )


def cache_salt(version: Any) -> str:
    """vLLM's `cache_salt` for a policy version: the same version, the same salt (so a session's
    calls share their prefix cache), another version, another salt (so no call reuses KV cache
    computed with other weights)."""
    digest = hashlib.sha256(b"pi-env-policy-version\0" + json.dumps(version).encode()).hexdigest()
    return f"pi-env-policy-{digest[:32]}"


def engine_version(value: str) -> Any:
    """A version an engine reported in a header: a JSON scalar when it reads as one (`7` is the
    int 7), else the header's text."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    try:
        return check_policy_version(parsed)
    except (TypeError, ValueError):
        return value


class PolicyVersion:
    """The policy version in force, shared by whoever sets it and every session that reads it:
    a `PiSessionFactory` holds one for all its sessions, so a version set between two calls of a
    session already open stamps the second. Thread-safe: set from the trainer's thread, read on
    the gateway's loop."""

    def __init__(self, version: Any = None):
        self._lock = threading.Lock()
        self._version = check_policy_version(version)

    @property
    def value(self) -> Any:
        with self._lock:
            return self._version

    def set(self, version: Any) -> None:
        version = check_policy_version(version)
        with self._lock:
            self._version = version

    def __repr__(self) -> str:
        return f"PolicyVersion({self.value!r})"


def check_header_name(name: str, where: str) -> str:
    """A header name the gateway may set or read: an HTTP token, and not one it sets itself."""
    if not _TOKEN.match(name):
        raise ValueError(f"{where}: {name!r} is not an HTTP header name (letters, digits and -_.!#$%&'*+^`|~)")
    if name.lower() in _RESERVED_HEADERS:
        raise ValueError(f"{where}: {name!r} is a header the gateway sets itself; choose another name")
    return name


@dataclass(frozen=True)
class Routing:
    """What a session's upstream calls carry for routers and engines, set by the gateway (the
    agent can neither set nor spoof any of it: policy.py relays none of its own headers by these
    names, and the gateway's value replaces any it sent):
    - `session_header`: the name of the header carrying the session's id (`GatewaySession.id`,
      random, stable for the session, never its token) on every call; None: not sent;
    - `cache_salt`: put vLLM's `cache_salt` for the policy version in force into every request
      body (only where the gateway rewrites bodies: transparent_proxy, token-in);
    - `version_header`: an answer header in which a served engine reports the version of the
      weights that answered; when present it wins over the version in force (source "engine")."""

    session_header: str | None = SESSION_HEADER
    cache_salt: bool = False
    version_header: str | None = None

    def __post_init__(self):
        if self.session_header is not None:
            check_header_name(self.session_header, "session_header")
        if self.version_header is not None:
            check_header_name(self.version_header, "version_header")
