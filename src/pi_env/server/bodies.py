"""`BoundedJsonBodies`: the API's POST bodies (/mcp, OpenEnv's /reset, /step, ...) are read at
most PI_ENV_MAX_BODY_BYTES (64 MiB) and must be UTF-8 JSON nested at most MAX_JSON_DEPTH deep,
else the caller gets 400/413 saying which, before any handler parses them (a 100k-deep or
non-UTF-8 body was an HTTP 500 inside the MCP transport). The web UI (/web) is Gradio's and has
its own limits. The checked body is handed on unchanged.
"""

from __future__ import annotations

import json
import os

from ..task import TaskError, parse_json

DEFAULT_MAX_BODY_BYTES = 64 << 20


class BoundedJsonBodies:
    def __init__(self, app, max_bytes: int | None = None):
        self.app = app
        self.max_bytes = max_bytes or int(os.environ.get("PI_ENV_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES))
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].startswith("/web"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _answer(
                    scope, send, 413, f"request body larger than {self.max_bytes} bytes (PI_ENV_MAX_BODY_BYTES)"
                )
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if body.strip():
            try:
                parse_json(body, "request body")
            except TaskError as error:
                return await _answer(scope, send, 400, str(error))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _answer(scope, send, status: int, message: str) -> None:
    if scope["path"].rstrip("/") == "/mcp":  # JSON-RPC's own parse error, so MCP clients show it
        payload = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": f"Parse error: {message}"}}
    else:
        payload = {"detail": message}
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
