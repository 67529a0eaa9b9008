"""The API shapes the gateway speaks besides Chat Completions (see base.py): each is translated
into the one Chat Completions call the gateway sends, and its answer back.

| dialect     | routes                                                            | agent       |
|-------------|-------------------------------------------------------------------|-------------|
| `responses` | POST /v1/responses                                                | Codex       |
| `messages`  | POST /v1/messages (`?beta=true`)                                  | Claude Code |
| `gemini`    | POST /v1beta/models/{model}:generateContent / :streamGenerateContent | Gemini CLI |

Dialects are loaded on a session's first call in one (a Chat Completions agent loads none).
"""

from __future__ import annotations

import importlib
import threading

from pi_env.proxy.dialects.base import Dialect, Route

# name -> "module:Class"
DIALECTS = {
    "responses": "pi_env.proxy.dialects.responses:ResponsesDialect",
    "messages": "pi_env.proxy.dialects.messages:MessagesDialect",
    "gemini": "pi_env.proxy.dialects.gemini:GeminiDialect",
}
_loaded: list[Dialect] | None = None
_lock = threading.Lock()


def dialects() -> list[Dialect]:
    global _loaded
    with _lock:
        if _loaded is None:
            found = []
            for target in DIALECTS.values():
                module, _, name = target.partition(":")
                found.append(getattr(importlib.import_module(module), name)())
            _loaded = found
        return _loaded


def match_route(method: str, raw_path: str) -> tuple[Dialect, Route] | None:
    """The dialect whose route the request target is, and what the target says; None for none."""
    for dialect in dialects():
        route = dialect.match(method, raw_path)
        if route is not None:
            return dialect, route
    return None
