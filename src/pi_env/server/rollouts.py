"""What every door into the server shares: turning `run_rollout` arguments into a task and a
config (errors name the argument), the endpoint catalog as the server offers it, and running a
rollout in a worker thread under the shared limit, cancellable from the event loop.

Light on purpose (no openenv): the typed client and the tests import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, quote_plus, urlparse, urlunparse

from pydantic import ValidationError

from ..agent import agent_names
from ..config import BLACK_BOX, TRANSPARENT_PROXY, PiConfig
from ..config import MODES as CONFIG_MODES
from ..endpoints import CATALOG, ORACLE, EndpointError, resolve_endpoint
from ..errors import BadInputError
from ..results import RolloutEvent, RolloutResult
from ..task import PiTask, TaskError
from .callers import CallerError, caller_base_url, configured_base_urls, refuse_host_paths, short_upstream_error
from .limiter import RolloutLimiter

if TYPE_CHECKING:
    from ..rollout import PiSession

TASK_FIELDS = ("instruction", "setup", "verify", "files", "verify_files", "solution", "task_id")
# run_rollout's arguments (the reference's names) and the PiConfig paths they set; errors name
# what the caller sent. A mode setting the chosen mode has no use for is ignored, as it always was.
CONFIG_ARGUMENTS = {
    "endpoint": "endpoint.name",
    "base_url": "endpoint.base_url",
    "api_key": "endpoint.api_key",
    "model": "endpoint.model",
    "disable_thinking": f"mode.{TRANSPARENT_PROXY}.disable_thinking",
    "max_tokens_cap": "gateway.max_tokens",
    "top_logprobs": f"mode.{TRANSPARENT_PROXY}.top_logprobs",
    "agent_timeout_s": "limits.agent_timeout_s",
    "max_turns": "gateway.max_turns",
}
LOCAL = "local"  # the server's own engine, when PI_ENV_LOCAL_BASE_URL names one
MODES = (BLACK_BOX, TRANSPARENT_PROXY)  # interception_gate needs the trainer in-process


class BadArguments(BadInputError, ValueError):
    """A run_rollout call the server cannot run; the message names the argument and the fix."""


def build_rollout(
    arguments: dict[str, Any],
    *,
    sandbox_backend: str | None = None,
    agent: str | None = None,
    agent_version: str | None = None,
) -> tuple[PiTask, PiConfig]:
    """The task and config for one `run_rollout` call (`agent`, `agent_version`: the server's
    default agent and its version). None means "not given"."""
    given = {key: value for key, value in arguments.items() if value is not None}
    task_value = given.pop("task", None)
    task_fields = {key: given.pop(key) for key in TASK_FIELDS if key in given}
    if task_value is not None and task_fields:
        raise BadArguments(f"give either `task` or the task fields, not both (also got {sorted(task_fields)})")
    if task_value is None and "instruction" not in task_fields:
        raise BadArguments("instruction: required (or give a whole `task` object)")
    if isinstance(task_fields.get("setup"), str):  # the reference's setup_shell: one command
        task_fields["setup"] = [task_fields["setup"]]
    try:
        task = PiTask.coerce(task_value if task_value is not None else task_fields)
    except TaskError as error:
        raise BadArguments(str(error).replace("task: invalid task:", "task:", 1)) from None
    try:
        refuse_host_paths(task)  # a caller's task is data only
    except CallerError as error:
        raise BadArguments(str(error)) from None

    mode = given.pop("mode", BLACK_BOX)
    if mode not in MODES:
        raise BadArguments(f"mode: {mode!r} is not one of {list(MODES)}")
    endpoint = given.pop("endpoint", ORACLE)
    fields = {
        "endpoint": endpoint,
        "mode": mode,
        **{argument: given.pop(argument, None) for argument in CONFIG_ARGUMENTS if argument != "endpoint"},
        "sandbox_backend": sandbox_backend,
        "agent": given.pop("agent", None) or agent,
    }
    if fields["agent"] is not None and fields["agent"] not in agent_names():
        raise BadArguments(f"agent: {fields['agent']!r} is not one of {agent_names()}")
    if fields["agent"] is not None and fields["agent"] == agent and agent_version:
        fields["agent"] = {"name": agent, "version": agent_version}
    if given:
        raise BadArguments(f"unknown arguments {sorted(given)}")
    if endpoint == LOCAL:
        fields.update(local_engine(fields))
    try:
        config = sectioned_config(fields)
    except ValidationError as error:
        raise BadArguments(describe(error, {path: name for name, path in CONFIG_ARGUMENTS.items()})) from None
    if endpoint != LOCAL:  # the caller's URLs, once the rest is known good; `local` is the operator's
        caller_urls(fields)
        config = sectioned_config(fields)
    try:
        if config.endpoint.name == ORACLE:
            from ..oracle import solution_turns

            solution_turns(task)  # raises when the task has no solution to replay
        else:
            resolve_endpoint(config)
    except EndpointError as error:
        message = str(error).replace("pass --api-key", "give api_key").replace("pass --model", "give model")
        raise BadArguments(f"endpoint: {message}") from None
    return task, config


def sectioned_config(fields: dict[str, Any]) -> PiConfig:
    """The PiConfig of run_rollout's arguments (`CONFIG_ARGUMENTS`), the server's backend and agent."""
    sections: dict[str, Any] = {"mode": {"name": fields["mode"]}, "sandbox": {"backend": fields["sandbox_backend"]}}
    if fields["agent"] is not None:
        sections["agent"] = fields["agent"] if isinstance(fields["agent"], dict) else {"name": fields["agent"]}
    for argument, path in CONFIG_ARGUMENTS.items():
        value = fields[argument]
        section, *rest = path.split(".")
        if value is None:
            continue
        if section == "mode" and rest[0] != fields["mode"]:
            # The chosen mode has no use for it (as before, it is ignored), but it is checked as it always was.
            CONFIG_MODES[rest[0]].model_validate({rest[-1]: value})
            continue
        sections.setdefault(section, {})[rest[-1]] = value
    sections["sandbox"] = {k: v for k, v in sections["sandbox"].items() if v is not None}
    return PiConfig(**sections)


def caller_urls(fields: dict[str, Any]) -> None:
    """The caller's URLs (`endpoint` as a URL, `base_url`) rebuilt from their parts and on the
    operator's allowlist (callers.caller_base_url); a catalog endpoint sent to another base URL
    uses the caller's key, never the server's."""
    endpoint = fields["endpoint"]
    try:
        if isinstance(endpoint, str) and (":" in endpoint or "/" in endpoint):  # a URL, not a name
            fields["endpoint"] = caller_base_url(endpoint, "endpoint")
        if fields["base_url"] is not None:
            fields["base_url"] = caller_base_url(fields["base_url"], "base_url")
    except CallerError as error:
        raise BadArguments(str(error)) from None
    if (
        fields["base_url"] is not None
        and endpoint in CATALOG
        and not fields["api_key"]
        and set(fields["base_url"].split(",")) - configured_base_urls(endpoint)
    ):
        raise BadArguments(
            f"base_url: not the server's URL for endpoint {endpoint!r}, so the server's key is not sent "
            "there; give your own api_key"
        )


def describe(error: ValidationError, names: dict[str, str] | None = None) -> str:
    """A pydantic error as `field: what is wrong` lines, without echoing the input (it may be a key)."""
    names = names or {}
    lines = []
    for item in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in item["loc"])
        where = names.get(where, where) or "arguments"
        lines.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)


def local_engine(fields: dict) -> dict:
    url = os.environ.get("PI_ENV_LOCAL_BASE_URL")
    if not url:
        raise BadArguments("endpoint: 'local' is not configured on this server (it needs PI_ENV_LOCAL_BASE_URL)")
    return {
        "endpoint": url,
        "model": fields["model"] or os.environ.get("PI_ENV_LOCAL_MODEL"),
        "api_key": fields["api_key"] or os.environ.get("PI_ENV_LOCAL_API_KEY"),
    }


def catalog_summary() -> list[dict[str, Any]]:
    """Which endpoints this server can use, from its environment. No secrets: whether a key
    is set, never the key; URLs without user info."""
    rows = [
        {
            "name": ORACLE,
            "configured": True,
            "base_url": None,
            "model": "pi-env-oracle",
            "key_set": False,
            "note": "replays the task's `solution` through the real Pi (synthetic records)",
        }
    ]
    for name, entry in CATALOG.items():
        key_set = any(os.environ.get(env) for env in entry.key_envs)
        url = os.environ.get(entry.url_env) or entry.default_url
        model = os.environ.get(entry.model_env) or entry.default_model
        configured = (bool(os.environ.get(entry.url_env)) or key_set) if name == "vllm" else key_set
        rows.append(
            {
                "name": name,
                "configured": configured,
                "base_url": _public_url(url),
                "model": model,
                "key_set": key_set,
                "note": f"set {entry.url_env}, {' or '.join(entry.key_envs)}, {entry.model_env}",
            }
        )
    local = os.environ.get("PI_ENV_LOCAL_BASE_URL")
    rows.append(
        {
            "name": LOCAL,
            "configured": bool(local),
            "base_url": _public_url(local),
            "model": os.environ.get("PI_ENV_LOCAL_MODEL"),
            "key_set": bool(os.environ.get("PI_ENV_LOCAL_API_KEY")),
            "note": "this server's own engine: set PI_ENV_LOCAL_BASE_URL, PI_ENV_LOCAL_MODEL",
        }
    )
    return rows


def _public_url(url: str | None) -> str | None:
    if not url:
        return None
    if "," in url:  # several replicas
        return ",".join(_public_url(part.strip()) or "" for part in url.split(","))
    parsed = urlparse(url)
    return (
        urlunparse(parsed._replace(netloc=parsed.hostname + (f":{parsed.port}" if parsed.port else "")))
        if parsed.hostname
        else url
    )


def scrub(text: str, secret: str | None) -> str:
    """Remove a caller's key from free text that came from outside (an exception's message, a
    log line), in every form it may be quoted there: as is, JSON-escaped, repr-escaped,
    URL-encoded. Results never hold the key (it is not put in them), so they are not scrubbed:
    a key like "stop" or "true" must not rename `stop_reason` or break the JSON."""
    if not secret or len(secret) < 4:
        return text
    forms = {
        secret,
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
        repr(secret)[1:-1],
        quote(secret, safe=""),
        quote_plus(secret, safe=""),
    }
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, "***")
    return text


def scrub_result(data: dict[str, Any], secret: str | None) -> dict[str, Any]:
    """A result (JSON mode) as a caller gets it. An upstream's error body reaches the caller only
    as each turn's short, cleaned `upstream_error` (callers.short_upstream_error): wherever else
    the body was quoted (the error, the agent's and the gateway's logs, the agent's messages) it
    is replaced by a pointer to that. The caller's key is scrubbed from the free text that quotes
    the upstream only: the error, the gateway's log, each turn's upstream error (an upstream may
    echo the key in its error body). Structured fields and what the agent wrote are never
    touched (the agent never holds the key), so a key like "stop" leaves `stop_reason` and the
    agent's words."""
    bodies: set[str] = set()
    for turn in data.get("proxy_turns") or []:
        if isinstance(turn.get("upstream_error"), str):
            status = turn.get("upstream_status")
            if isinstance(status, int) and status >= 400:
                bodies.add(turn["upstream_error"])
            turn["upstream_error"] = short_upstream_error(scrub(turn["upstream_error"], secret), status)
    if bodies:
        forms = upstream_body_forms(bodies)
        for field in QUOTING_UPSTREAM:
            if field in data:
                data[field] = _without(data[field], forms)
    if not secret:
        return data
    for field in ("error", "proxy_log_tail"):
        if isinstance(data.get(field), str):
            data[field] = scrub(data[field], secret)
    return data


# Where an upstream's error body may be quoted: pi-env's error, the agent's and gateway's logs,
# the agent's messages and its own transcript (Pi records the failed call's error there).
QUOTING_UPSTREAM = ("error", "agent_log_tail", "proxy_log_tail", "messages", "pi_session_messages", "agent_transcript")
UPSTREAM_BODY = "[upstream error body: see proxy_turns' upstream_error]"
WINDOW = 16  # a quoted body is found by any run of this many of its characters


def upstream_body_forms(bodies: set[str]) -> set[str]:
    """Every WINDOW-character run of each body, as is and JSON-escaped (a log or a message may
    quote the body cut, re-indented or escaped); a shorter body whole."""
    forms: set[str] = set()
    for body in bodies:
        for text in {body, json.dumps(body)[1:-1], json.dumps(body, ensure_ascii=False)[1:-1]}:
            text = text.strip()
            if len(text) < WINDOW:
                forms.add(text) if len(text) >= 6 else None
            forms.update(text[i : i + WINDOW] for i in range(len(text) - WINDOW + 1))
    return forms


def _without(value: Any, forms: set[str]) -> Any:
    """`value` with each line that quotes an upstream body cut at the quote, UPSTREAM_BODY after."""
    if isinstance(value, str):
        return "".join(_line_without(line, forms) for line in value.splitlines(keepends=True))
    if isinstance(value, dict):
        return {key: _without(item, forms) for key, item in value.items()}
    if isinstance(value, list):
        return [_without(item, forms) for item in value]
    return value


def _line_without(line: str, forms: set[str]) -> str:
    for at in range(max(0, len(line) - WINDOW + 1)):
        if line[at : at + WINDOW] in forms:
            return line[:at] + UPSTREAM_BODY + ("\n" if line.endswith("\n") else "")
    for form in forms:
        if len(form) < WINDOW and form in line:
            return line.replace(form, UPSTREAM_BODY)
    return line


# A threading.Event set when the HTTP client of the current request disconnects (see
# app.DisconnectWatch); contextvars follow the request into the tool call's task.
client_gone: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("pi_env_client_gone", default=None)

# OpenEnv's doors (/ws, its JSON-RPC /mcp, /step) reach the tool through an in-process MCP
# client whose server task was started by another request, so the caller's `client_gone` does
# not follow the call there: the caller registers it here and the call carries the key in its
# MCP request `_meta` (CALLER_META).
CALLER_META = "pi_env_caller"
_callers: dict[str, threading.Event] = {}


@contextlib.contextmanager
def registered_caller(gone: threading.Event | None):
    """A key for `gone` while the call runs (None when there is nothing to watch)."""
    if gone is None:
        yield None
        return
    key = uuid.uuid4().hex
    _callers[key] = gone
    try:
        yield key
    finally:
        _callers.pop(key, None)


def caller_gone(key: Any) -> threading.Event | None:
    return _callers.get(key) if isinstance(key, str) else None


class RolloutService:
    """Runs rollouts in worker threads (never on the event loop) under one shared limit."""

    def __init__(
        self, max_running: int, max_waiting: int, sandbox_backend: str | None = None, agent: str | None = None
    ):
        self.limiter = RolloutLimiter(max_running, max_waiting)
        self.sandbox_backend = sandbox_backend
        self.agent = agent  # the default agent (`pi-env serve --agent`); a call's `agent` wins
        self.agent_version = os.environ.get("PI_ENV_AGENT_VERSION") or None
        self._executor = ThreadPoolExecutor(max_running, thread_name_prefix="pi-env-rollout")
        self._active: set[_Rollout] = set()

    @classmethod
    def from_env(cls) -> RolloutService:
        try:
            max_running = int(os.environ.get("MAX_CONCURRENT_ENVS", "4"))
            max_waiting = int(os.environ.get("PI_ENV_MAX_QUEUE", str(4 * max_running)))
        except ValueError as error:
            raise ValueError(f"MAX_CONCURRENT_ENVS / PI_ENV_MAX_QUEUE must be integers: {error}") from None
        environ = os.environ
        return cls(max_running, max_waiting, environ.get("PI_ENV_SANDBOX_BACKEND") or None, environ.get("PI_ENV_AGENT"))

    def build(self, arguments: dict[str, Any]) -> tuple[PiTask, PiConfig]:
        return build_rollout(
            arguments, sandbox_backend=self.sandbox_backend, agent=self.agent, agent_version=self.agent_version
        )

    async def run(
        self,
        task: PiTask,
        config: PiConfig,
        *,
        on_event: Callable[[RolloutEvent], None] | None = None,
        on_queued: Callable[[int], None] | None = None,
        gone: threading.Event | None = None,
    ) -> RolloutResult:
        """One rollout under the limit. Raises ServerBusy when the queue is full. Cancelling
        the awaiting task (the web UI's Cancel) or `gone` being set (default: the request's
        `client_gone`) closes the session, queued or running: the agent is killed and the
        sandbox deleted."""
        gone = gone or client_gone.get()
        async with self.limiter.slot(on_queued, gone=gone):
            rollout = _Rollout(task, config, on_event)
            self._active.add(rollout)
            future = asyncio.get_running_loop().run_in_executor(self._executor, rollout.run)
            try:
                while True:
                    done, _ = await asyncio.wait({future}, timeout=0.2)
                    if done:
                        return future.result()
                    if gone is not None and gone.is_set():
                        rollout.cancel()
                        raise asyncio.CancelledError("the client went away")
            except BaseException:
                rollout.cancel()
                raise
            finally:
                self._active.discard(rollout)

    def shutdown(self) -> None:
        """Server shutdown: close every running rollout (agents killed, sandboxes deleted)."""
        for rollout in list(self._active):
            rollout.cancel(wait=True)
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Rollout:
    """One rollout on a worker thread; `cancel()` from any thread closes its session."""

    def __init__(self, task: PiTask, config: PiConfig, on_event):
        self.task, self.config, self.on_event = task, config, on_event
        self.session: PiSession | None = None
        self.cancelled = False
        self._lock = threading.Lock()

    def run(self) -> RolloutResult:
        from ..rollout import PiSessionFactory

        session = None
        try:
            session = PiSessionFactory(self.config).create(self.task, on_event=self.on_event, on_session=self._started)
            if self.cancelled:  # cancelled during setup: nobody waits for the result
                raise asyncio.CancelledError("cancelled during setup")
            return session.wait_for_completion()
        finally:
            if session is not None:
                session.close()

    def _started(self, session: PiSession) -> None:
        """The session exists (its sandbox not yet): from now on cancel() closes it, even
        mid-setup."""
        with self._lock:
            self.session = session
            cancelled = self.cancelled
        if cancelled:
            session.close()

    def cancel(self, wait: bool = False) -> None:
        with self._lock:
            self.cancelled = True
            session = self.session
        if session is not None:
            # close() kills the agent and deletes the sandbox; off the caller's (event loop) thread.
            closer = threading.Thread(target=session.close, name="pi-env-cancel", daemon=True)
            closer.start()
            if wait:
                closer.join(30)
