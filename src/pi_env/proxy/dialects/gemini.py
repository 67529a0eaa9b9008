"""Gemini's generateContent (`POST /v1beta/models/{model}:generateContent`, and
`:streamGenerateContent`, SSE with `?alt=sse`, else one JSON array streamed), as Gemini CLI
speaks it: see base.py."""

from __future__ import annotations

import re
from typing import Any

from pi_env.proxy.dialects.base import AnswerTranslator, Dialect, DialectCall, Route

# The model is one path segment of safe characters (no "/", no "%", no ".."): it never reaches
# the upstream anyway (the session's model does), but a target that is not this is refused.
_ROUTE = re.compile(r"/v1beta/models/([A-Za-z0-9._-]{1,200}):(generateContent|streamGenerateContent)(\?alt=sse)?")


class GeminiDialect(Dialect):
    name = "gemini"

    def match(self, method: str, raw_path: str) -> Route | None:
        found = _ROUTE.fullmatch(raw_path) if method == "POST" else None
        if found is None or found[1] in (".", ".."):
            return None
        streamed = found[2] == "streamGenerateContent"
        if not streamed and found[3]:
            return None
        return Route(model=found[1], streamed=streamed, framing="sse" if found[3] or not streamed else "json_array")

    def to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        raise NotImplementedError

    def translator(self, call: DialectCall) -> AnswerTranslator:
        raise NotImplementedError

    def error_body(self, status: int, message: str, kind: str) -> bytes:
        raise NotImplementedError
