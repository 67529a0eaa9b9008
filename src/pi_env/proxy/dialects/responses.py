"""OpenAI's Responses API (`POST /v1/responses`), as Codex speaks it: see base.py."""

from __future__ import annotations

from typing import Any

from pi_env.proxy.dialects.base import AnswerTranslator, Dialect, DialectCall, Route


class ResponsesDialect(Dialect):
    name = "responses"

    def match(self, method: str, raw_path: str) -> Route | None:
        return Route() if method == "POST" and raw_path == "/v1/responses" else None

    def to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        raise NotImplementedError

    def translator(self, call: DialectCall) -> AnswerTranslator:
        raise NotImplementedError

    def error_body(self, status: int, message: str, kind: str) -> bytes:
        raise NotImplementedError
