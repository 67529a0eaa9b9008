"""What a remote caller may hand the server, and what it gets back of an upstream's answer.

- `refuse_host_paths`: a caller's task is data only. It may name no file or directory on the
  server's host: the one kind of task field a rollout opens on the host is a task format's
  environment to build (Harbor's Dockerfile and its build context, host paths the building
  backends read), so a caller's task with such an environment is refused, whatever the paths.
- `caller_base_url`: a caller's base URL (`base_url`, or `endpoint` given as a URL) parsed and
  rebuilt from its parts (http/https, a host, no user info, no query, no fragment, no dot
  segments or escapes in the path, `/v1` when it has no path), then checked against the
  operator's allowlist (`pi-env serve --allow-base-url URL`, PI_ENV_ALLOWED_BASE_URLS; the
  catalog's endpoints and PI_ENV_LOCAL_BASE_URL are always allowed).
- `short_upstream_error`: an upstream error body as the caller sees it: the error's own message
  when it is an OpenAI-style JSON error, else only its size; bounded, control characters and
  header-like `Name: value` text removed.

Light (no openenv): `rollouts` imports it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from ..endpoints import CATALOG
from ..errors import BadInputError
from ..task import PiTask

ALLOW_ENV = "PI_ENV_ALLOWED_BASE_URLS"
ALLOW_FLAG = "--allow-base-url"
ALLOW_HOW = f"`pi-env serve {ALLOW_FLAG} URL` (repeatable) or {ALLOW_ENV} (comma-separated)"
DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_UPSTREAM_MESSAGE = 300


class CallerError(BadInputError, ValueError):
    """What a caller sent is not allowed; the message says what to send instead."""


# -- a caller's task is data only --------------------------------------------------------------
def refuse_host_paths(task: PiTask) -> PiTask:
    """`task` when it names nothing on the server's host, else CallerError saying what to send."""
    from ..harbor import harbor_facts

    facts = harbor_facts(task)
    environment = facts.environment if facts is not None else None
    if environment is None:
        return task
    named = [
        f"metadata.harbor.environment.{name}"
        for name, value in (("dockerfile", environment.dockerfile), ("context", environment.context))
        if value is not None
    ]
    if named:
        raise CallerError(
            f"task: {' and '.join(named)} name files on the server's host; a remote caller's task is "
            "data only and cannot name host files or directories. Send the environment as the task's "
            "own data instead (files: {path: text} and setup commands), or have the server's "
            "operator run the Harbor task from their own task directory (pi-env run / collect)"
        )
    return task


# -- a caller's base URL -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Url:
    scheme: str
    host: str
    port: int
    segments: tuple[str, ...]

    def text(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        netloc = host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"
        return urlunsplit((self.scheme, netloc, "/" + "/".join(self.segments), "", ""))

    def under(self, allowed: _Url) -> bool:
        """Same scheme, host and port, and the path at or below the allowed one."""
        return (self.scheme, self.host, self.port) == (allowed.scheme, allowed.host, allowed.port) and self.segments[
            : len(allowed.segments)
        ] == allowed.segments


def _parse(url: str, where: str, *, default_path: bool) -> _Url:
    """`url` taken apart; CallerError for anything but a plain http(s) URL."""

    def refuse(why: str) -> CallerError:
        return CallerError(f"{where}: {why}; give a plain http(s) base URL such as http://10.0.0.5:8000/v1")

    if any(ord(c) < 0x21 or c == "\x7f" for c in url):
        raise refuse("contains a space or a control character")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise refuse("is not an http(s) URL")
    if "@" in url:  # in the path too: parsers that disagree must not disagree about the host
        raise refuse("carries user info (user:password@); send a key as api_key")
    if "?" in url:
        raise refuse("carries a query string")
    if "#" in url:
        raise refuse("carries a fragment (#)")
    try:
        port = parts.port
    except ValueError:
        raise refuse("has an invalid port") from None
    host = parts.hostname
    if not host:
        raise refuse("has no host")
    if "%" in parts.path or "\\" in parts.path:
        raise refuse("has escapes or backslashes in its path")
    segments = tuple(parts.path.rstrip("/").split("/")[1:]) if parts.path.rstrip("/") else ()
    if any(segment in ("", ".", "..") for segment in segments):
        raise refuse("has empty, '.' or '..' segments in its path")
    if not segments and default_path:
        segments = ("v1",)  # the reference convention (pi_env.endpoints.normalize_base_url)
    return _Url(scheme, host, port or DEFAULT_PORTS[scheme], segments)


def allowed_base_urls() -> list[str]:
    """The operator's allowlist: the catalog's endpoints (as configured, else their defaults),
    this server's own engine, and every URL in PI_ENV_ALLOWED_BASE_URLS."""
    given = [os.environ.get(entry.url_env) or entry.default_url for entry in CATALOG.values()]
    given += [os.environ.get("PI_ENV_LOCAL_BASE_URL") or "", os.environ.get(ALLOW_ENV) or ""]
    return [url.strip() for value in given for url in value.split(",") if url.strip()]


def _allowlist() -> list[_Url]:
    parsed = []
    for url in allowed_base_urls():
        try:
            parsed.append(_parse(url, "allowlist", default_path=False))
        except CallerError:  # an operator's entry that is not a plain URL allows nothing
            continue
    return parsed


def caller_base_url(value: str, argument: str) -> str:
    """A caller's base URL (comma-separated: several replicas), each rebuilt from its parts and
    on the allowlist; CallerError naming the argument and the flag/variable otherwise."""
    rebuilt = []
    allowlist = _allowlist()
    for url in value.split(","):
        parsed = _parse(url.strip(), argument, default_path=True)
        if not any(parsed.under(allowed) for allowed in allowlist):
            raise CallerError(
                f"{argument}: {parsed.text()} is not on this server's allowlist of model endpoints; "
                f"the operator allows it with {ALLOW_HOW}"
            )
        rebuilt.append(parsed.text())
    return ",".join(rebuilt)


def configured_base_urls(name: str) -> set[str]:
    """The base URLs the server itself uses for catalog endpoint `name`, rebuilt alike."""
    entry = CATALOG[name]
    urls = set()
    for url in (os.environ.get(entry.url_env) or entry.default_url).split(","):
        try:
            urls.add(_parse(url.strip(), entry.url_env, default_path=True).text())
        except CallerError:
            continue
    return urls


# -- what the caller sees of an upstream error ----------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069]+")
_HEADER = re.compile(
    r"(?i)\b(authorization|proxy-authorization|cookie|set-cookie|x-[a-z0-9-]+|[a-z0-9-]*(?:key|token|secret|auth)"
    r"[a-z0-9-]*)\s*[:=]\s*\S+"
)
_SECRETISH = re.compile(r"(?i)\b(?:bearer|basic)\s+\S+|\b(?:sk|hf|key|tok|token)[-_][A-Za-z0-9._~+/=-]{6,}")


def short_text(text: str, limit: int = MAX_UPSTREAM_MESSAGE) -> str:
    """`text` on one line: control and invisible characters gone, header-like `Name: value`
    pairs (credentials, cookies, x-* headers) and bearer tokens masked, at most `limit` characters."""
    text = _CONTROL.sub(" ", text)
    text = _SECRETISH.sub("[masked]", text)
    text = _HEADER.sub(lambda match: match.group(1) + ": [masked]", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def short_upstream_error(text: str, status: int | None) -> str:
    """A turn's upstream error as the caller may see it. An error answer's body (status >= 400):
    the message of an OpenAI-style JSON error (`{"error": {"message": ...}}`, `{"error": "..."}`,
    `{"message"|"detail": "..."}`), shortened and cleaned, any other body only by its size (no
    raw body is echoed). Otherwise the gateway's own words (unreachable, a broken stream), cleaned."""
    if status is None or status < 400 or text == f"HTTP {status} (empty body)":
        return short_text(text)
    message = _error_message(text)
    if message is None:
        return f"HTTP {status}; upstream error body not shown ({len(text.encode('utf-8', 'replace'))} bytes, not a JSON error)"
    return f"HTTP {status}: " + (short_text(message) or "(empty message)")


_MESSAGE = re.compile(r'"message"\s*:\s*"((?:[^"\\]|\\.)*)')


def _error_message(body: str) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:  # the gateway keeps the first 4 KiB of a body: a long JSON error is cut
        partial = _MESSAGE.search(body) if body.lstrip().startswith("{") else None
        if partial is None:
            return None
        try:
            return json.loads('"' + partial.group(1).rstrip("\\") + '"')
        except ValueError:
            return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    for candidate in (error, data.get("message"), data.get("detail")):
        if isinstance(candidate, str):
            return candidate
    return None
