"""Who may use the server, and from which web page: `ServerGuard` wraps the whole ASGI app.

- The bearer token (PI_ENV_AUTH_TOKEN), sent as `Authorization: Bearer <token>`, is the only way
  into the API: /mcp, /ws, OpenEnv's HTTP routes, /endpoints, /docs. Never in a URL.
- The cookie authenticates the web UI (/web and below) only: a browser cannot add the header to
  the UI's own requests. It is set by the login form at /web (the token is typed, never put in a
  URL), HttpOnly, SameSite=Strict, Path=/web, and ignored on every other route.
- Origin checks, with or without a token: a state-changing request (any method but GET, HEAD,
  OPTIONS) or a WebSocket handshake that carries an `Origin` must come from the server's own
  origin (or one listed in PI_ENV_CORS_ORIGINS); a cookie-authenticated one must carry it. A
  page on another port of the same host is same-site for the cookie but another origin, so
  neither a form, a no-cors fetch nor a `new WebSocket(...)` from it reaches a rollout.
- CORS is off unless PI_ENV_CORS_ORIGINS lists origins: the `access-control-*` headers the
  mounted apps (Gradio) add are dropped.
- The UI's pages carry a Content-Security-Policy that lets them load nothing from another
  origin (no image, media, font, style, script, frame or form target): what the agent wrote is
  shown as text (web.py), and should anything slip through it still cannot beacon out, phish
  to another host or be framed.
/health is open: it says nothing but "healthy".
"""

from __future__ import annotations

import hmac
import html
import json
import os
from urllib.parse import parse_qs, urlsplit

COOKIE = "pi_env_token"
OPEN_PATHS = ("/health",)
UI_PREFIX = "/web"
LOGIN_PATH = "/web/login"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# Gradio's page needs its inline bootstrap script and inline styles; nothing from elsewhere.
UI_CSP = (
    b"default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
    b"img-src 'self' data: blob:; media-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; "
    b"frame-src 'self'; worker-src 'self' blob:; object-src 'none'; base-uri 'self'; form-action 'self'; "
    b"frame-ancestors 'none'"
)
MAX_LOGIN_BODY = 4096


def allowed_origins_from_env() -> tuple[str, ...]:
    """PI_ENV_CORS_ORIGINS: comma-separated origins (scheme://host[:port]) that may call the API
    from a browser; empty (the default): none but the server's own."""
    return tuple(
        origin.strip().rstrip("/") for origin in os.environ.get("PI_ENV_CORS_ORIGINS", "").split(",") if origin.strip()
    )


class ServerGuard:
    def __init__(self, app, token: str | None, allowed_origins: tuple[str, ...] = ()):
        if token is not None and not token:
            raise ValueError("PI_ENV_AUTH_TOKEN is empty")
        self.app, self.token, self.allowed_origins = app, token, allowed_origins
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        origin = headers.get("origin")
        unsafe = scope["type"] == "websocket" or scope["method"] not in SAFE_METHODS
        if unsafe and origin is not None and not self._origin_allowed(origin, headers.get("host", "")):
            return await _refuse(
                scope,
                send,
                403,
                "forbidden: cross-origin request (the Origin is not this "
                "server's; list trusted origins in PI_ENV_CORS_ORIGINS)",
            )
        path = scope["path"]
        send = self._without_cors(send, ui=path == UI_PREFIX or path.startswith(UI_PREFIX + "/"))
        if self.token is None or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self._ok(_bearer(headers.get("authorization", ""))):
            return await self.app(scope, receive, send)
        in_ui = path == UI_PREFIX or path.startswith(UI_PREFIX + "/")
        if in_ui and self._ok(_cookie(headers.get("cookie", ""))):
            if unsafe and origin is None:  # a browser always sends Origin here; no Origin, no cookie
                return await _refuse(scope, send, 403, "forbidden: a cookie-authenticated change needs an Origin")
            return await self.app(scope, receive, send)
        if in_ui and scope["type"] == "http":
            if path == LOGIN_PATH and scope["method"] == "POST":
                return await self._login(scope, receive, send, origin)
            if scope["method"] == "GET" and path.rstrip("/") == UI_PREFIX:
                return await _login_page(send, 401)
        await _refuse(
            scope,
            send,
            401,
            "unauthorized: send 'Authorization: Bearer <PI_ENV_AUTH_TOKEN>' (browsers: sign in at /web)",
        )

    def _ok(self, presented: str) -> bool:
        assert self.token is not None, "__call__ lets every request through before asking without a token"
        return bool(presented) and hmac.compare_digest(presented.encode(), self.token.encode())

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/")
        return origin in self.allowed_origins or (bool(host) and urlsplit(origin).netloc == host)

    def _without_cors(self, send, ui: bool = False):
        """Drop the access-control-* headers the mounted apps add (Gradio allows any localhost
        origin); the UI's answers get UI_CSP."""

        async def filtered(message):
            if message["type"] == "http.response.start":
                headers = [
                    (name, value)
                    for name, value in message.get("headers", [])
                    if not name.lower().startswith(b"access-control-")
                ]
                if ui and not any(name.lower() == b"content-security-policy" for name, _ in headers):
                    headers.append((b"content-security-policy", UI_CSP))
                message = {**message, "headers": headers}
            await send(message)

        return filtered

    async def _login(self, scope, receive, send, origin: str | None) -> None:
        if origin is None:
            return await _refuse(scope, send, 403, "forbidden: sign in from the page at /web")
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > MAX_LOGIN_BODY:
                return await _refuse(scope, send, 413, "the sign-in form is too large")
            if not message.get("more_body"):
                break
        presented = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0]
        if not self._ok(presented):
            return await _login_page(send, 401, "Wrong token.")
        secure = "; Secure" if _scheme(scope, _headers(scope)) == "https" else ""
        cookie = f"{COOKIE}={self.token}; Path={UI_PREFIX}; HttpOnly; SameSite=Strict{secure}"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", f"{UI_PREFIX}/".encode()),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _headers(scope) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}


def _scheme(scope, headers: dict[str, str]) -> str:
    return headers.get("x-forwarded-proto", scope.get("scheme", "http")).split(",")[0].strip()


def _bearer(header: str) -> str:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _cookie(header: str) -> str:
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return ""


async def _refuse(scope, send, status: int, message: str) -> None:
    if scope["type"] == "websocket":  # before accept: the handshake is answered 403
        return await send({"type": "websocket.close", "code": 1008})
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps({"error": message}).encode()})


LOGIN_HTML = """<!doctype html><html><head><meta charset="utf-8"><title>pi-env: sign in</title></head>
<body><h1>pi-env</h1><p>This server needs its token (PI_ENV_AUTH_TOKEN).</p>{error}
<form method="post" action="{action}"><label>Token <input type="password" name="token" id="token"
autocomplete="current-password" autofocus></label> <button type="submit" id="sign-in">Sign in</button></form>
</body></html>"""


async def _login_page(send, status: int, error: str = "") -> None:
    page = LOGIN_HTML.format(action=LOGIN_PATH, error=f'<p id="error">{html.escape(error)}</p>' if error else "")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"cache-control", b"no-store"),
                (b"content-security-policy", b"default-src 'none'; form-action 'self'"),
                (b"x-frame-options", b"DENY"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": page.encode()})
