"""Optional bearer-token auth (PI_ENV_AUTH_TOKEN) for every route except /health.

API clients send `Authorization: Bearer <token>`. A browser cannot add that header to the web
UI's own requests, so visiting `/web?token=<token>` once sets an HttpOnly cookie that stands
for it (SameSite=Strict), and redirects to drop the token from the address bar.
"""

from __future__ import annotations

import hmac
import json
from urllib.parse import parse_qs

COOKIE = "pi_env_token"
OPEN_PATHS = ("/health",)


class BearerAuth:
    def __init__(self, app, token: str):
        if not token:
            raise ValueError("PI_ENV_AUTH_TOKEN is empty")
        self.app, self.token = app, token
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        query = parse_qs(scope.get("query_string", b"").decode())
        if scope["type"] == "http" and scope["path"].startswith("/web") and self._ok(query.get("token", [""])[0]):
            return await _redirect_with_cookie(send, scope["path"], self.token)
        if self._ok(_bearer(headers.get(b"authorization", b"").decode("latin-1"))) or \
                self._ok(_cookie(headers.get(b"cookie", b"").decode("latin-1"))):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "unauthorized: send 'Authorization: Bearer <PI_ENV_AUTH_TOKEN>' "
                                    "(browsers: open /web?token=<token> once)"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _ok(self, presented: str) -> bool:
        return bool(presented) and hmac.compare_digest(presented.encode(), self.token.encode())


def _bearer(header: str) -> str:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _cookie(header: str) -> str:
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return ""


async def _redirect_with_cookie(send, path: str, token: str) -> None:
    cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", path.encode()), (b"set-cookie", cookie.encode())]})
    await send({"type": "http.response.body", "body": b""})
