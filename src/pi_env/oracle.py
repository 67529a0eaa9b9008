"""The `oracle` endpoint: drives the real Pi through a task's reference `solution`, one tool
call per turn, then a final text message. Built on the scripted test server, so every record it
produces is marked synthetic. It proves a task is solvable and exercises the whole harness
without a model."""

from __future__ import annotations

import threading

from .endpoints import OPEN_SERVER_COMPAT, Endpoint, EndpointError
from .scripted import ScriptedServer, ScriptedToolCall, ScriptedTurn
from .task import BashStep, EditStep, PiTask, ReadStep, WriteStep

ORACLE_MODEL = "pi-env-oracle"
FINAL_MESSAGE = "Done: the reference solution has been applied."

_server: ScriptedServer | None = None
_server_lock = threading.Lock()


def solution_turns(task: PiTask) -> list[ScriptedTurn]:
    if not task.solution:
        raise EndpointError(
            f"task {task.task_id!r} has no solution; the oracle endpoint replays a task's "
            "`solution` steps, so add one or pick a model endpoint"
        )
    turns = []
    for index, step in enumerate(task.solution):
        if isinstance(step, WriteStep):
            call = ScriptedToolCall(name="write", arguments={"path": step.path, "content": step.content})
        elif isinstance(step, EditStep):
            call = ScriptedToolCall(
                name="edit", arguments={"path": step.path, "edits": [{"oldText": step.old, "newText": step.new}]}
            )
        elif isinstance(step, BashStep):
            call = ScriptedToolCall(name="bash", arguments={"command": step.command})
        elif isinstance(step, ReadStep):
            call = ScriptedToolCall(name="read", arguments={"path": step.path})
        else:  # pragma: no cover - the task model admits no other step
            raise EndpointError(f"solution[{index}]: unsupported step {step!r}")
        turns.append(ScriptedTurn(tool_calls=[call]))
    turns.append(ScriptedTurn(text=FINAL_MESSAGE))
    return turns


def _shared_server() -> ScriptedServer:
    global _server
    with _server_lock:
        if _server is None:
            _server = ScriptedServer(record_requests=0)  # long-lived: keeps nothing per request
            _server.start()
        return _server


def oracle_endpoint(task: PiTask) -> Endpoint:
    """Register the task's solution with the process-wide scripted server; the returned
    endpoint's api key selects that script. Release it with `release_oracle`."""
    turns: list[ScriptedTurn | dict] = [*solution_turns(task)]  # add_script also takes dict turns
    server = _shared_server()
    key = server.add_script(turns)
    return Endpoint(
        name="oracle",
        base_url=server.base_url,
        api_key=key,
        model=ORACLE_MODEL,
        compat=OPEN_SERVER_COMPAT,
        synthetic=True,
        return_token_ids=True,
    )


def release_oracle(endpoint: Endpoint) -> None:
    if _server is not None and endpoint.api_key:
        _server.remove_script(endpoint.api_key)
