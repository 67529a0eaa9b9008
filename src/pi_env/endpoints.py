"""The endpoint catalog: where model calls go. Explicit argument > environment variable > default.

A new endpoint is one `CatalogEntry` plus one line in `CATALOG`. `oracle` is the built-in
test double that replays a task's reference solution (see pi_env.oracle).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse

from ._urls import without_userinfo
from .config import PiConfig, TransparentProxy
from .errors import BadInputError


class EndpointError(BadInputError, ValueError):
    """The endpoint is unknown or incompletely configured; the message says what to set."""


# Pi auto-detects quirks from the URL, but it only ever sees the gateway's URL, so every
# entry states its compat explicitly. For servers that are not OpenAI itself (vLLM, SGLang, llama.cpp, ...):
# no `developer` role, no `store`, no `strict` on tools, `max_tokens` rather than
# `max_completion_tokens`.
OPEN_SERVER_COMPAT = {
    "supportsDeveloperRole": False,
    "supportsStore": False,
    "supportsStrictMode": False,
    "maxTokensField": "max_tokens",
}


@dataclass(frozen=True)
class Endpoint:
    name: str
    base_url: str
    api_key: str | None = field(default=None, repr=False)
    model: str = ""
    compat: dict = field(default_factory=dict)
    disable_thinking: bool = False
    synthetic: bool = False  # outputs come from a test double, not a model
    return_token_ids: bool | None = None  # does it honour `return_token_ids`? None: probe once
    max_top_logprobs: int = 20  # what it accepts for `top_logprobs`
    # Several replicas (docs/async-rl.md): every base URL, base_url first; empty: base_url alone.
    base_urls: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class CatalogEntry:
    url_env: str
    key_envs: tuple[str, ...]
    model_env: str
    default_url: str
    default_model: str | None
    compat: dict
    disable_thinking: bool = False
    return_token_ids: bool | None = None
    max_top_logprobs: int = 20


CATALOG: dict[str, CatalogEntry] = {
    "vllm": CatalogEntry(
        "VLLM_URL",
        ("VLLM_API_KEY",),
        "VLLM_MODEL",
        "http://127.0.0.1:8000/v1",
        None,
        OPEN_SERVER_COMPAT,
        disable_thinking=True,
        return_token_ids=None,
    ),
    "openai": CatalogEntry(
        "OPENAI_BASE_URL",
        ("OPENAI_API_KEY",),
        "OPENAI_MODEL",
        "https://api.openai.com/v1",
        "gpt-4o-mini",
        {"supportsDeveloperRole": True, "supportsStore": False, "maxTokensField": "max_completion_tokens"},
        return_token_ids=False,
    ),
    "hf_router": CatalogEntry(
        "HF_ROUTER_URL",
        ("HF_ROUTER_API_KEY", "HF_TOKEN"),
        "HF_ROUTER_MODEL",
        "https://router.huggingface.co/v1",
        None,
        {"supportsDeveloperRole": False, "supportsStore": False},
        return_token_ids=False,
        max_top_logprobs=5,
    ),  # the router caps at 5
}
ORACLE = "oracle"


def endpoint_names() -> list[str]:
    return [*CATALOG, ORACLE]


def normalize_base_url(url: str) -> str:
    """Validate a base URL and append `/v1` when it has no path (the reference convention)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise EndpointError(f"base_url {without_userinfo(url)!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
    url = url.rstrip("/")
    if parsed.path in ("", "/"):
        url += "/v1"
    return url


def _disable_thinking(config: PiConfig) -> bool | None:
    """transparent_proxy's `disable_thinking` (only it rewrites requests); None: the endpoint's default."""
    return config.mode.disable_thinking if isinstance(config.mode, TransparentProxy) else None


def resolve_endpoint(config: PiConfig) -> Endpoint:
    """The upstream for a non-oracle config. Raises EndpointError with what to set."""
    name = config.endpoint.name
    if name == ORACLE:
        raise EndpointError("the oracle endpoint is resolved per task (pi_env.oracle)")
    if isinstance(name, list) or name.startswith(("http://", "https://")):
        urls = base_urls(name)
        return Endpoint(
            name="url",
            base_url=urls[0],
            base_urls=urls if len(urls) > 1 else (),
            api_key=config.endpoint.api_key,
            model=_require_model(config.endpoint.model, "a raw URL endpoint"),
            compat=OPEN_SERVER_COMPAT,
            disable_thinking=bool(_disable_thinking(config)),
        )
    entry = CATALOG.get(name)
    if entry is None:
        raise EndpointError(f"unknown endpoint {name!r}; use one of {endpoint_names()} or an http(s) URL")
    base_url = config.endpoint.base_url or os.environ.get(entry.url_env) or entry.default_url
    api_key = config.endpoint.api_key or next((os.environ[k] for k in entry.key_envs if os.environ.get(k)), None)
    model = config.endpoint.model or os.environ.get(entry.model_env) or entry.default_model
    if name != "vllm" and not api_key:
        raise EndpointError(f"endpoint {name!r} needs an API key: pass --api-key or set {' or '.join(entry.key_envs)}")
    forced = _disable_thinking(config)
    disable_thinking = entry.disable_thinking if forced is None else forced
    urls = base_urls(base_url)
    return Endpoint(
        name=name,
        base_url=urls[0],
        base_urls=urls if len(urls) > 1 else (),
        api_key=api_key,
        model=_require_model(model, f"endpoint {name!r} (or set {entry.model_env})"),
        compat=entry.compat,
        disable_thinking=disable_thinking,
        return_token_ids=entry.return_token_ids,
        max_top_logprobs=entry.max_top_logprobs,
    )


def base_urls(value: str | list[str]) -> tuple[str, ...]:
    """One base URL or several (a list, or comma-separated), each normalized; the same URL twice
    is refused."""
    given = value if isinstance(value, list) else value.split(",")
    urls = tuple(normalize_base_url(url.strip()) for url in given)
    if len(set(urls)) < len(urls):
        raise EndpointError(f"the same base URL is given twice among the endpoint's {len(urls)} replicas")
    return urls


_probed: dict[str, tuple[bool, str, float | None]] = {}  # base URL -> (answer, why, retry after: monotonic)
_probe_lock = threading.Lock()
MIN_VLLM_FOR_TOKEN_IDS = (0, 10, 2)
PROBE_RETRY_S = 30.0  # a probe that got no answer (engine still starting, network) is tried again after this


def supports_return_token_ids(endpoint: Endpoint) -> tuple[bool, str]:
    """Whether to ask this endpoint for `return_token_ids`, and why. The catalog decides where it
    knows; otherwise a probe per base URL: vLLM serves GET /version at its root, and honours the
    field from 0.10.2 on. An answer is kept for the process's life; no answer (unreachable, a
    timeout, a 5xx) is asked again after PROBE_RETRY_S, so one slow engine start does not cost
    a whole run its ids. Never a silent guess: the reason is recorded."""
    if endpoint.return_token_ids is not None:
        return endpoint.return_token_ids, f"catalog entry {endpoint.name!r}"
    with _probe_lock:
        answer, why = False, ""
        for url in endpoint.base_urls or (endpoint.base_url,):  # several replicas: the first that answers
            known = _probed.get(url)
            if known is None or (known[2] is not None and time.monotonic() >= known[2]):
                known = _probed[url] = _probe_vllm_version(endpoint, url)
            answer, why, retry = known
            if retry is None:
                break
        return answer, why


def _probe_vllm_version(endpoint: Endpoint, base_url: str) -> tuple[bool, str, float | None]:
    request = urllib.request.Request(f"{base_url.removesuffix('/v1')}/version")
    root = without_userinfo(base_url.removesuffix("/v1"))  # as shown in the reasons
    if endpoint.api_key:
        request.add_header("Authorization", f"Bearer {endpoint.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            version = json.loads(response.read()).get("version", "")
    except urllib.error.HTTPError as error:
        retry = time.monotonic() + PROBE_RETRY_S if error.code >= 500 else None  # a 4xx is an answer
        return False, f"probe of {root}/version answered {error.code}: not a vLLM server, so not asked", retry
    except (OSError, ValueError, AttributeError) as error:
        return (
            False,
            (f"probe of {root}/version failed ({error}): not asked; probed again after {PROBE_RETRY_S:g} s"),
            time.monotonic() + PROBE_RETRY_S,
        )
    numbers = tuple(int(part) for part in re.findall(r"\d+", str(version))[:3])
    if numbers >= MIN_VLLM_FOR_TOKEN_IDS:
        return True, f"probe: vLLM {version} at {root}", None
    return False, f"probe: vLLM {version} at {root} is older than 0.10.2", None


def _require_model(model: str | None, what: str) -> str:
    if not model:
        raise EndpointError(f"no model given for {what}: pass --model")
    return model
