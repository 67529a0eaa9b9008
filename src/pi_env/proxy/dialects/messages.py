"""Anthropic's Messages API (`POST /v1/messages`, `?beta=true` too), as Claude Code speaks it: see base.py."""

from __future__ import annotations

from typing import Any

from pi_env.proxy.dialects.base import AnswerTranslator, Dialect, DialectCall, Route

ROUTES = frozenset({"/v1/messages", "/v1/messages?beta=true"})


class MessagesDialect(Dialect):
    name = "messages"

    def match(self, method: str, raw_path: str) -> Route | None:
        return Route() if method == "POST" and raw_path in ROUTES else None

    def to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        raise NotImplementedError

    def translator(self, call: DialectCall) -> AnswerTranslator:
        raise NotImplementedError

    def error_body(self, status: int, message: str, kind: str) -> bytes:
        raise NotImplementedError
