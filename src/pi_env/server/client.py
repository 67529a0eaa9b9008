"""`PiEnv`: the typed client of a pi-env server (`pi-env serve`, or a Space).

    from pi_env.server.client import PiEnv

    with PiEnv("http://127.0.0.1:8000") as env:                 # sync
        result = env.run_rollout(task, endpoint="oracle")       # -> RolloutResult

    async with PiEnv("http://127.0.0.1:8000") as env:           # async
        result = await env.arun_rollout(task, mode="transparent_proxy")

It speaks MCP over streamable HTTP (the official `mcp` SDK) to the server's /mcp, one
connection per call, so one PiEnv may serve many threads or tasks at once. The sync methods
run the async ones on pi-env's background event loop and return the result, never a
coroutine. `timeout_s` (default one hour) bounds a whole call, queue wait included; real
rollouts take minutes. Needs only the `mcp` package (no openenv).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from .._aio import run_sync
from ..errors import ServerCallError
from ..results import RolloutResult
from ..task import PiTask
from .limiter import ServerBusy

DEFAULT_TIMEOUT_S = 3600.0


# The server refused or failed the call (the message is the server's): pi_env.errors's
# ServerCallError, still importable here by its first name (not pi_env.errors.PiEnvError, the base).
PiEnvError = ServerCallError


class PiEnv:
    """A client of `pi-env serve` over MCP streamable HTTP: `run_rollout` (sync) and
    `arun_rollout` (async) return a `RolloutResult`. `timeout_s` bounds a whole call, queue
    included; `ServerBusy` and `ServerCallError` carry the server's message."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 30.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    # -- async -------------------------------------------------------------------------------
    async def arun_rollout(
        self,
        task: PiTask | dict | str | Path | None = None,
        *,
        on_progress: Callable[[str], None] | None = None,
        **arguments: Any,
    ) -> RolloutResult:
        """One rollout on the server. `task`: a PiTask, a task dict, a task JSON file or an
        instruction; or leave it out and pass the task fields (instruction=, verify=, ...).
        Other arguments as the MCP tool's (endpoint, model, api_key, mode, max_turns, ...).
        Raises ServerBusy when the server's queue is full, ServerCallError for anything it refused."""
        if task is not None:
            task = PiTask.from_file(task) if isinstance(task, Path) else PiTask.coerce(task)
            arguments["task"] = task.model_dump(mode="json", exclude_none=True)

        async def progress(done: float, total: float | None, message: str | None) -> None:
            if on_progress is not None and message:
                on_progress(message)

        result = await self._call("run_rollout", arguments, progress if on_progress else None)
        return RolloutResult.model_validate(result)

    async def alist_tools(self) -> list[dict[str, Any]]:
        async with self._session() as session:
            listed = await session.list_tools()
        return [tool.model_dump(mode="json") for tool in listed.tools]

    async def aendpoints(self) -> dict[str, Any]:
        """The server's GET /endpoints: which model endpoints it has configured, and its load."""
        async with httpx.AsyncClient(
            headers=self._headers, timeout=self.connect_timeout_s, verify=_ssl_context()
        ) as http:
            response = await http.get(f"{self.base_url}/endpoints")
        response.raise_for_status()
        return response.json()

    # -- sync (the same calls, results not coroutines) -------------------------------------------
    def run_rollout(
        self,
        task: PiTask | dict | str | Path | None = None,
        *,
        on_progress: Callable[[str], None] | None = None,
        **arguments: Any,
    ) -> RolloutResult:
        return run_sync(self.arun_rollout(task, on_progress=on_progress, **arguments))

    def list_tools(self) -> list[dict[str, Any]]:
        return run_sync(self.alist_tools())

    def endpoints(self) -> dict[str, Any]:
        return run_sync(self.aendpoints())

    def __enter__(self) -> PiEnv:
        return self

    def __exit__(self, *exc) -> None:
        pass  # nothing held between calls

    async def __aenter__(self) -> PiEnv:
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    # -- transport -------------------------------------------------------------------------------
    async def _call(self, name: str, arguments: dict[str, Any], progress) -> dict[str, Any]:
        watch = _CallStreamWatch()
        try:
            async with self._session(watch) as session:
                answer = await watch.guard(
                    session.call_tool(
                        name,
                        arguments,
                        read_timeout_seconds=timedelta(seconds=self.timeout_s),
                        progress_callback=progress,
                    )
                )
            if answer is None:
                raise ServerCallError(
                    f"{self.base_url}/mcp: the server closed the {name} call without an answer (it "
                    "stopped or crashed mid-call); the call's result is lost"
                )
        except BaseExceptionGroup as group:  # anyio task groups wrap the transport's errors
            raise ServerCallError(f"{self.base_url}/mcp: {_first_error(group)}") from None
        except httpx.HTTPError as error:
            raise ServerCallError(f"{self.base_url}/mcp: {error}") from None
        text = "".join(getattr(block, "text", "") for block in answer.content)
        if answer.isError:
            if text.startswith("busy:"):
                raise ServerBusy(text)
            raise ServerCallError(text or f"{name} failed")
        return answer.structuredContent or json.loads(text)

    @asynccontextmanager
    async def _session(self, watch: _CallStreamWatch | None = None):
        """One MCP connection: initialize, then the caller's requests."""
        timeout = httpx.Timeout(self.connect_timeout_s, read=self.timeout_s)
        hooks = {"response": [watch.on_response]} if watch is not None else {}
        async with (
            httpx.AsyncClient(headers=self._headers, timeout=timeout, verify=_ssl_context(), event_hooks=hooks) as http,
            streamable_http_client(f"{self.base_url}/mcp", http_client=http) as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


class _CallStreamWatch:
    """A watchdog for the one gap the MCP SDK leaves (python-sdk#1577): when the SSE stream
    answering a tools/call ends without the answer (the server stopped, crashed or dropped the
    connection), the SDK never resolves the call and its caller waits out `timeout_s`. This
    notices the stream's end; a call still unanswered a moment later is given up (None)."""

    GRACE_S = 10.0  # the answer, read just before the stream ended, reaches the caller well within this

    def __init__(self):
        self.ended = anyio.Event()

    async def on_response(self, response: httpx.Response) -> None:
        request = response.request
        if (
            request.method == "POST"
            and response.headers.get("content-type", "").startswith("text/event-stream")
            and b'"tools/call"' in _body(request)
        ):
            response.stream = _StreamEndSignal(response.stream, self.ended)

    async def guard(self, call):
        """The call's answer, or None when its stream ended and no answer came."""
        answer: list = []

        async with anyio.create_task_group() as group:

            async def run() -> None:
                try:
                    answer.append(await call)
                except Exception as error:  # noqa: BLE001 - raised below, outside the task group
                    answer.append(error)
                group.cancel_scope.cancel()

            async def watchdog() -> None:
                await self.ended.wait()
                await anyio.sleep(self.GRACE_S)
                group.cancel_scope.cancel()

            group.start_soon(run)
            group.start_soon(watchdog)
        if answer and isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0] if answer else None


class _StreamEndSignal(httpx.AsyncByteStream):
    def __init__(self, stream, ended: anyio.Event):
        self.stream, self.ended = stream, ended

    async def __aiter__(self):
        try:
            async for chunk in self.stream:
                yield chunk
        finally:
            self.ended.set()

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()
        finally:
            self.ended.set()


def _body(request: httpx.Request) -> bytes:
    try:
        return request.content
    except httpx.RequestNotRead:  # a streamed body: not a JSON-RPC message of the SDK's
        return b""


@functools.cache
def _ssl_context():
    """httpx's default context, built once: building it is most of a new client's cost (80 ms)."""
    return httpx.create_ssl_context()


def _first_error(group: BaseExceptionGroup) -> str:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}" + (
            " (wrong or missing token)" if error.response.status_code == 401 else ""
        )
    return f"{type(error).__name__}: {error}"
