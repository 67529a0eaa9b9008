"""The OpenEnv server: `create_pi_app()` (and `app`, for `uvicorn pi_env.server.app:app`).

OpenEnv's `create_app` gives the routes every OpenEnv environment has (/health, /docs, /ws,
/reset, /step, /state, /metadata, /schema, its JSON-RPC POST /mcp) and mounts the web UI at
/web. pi-env adds:
- the MCP streamable-HTTP transport on /mcp, so the official MCP SDKs (and any MCP client) can
  connect: a request that speaks it (GET/DELETE, or a POST that accepts text/event-stream, as the
  protocol requires) goes to FastMCP's transport, OpenEnv's plain JSON-RPC POSTs to OpenEnv;
  both reach the same FastMCP server and tool;
- GET /endpoints: which model endpoints this server can use (no secrets), the load, and the
  health of each replica of an endpoint given as several base URLs;
- ServerGuard (auth.py): the bearer token (PI_ENV_AUTH_TOKEN) on every route but /health, the
  cookie for the web UI only, Origin checks, no CORS unless PI_ENV_CORS_ORIGINS lists origins;
- DisconnectWatch: a client that hangs up mid-rollout gets its sandbox deleted.

Settings (environment): MAX_CONCURRENT_ENVS (4) rollouts run at once, PI_ENV_MAX_QUEUE
(4 x that) more wait, beyond that a call is answered "busy" at once; PI_ENV_AUTH_TOKEN;
PI_ENV_SANDBOX_BACKEND; ENABLE_WEB_INTERFACE (default true here); the catalog's variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline, and nothing phoned home

from fastmcp import Context, FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.exceptions import ValidationError as ToolArgumentsError
from fastmcp.server.middleware import Middleware
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import ConcurrencyConfig, Observation, State
from pydantic import Field, ValidationError

from ..config import DEFAULT_MAX_TOKENS
from ..errors import error_kind_of
from .auth import ServerGuard, allowed_origins_from_env
from .bodies import BoundedJsonBodies
from .limiter import ServerBusy, idle_timeout_s
from .rollouts import (
    CALLER_META,
    BadArguments,
    RolloutService,
    caller_gone,
    catalog_summary,
    client_gone,
    describe,
    registered_caller,
    scrub,
    scrub_result,
)

log = logging.getLogger("pi_env.server")
# FastMCP logs a bad call's argument values; _CleanArgumentErrors reports it without them (a value may be a key).
logging.getLogger("fastmcp.server.server").addFilter(
    lambda record: not record.getMessage().startswith("Invalid arguments")
)
ROLLOUT_TOOL_TIMEOUT_S = 24 * 3600  # OpenEnv's default tool timeout is 30 s; a rollout takes minutes

INSTRUCTIONS = """pi-env runs the Pi coding agent on a task in an isolated sandbox against an
OpenAI-compatible endpoint and returns the scored rollout. Call `run_rollout` with a task
(instruction, setup, verify, files, ...) or a whole `task` object; the `oracle` endpoint replays
a task's `solution` (no model needed)."""


def build_mcp_server(service: RolloutService) -> FastMCP:
    mcp = FastMCP("pi-env", instructions=INSTRUCTIONS, mask_error_details=True)
    mcp.add_middleware(_CleanArgumentErrors())

    @mcp.tool
    async def run_rollout(
        instruction: Annotated[str | None, Field(description="what the agent is asked to do")] = None,
        setup: Annotated[list[str] | str | None, Field(description="shell commands before the agent, in order")] = None,
        verify: Annotated[
            list[str] | None,
            Field(
                description="shell commands after the agent; reward = "
                "fraction that pass, or the float one writes to "
                "$HOME/logs/verifier/reward.txt"
            ),
        ] = None,
        task_id: str | None = None,
        files: Annotated[dict[str, str] | None, Field(description="files staged before setup {path: text}")] = None,
        verify_files: Annotated[dict[str, str] | None, Field(description="files staged only after the agent")] = None,
        solution: Annotated[
            list[dict[str, Any]] | None, Field(description="reference steps the oracle endpoint replays")
        ] = None,
        task: Annotated[
            dict[str, Any] | None, Field(description="a whole task object instead of the task fields above")
        ] = None,
        endpoint: Annotated[
            str,
            Field(
                description="oracle, vllm, openai, hf_router, local, or an http(s) URL "
                "(GET /endpoints lists what is configured)"
            ),
        ] = "oracle",
        base_url: str | None = None,
        api_key: Annotated[str | None, Field(description="upstream key; never logged or returned")] = None,
        model: str | None = None,
        mode: Literal["black_box", "transparent_proxy"] = "black_box",
        agent: Annotated[
            str | None,
            Field(description="the coding agent: pi, opencode, qwen-code, mini-swe-agent (default: the server's)"),
        ] = None,
        disable_thinking: bool | None = None,
        max_tokens_cap: int = DEFAULT_MAX_TOKENS,
        top_logprobs: int = 5,
        agent_timeout_s: float = 600,
        max_turns: int | None = None,
        # injected by FastMCP (it must be annotated exactly Context, so not Context | None)
        ctx: Context = None,  # type: ignore[assignment]
    ) -> dict[str, Any]:
        """Run a coding agent (Pi unless `agent` names another) on one task in a fresh sandbox and return the scored
        RolloutResult (reward, verify results, files, conversation, per-turn records; with
        mode=transparent_proxy each turn's token ids and logprobs). At most MAX_CONCURRENT_ENVS
        rollouts run at once; a few more wait; beyond that the call fails with a "busy:" error."""
        arguments = {key: value for key, value in locals().items() if key in argument_names}
        try:
            task_, config = service.build(arguments)
        except BadArguments as error:
            raise ToolError(scrub(str(error), api_key)) from None
        on_event = _progress_reporter(ctx, asyncio.get_running_loop()) if ctx is not None else None
        try:
            result = await service.run(task_, config, on_event=on_event, gone=_caller_of(ctx))
        except ServerBusy as error:
            raise ToolError(str(error)) from None
        except Exception as error:  # noqa: BLE001 - sandbox or runtime unavailable, ...: said, never a trace
            log.warning("run_rollout failed: %s", scrub(str(error), api_key))
            kind = error_kind_of(error)  # pi_env.errors: the kind a rollout it ended would have
            raise ToolError(f"{kind}: {type(error).__name__}: {scrub(str(error), api_key)}") from None
        return scrub_result(result.model_dump(mode="json"), api_key)

    argument_names = set(inspect.signature(run_rollout.fn if hasattr(run_rollout, "fn") else run_rollout).parameters)
    argument_names.discard("ctx")
    return mcp


def _caller_of(ctx: Context | None):
    """The disconnect event an OpenEnv door registered for this call (see registered_caller)."""
    try:
        request = ctx.request_context if ctx is not None else None
    except (AttributeError, LookupError, ValueError):  # no MCP request (a direct call)
        return None
    meta = request.meta if request is not None else None
    return caller_gone(getattr(meta, CALLER_META, None)) if meta is not None else None


def _watch_callers(client) -> None:
    """Wrap the environment's in-process MCP client so each tool call carries its caller's
    `client_gone` (registered_caller) to the tool, whichever request started the client."""
    call_tool = client.call_tool

    async def call_tool_of_caller(name, arguments=None, *args, meta=None, **kwargs):
        with registered_caller(client_gone.get()) as key:
            if key is not None:
                meta = {**(meta or {}), CALLER_META: key}
            return await call_tool(name, arguments, *args, meta=meta, **kwargs)

    client.call_tool = call_tool_of_caller


class _CleanArgumentErrors(Middleware):
    """Arguments of the wrong type: `field: what is wrong`, never the value (it may be a key)."""

    async def on_call_tool(self, context, call_next):
        try:
            return await call_next(context)
        except ToolArgumentsError as error:
            cause = error.__cause__
            message = describe(cause) if isinstance(cause, ValidationError) else "invalid arguments"
            raise ToolError(message) from None


def _progress_reporter(ctx: Context, loop: asyncio.AbstractEventLoop):
    """RolloutEvents (on worker threads) as MCP progress notifications; sent only when the
    client asked for progress, and a client that went away is not an error here."""
    count = 0
    request_context = contextvars.copy_context()  # ctx reads the MCP request from contextvars

    async def send(progress: int, message: str) -> None:
        try:
            await ctx.report_progress(progress, None, message)
        except Exception:  # noqa: BLE001 - the disconnect is handled by DisconnectWatch
            pass

    def on_event(event) -> None:
        nonlocal count
        count += 1
        if event.kind == "turn":
            message = f"model call {event.turn.turn} ({event.turn.completion_tokens or 0} tokens)"
        elif event.kind == "done":
            message = f"done: reward {event.reward}" + (f" ({event.error_kind})" if event.error_kind else "")
        else:
            message = f"{event.phase} {'started' if event.kind == 'phase_start' else 'finished'}"
        loop.call_soon_threadsafe(asyncio.ensure_future, send(count, message), context=request_context)

    return on_event


class PiEnvironment(MCPEnvironment):
    """The OpenEnv environment: one MCP tool, `run_rollout`. Each call is a whole episode (a
    fresh sandbox, scored), so reset() only starts a new episode id and step() takes
    CallToolAction/ListToolsAction; rollouts share the server's limit, whichever route they use."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, mcp_server: FastMCP):
        super().__init__(mcp_server)
        _watch_callers(self.mcp_client)
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return Observation(done=False, reward=None, metadata={"tools": ["run_rollout"], "endpoints": catalog_summary()})

    async def _async_handle_call_tool(self, action: CallToolAction, timeout_s: float | None = None):
        self._state.step_count += 1
        return await super()._async_handle_call_tool(action, timeout_s=timeout_s or ROLLOUT_TOOL_TIMEOUT_S)

    def _step_impl(self, action, timeout_s: float | None = None, **kwargs) -> Observation:
        return Observation(
            done=False,
            reward=None,
            metadata={
                "error": f"unsupported action {type(action).__name__}: use CallToolAction(tool_name='run_rollout', ...)"
            },
        )

    @property
    def state(self) -> State:
        return self._state


def create_pi_app(service: RolloutService | None = None, *, web: bool | None = None):
    """The ASGI app. `web` None: ENABLE_WEB_INTERFACE (default on)."""
    service = service or RolloutService.from_env()
    mcp_server = build_mcp_server(service)
    if web is None:
        web = os.environ.get("ENABLE_WEB_INTERFACE", "true").lower() in ("1", "true", "yes")
    os.environ["ENABLE_WEB_INTERFACE"] = "true" if web else "false"  # how create_app is told
    builder = None
    if web:
        from .web import gradio_builder

        builder = functools.partial(gradio_builder, service)
    limits = service.limiter
    app = create_app(
        functools.partial(PiEnvironment, mcp_server),
        CallToolAction,
        CallToolObservation,
        env_name="pi_env",
        # Idle OpenEnv sessions (its HTTP MCP sessions) are reaped; sockets: DisconnectWatch.
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=limits.max_running + limits.max_waiting, session_timeout=idle_timeout_s()
        ),
        gradio_builder=builder,
        show_default_tab=False,
        title_override="pi-env",
    )
    app.title, app.description = "pi-env", INSTRUCTIONS
    mcp_app = mcp_server.http_app(path="/mcp", stateless_http=True)
    openenv_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_):
        async with mcp_app.router.lifespan_context(mcp_app):  # FastMCP's session manager
            async with openenv_lifespan(app_):
                try:
                    yield
                finally:
                    await asyncio.to_thread(service.shutdown)  # nothing left running on shutdown

    app.router.lifespan_context = lifespan

    @app.get("/endpoints", tags=["Environment Info"], summary="Model endpoints this server can use (no secrets)")
    async def endpoints() -> dict:
        from ..proxy.gateway import replica_health

        # Endpoints of several replicas this server's rollouts used: each replica's health.
        return {"endpoints": catalog_summary(), "rollouts": limits.snapshot(), "replicas": replica_health()}

    app.state.rollouts = service
    origins = allowed_origins_from_env()
    guarded = ServerGuard(
        BoundedJsonBodies(DisconnectWatch(McpDispatch(app, mcp_app))),
        os.environ.get("PI_ENV_AUTH_TOKEN") or None,
        origins,
    )
    hide_query_strings_in_logs()
    if not origins:
        return guarded
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(
        guarded,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "DELETE"],
        allow_headers=[
            "authorization",
            "content-type",
            "accept",
            "mcp-session-id",
            "mcp-protocol-version",
            "last-event-id",
        ],
        expose_headers=["mcp-session-id"],
    )


class _NoQueryStrings(logging.Filter):
    """uvicorn logs each request line and WebSocket handshake with its path: never its query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_path_only(arg) for arg in record.args)
        return True


def _path_only(value):
    if isinstance(value, str) and value.startswith("/") and "?" in value:
        return value.split("?", 1)[0] + "?…"
    return value


def hide_query_strings_in_logs() -> None:
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _NoQueryStrings) for existing in logger.filters):
            logger.addFilter(_NoQueryStrings())


class McpDispatch:
    """/mcp: MCP streamable HTTP (what MCP SDK clients speak) to FastMCP's transport, OpenEnv's
    plain JSON-RPC POSTs (MCPToolClient) to OpenEnv's handler."""

    def __init__(self, app, mcp_app):
        self.app, self.mcp_app = app, mcp_app
        self.state = app.state  # uvicorn/starlette look for app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/") == "/mcp" and _speaks_streamable_http(scope):
            scope = {**scope, "path": "/mcp"}
            return await self.mcp_app(scope, receive, send)
        return await self.app(scope, receive, send)


def _speaks_streamable_http(scope) -> bool:
    if scope["method"] != "POST":
        return True
    headers = dict(scope["headers"])
    return b"text/event-stream" in headers.get(b"accept", b"") or b"mcp-session-id" in headers


class DisconnectWatch:
    """Sets `client_gone` for the request when its HTTP client disconnects, so a rollout whose
    caller hung up is cancelled, queued or running (agent killed, sandbox deleted). Listens
    only once the request body has been read, so it never takes a body chunk from the app. A
    WebSocket (/ws, OpenEnv's /mcp socket) is read ahead instead: its handler awaits a whole
    rollout before it reads again, and would not see the close until then."""

    def __init__(self, app):
        self.app = app
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        gone = threading.Event()
        token = client_gone.set(gone)
        listener: asyncio.Task | None = None
        finished = False

        async def listen() -> None:
            message = await receive()
            if message["type"] == "http.disconnect" and not finished:
                gone.set()

        async def watched_receive():
            nonlocal listener
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body") and listener is None:
                listener = asyncio.ensure_future(listen())
            return message

        async def watched_send(message):
            nonlocal finished
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            finished = True
            client_gone.reset(token)
            if listener is not None:
                listener.cancel()

    async def _websocket(self, scope, receive, send):
        gone = threading.Event()
        token = client_gone.set(gone)
        inbox: asyncio.Queue = asyncio.Queue(maxsize=64)  # bounded: a flooding client waits
        idle_s = idle_timeout_s()
        state = {"answering": False, "last": time.monotonic(), "closed": False}

        async def read_ahead() -> None:
            while True:
                message = await receive()
                state["answering"], state["last"] = True, time.monotonic()
                if message["type"] == "websocket.disconnect":
                    gone.set()
                elif inbox.full():  # floods while its rollout runs: treated as gone
                    gone.set()
                    message = {"type": "websocket.disconnect", "code": 1008}
                await inbox.put(message)
                if message["type"] == "websocket.disconnect":
                    return

        async def answered(message) -> None:
            if state["closed"]:  # closed as idle: the handler's late words go nowhere
                return
            state["answering"], state["last"] = False, time.monotonic()
            await send(message)

        async def reap_when_idle() -> None:
            """A socket that has sent nothing for idle_s, with no call of its own running, is
            closed (1001) and its session ended, as OpenEnv's reaper ends idle HTTP sessions."""
            while True:
                await asyncio.sleep(min(1.0, idle_s / 4))
                if not state["answering"] and time.monotonic() - state["last"] > idle_s:
                    state["closed"] = True
                    with contextlib.suppress(Exception):
                        await send({"type": "websocket.close", "code": 1001, "reason": "idle"})
                    await inbox.put({"type": "websocket.disconnect", "code": 1001})
                    return

        reader = asyncio.ensure_future(read_ahead())
        reaper = asyncio.ensure_future(reap_when_idle())
        try:
            await self.app(scope, inbox.get, answered)
        finally:
            client_gone.reset(token)
            reader.cancel()
            reaper.cancel()


def __getattr__(name: str):
    # `uvicorn pi_env.server.app:app` (openenv.yaml, the Dockerfile): built on first access.
    if name == "app":
        globals()["app"] = application = create_pi_app()
        return application
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
