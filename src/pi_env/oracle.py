"""The `oracle` endpoint: drives a coding agent through a task's reference `solution`, one tool
call per turn, then a final text message (or the agent's submit command). Built on the scripted
test server, so every record it produces is marked synthetic. It proves a task is solvable and
exercises the whole harness without a model.

Each answer is adapted to the tool list of the request it answers (its `tools`), by general
rules on names and parameter schemas, never a table per agent:
  - a write tool (name contains "write"; a path-like and a content-like string parameter), an
    edit tool (name contains "edit" or "replace"; old/new string parameters, or Pi's `edits`
    array of {oldText, newText}), a read tool (name contains "read" or "view"; a path
    parameter), a shell tool (name like bash / shell / exec; a `command` or `cmd` parameter,
    a string or an array of strings);
  - paths stay relative as the solution writes them, unless the path parameter (or, when it
    says nothing, the tool) asks for an absolute path: then `SANDBOX_WORKDIR/<path>`;
  - any other required parameter gets a neutral value of its type;
  - a tool that says the file must be read first gets a read of that file before it;
  - a step with no matching tool goes through the shell tool with an exact command (base64
    carries the bytes; an edit fails with a non-zero exit when its old text is missing);
  - a request with no tools (OpenCode's title call) gets a short text and changes nothing.
Pi's tool list gives exactly `solution_turns(task)`.
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .endpoints import OPEN_SERVER_COMPAT, Endpoint, EndpointError
from .sandbox import SANDBOX_WORKDIR
from .scripted import ScriptedServer, ScriptedToolCall, ScriptedTurn
from .task import BashStep, EditStep, PiTask, ReadStep, WriteStep

ORACLE_MODEL = "pi-env-oracle"
FINAL_MESSAGE = "Done: the reference solution has been applied."
TITLE_MESSAGE = "Reference solution"  # the answer to a request without tools (a title call)
NEUTRAL_TEXT = "Apply one step of the reference solution"  # a required string nobody reads
SHELL_CHUNK_BYTES = 48 << 10  # raw bytes per shell write: 64 KiB of base64, well under one argv string
MAX_ADAPTED = 16  # tool lists remembered per oracle script (an agent sends one or two)

_server: ScriptedServer | None = None
_server_lock = threading.Lock()


def solution_turns(task: PiTask) -> list[ScriptedTurn]:
    """The solution as Pi's tool calls (write/edit/bash/read with Pi's arguments), then a text."""
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


# ------------------------------------------------------------------------------ tool schemas


@dataclass(frozen=True)
class Tool:
    """One tool of a request, whatever its wire shape (Chat Completions, Responses, Anthropic)."""

    name: str
    description: str
    properties: dict[str, Any]
    required: tuple[str, ...]

    @classmethod
    def parse(cls, raw: Any) -> Tool | None:
        if not isinstance(raw, dict):
            return None
        function = raw.get("function")
        spec: dict[str, Any] = function if isinstance(function, dict) else raw
        name = spec.get("name")
        schema = spec.get("parameters", spec.get("input_schema", spec.get("parametersJsonSchema")))
        if not isinstance(name, str) or not name:
            return None
        schema = schema if isinstance(schema, dict) else {}
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        required = required if isinstance(required, list) else []
        description = spec.get("description")
        return cls(
            name,
            description if isinstance(description, str) else "",
            properties,
            tuple(r for r in required if isinstance(r, str)),
        )

    def param(self, accept: Callable[[str, dict[str, Any]], bool]) -> str | None:
        """The first parameter `accept(name, schema)` takes."""
        return next((n for n, s in self.properties.items() if isinstance(s, dict) and accept(n, s)), None)

    def call(self, arguments: dict[str, Any], operation: str) -> ScriptedToolCall:
        """A call of this tool: `arguments` (in their order), then a neutral value for every
        other required parameter."""
        filled = dict(arguments)
        for name in self.required:
            if name not in filled:
                schema = self.properties.get(name)
                filled[name] = neutral_value(schema if isinstance(schema, dict) else {}, operation)
        return ScriptedToolCall(name=self.name, arguments=filled)


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if isinstance(kind, str):
        return {kind}
    variants = schema.get("anyOf") or schema.get("oneOf") or []
    return {t for v in variants if isinstance(v, dict) for t in _types(v)}


def _is_string(schema: dict[str, Any]) -> bool:
    return "string" in _types(schema) or (not _types(schema) and "enum" not in schema)


def neutral_value(schema: dict[str, Any], operation: str) -> Any:
    """A value of the parameter's type that asks for nothing: the enum member naming the
    operation (else the first), a neutral text, false, the minimum number, empty."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return next((v for v in enum if isinstance(v, str) and operation in v.lower()), enum[0])
    if "default" in schema:
        return schema["default"]
    types = _types(schema) - {"null"}
    kind = next((t for t in ("string", "boolean", "integer", "number", "array", "object") if t in types), "string")
    if kind == "boolean":
        return False
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        return low if isinstance(low, (int, float)) and low > 0 else 0
    if kind == "array":
        return []
    if kind == "object":
        return {}
    return NEUTRAL_TEXT


PATH_NAMES = {"path", "filepath", "file", "filename", "absolutepath", "targetfile", "targetpath", "abspath"}
CONTENT_NAMES = {"content", "contents", "filetext", "text", "data", "body"}
COMMAND_NAMES = ("command", "cmd")
SHELL_NAMES = (re.compile(r"bash|shell", re.IGNORECASE), re.compile(r"exec|terminal|run_?command", re.IGNORECASE))
ALLOWS_RELATIVE = re.compile(r"relative\s+or\s+absolute|absolute\s+or\s+relative", re.IGNORECASE)
MENTIONS_ABSOLUTE = re.compile(r"\babsolute\b", re.IGNORECASE)
MENTIONS_RELATIVE = re.compile(r"\brelative\b", re.IGNORECASE)
# "you MUST use the Read tool first", "Always use the read_file tool to examine ... before",
# "Overwriting an existing file you haven't Read will fail" (Claude Code's Write)
READ_FIRST = re.compile(
    r"\b(?:must|always)\b[^.\n]{0,100}?\b(?:read|read_file|view)\b|\b(?:haven't|have not)\s+read\b", re.IGNORECASE
)


def _path_param(tool: Tool) -> str | None:
    def accept(name: str, schema: dict[str, Any]) -> bool:
        if not _is_string(schema):
            return False
        norm = _norm(name)
        return norm in PATH_NAMES or ("path" in norm and "dir" not in norm and "notebook" not in norm)

    return tool.param(accept)


def _wants_absolute(tool: Tool, path_param: str) -> bool:
    """The path parameter's description (else the tool's) asks for an absolute path."""
    described = tool.properties[path_param].get("description")
    for text in (described if isinstance(described, str) else "", tool.description):
        if ALLOWS_RELATIVE.search(text):
            return False
        if MENTIONS_ABSOLUTE.search(text):
            return True
        if MENTIONS_RELATIVE.search(text):
            return False
    return False


@dataclass(frozen=True)
class PathTool:
    """A file tool and how it takes a path."""

    tool: Tool
    path: str  # the parameter's name
    absolute: bool
    read_first: bool  # the tool says the file must be read before

    @classmethod
    def of(cls, tool: Tool) -> PathTool | None:
        path = _path_param(tool)
        if path is None:
            return None
        return cls(tool, path, _wants_absolute(tool, path), bool(READ_FIRST.search(tool.description)))

    def path_value(self, path: str) -> str:
        return posixpath.join(SANDBOX_WORKDIR, path) if self.absolute else path


@dataclass(frozen=True)
class WriteTool(PathTool):
    content: str = ""

    @classmethod
    def find(cls, tools: list[Tool]) -> WriteTool | None:
        for tool in tools:
            if "write" not in tool.name.lower():
                continue
            base = PathTool.of(tool)
            content = tool.param(lambda n, s: _norm(n) in CONTENT_NAMES and _is_string(s))
            if base is not None and content is not None and content != base.path:
                return cls(tool, base.path, base.absolute, base.read_first, content)
        return None

    def write(self, path: str, content: str) -> ScriptedToolCall:
        return self.tool.call({self.path: self.path_value(path), self.content: content}, "write")


def _old_new(properties: dict[str, Any]) -> tuple[str, str] | None:
    old = next(
        (n for n, s in properties.items() if _norm(n).startswith("old") and isinstance(s, dict) and _is_string(s)), None
    )
    new = next(
        (n for n, s in properties.items() if _norm(n).startswith("new") and isinstance(s, dict) and _is_string(s)), None
    )
    return (old, new) if old and new else None


@dataclass(frozen=True)
class EditTool(PathTool):
    old: str = ""
    new: str = ""
    edits: str | None = None  # Pi's shape: the array parameter whose items hold old/new

    @classmethod
    def find(cls, tools: list[Tool]) -> EditTool | None:
        direct, listed = None, None
        for tool in tools:
            if not any(word in tool.name.lower() for word in ("edit", "replace")):
                continue
            base = PathTool.of(tool)
            if base is None:
                continue
            pair = _old_new(tool.properties)
            if pair is not None and direct is None:
                direct = cls(tool, base.path, base.absolute, base.read_first, *pair)
            for name, schema in tool.properties.items():
                items = schema.get("items") if isinstance(schema, dict) and "array" in _types(schema) else None
                props = items.get("properties") if isinstance(items, dict) else None
                pair = _old_new(props) if isinstance(props, dict) else None
                if pair is not None and listed is None:
                    listed = cls(tool, base.path, base.absolute, base.read_first, *pair, edits=name)
        return direct or listed  # one old/new pair per call: the plain shape first

    def edit(self, path: str, old: str, new: str) -> ScriptedToolCall:
        if self.edits is None:
            return self.tool.call({self.path: self.path_value(path), self.old: old, self.new: new}, "replace")
        return self.tool.call(
            {self.path: self.path_value(path), self.edits: [{self.old: old, self.new: new}]}, "replace"
        )


@dataclass(frozen=True)
class ReadTool(PathTool):
    @classmethod
    def find(cls, tools: list[Tool]) -> ReadTool | None:
        for tool in tools:
            name = tool.name.lower()
            if ("read" in name or name == "view") and "write" not in name:
                base = PathTool.of(tool)
                if base is not None:
                    return cls(tool, base.path, base.absolute, base.read_first)
        return None

    def read(self, path: str) -> ScriptedToolCall:
        return self.tool.call({self.path: self.path_value(path)}, "read")


@dataclass(frozen=True)
class ShellTool:
    tool: Tool
    command: str
    argv: bool  # the command is an array of strings (["bash", "-c", command])

    @classmethod
    def find(cls, tools: list[Tool]) -> ShellTool | None:
        found = []  # (rank, shell): a name saying bash/shell first, then a string command
        for tool in tools:
            rank = next((r for r, pattern in enumerate(SHELL_NAMES) if pattern.search(tool.name)), None)
            for name in COMMAND_NAMES if rank is not None else ():
                schema = tool.properties.get(name)
                if not isinstance(schema, dict):
                    continue
                if _is_string(schema) or "array" in _types(schema):
                    argv = not _is_string(schema)
                    found.append((2 * (rank or 0) + argv, cls(tool, name, argv)))
                break
        return min(found, key=lambda ranked: ranked[0])[1] if found else None

    def run(self, command: str) -> ScriptedToolCall:
        value: Any = ["bash", "-c", command] if self.argv else command
        return self.tool.call({self.command: value}, "run")


# ------------------------------------------------------------------------- shell equivalents


def shell_write(path: str, data: bytes, *, append: bool = False) -> str:
    """Writes exactly `data` to `path` (parents created): base64 keeps every byte as it is."""
    encoded = base64.b64encode(data).decode("ascii")
    target = f"{'>>' if append else '>'} {shlex.quote(path)}"
    write = f"printf %s {encoded} | base64 -d {target}" if data else f": {target}"
    parent = posixpath.dirname(path)
    return f"mkdir -p -- {shlex.quote(parent)} && {write}" if parent and not append else write


def shell_writes(path: str, content: str) -> list[str]:
    """`shell_write` in pieces short enough for one command line each."""
    data = content.encode("utf-8")
    pieces = [data[i : i + SHELL_CHUNK_BYTES] for i in range(0, len(data), SHELL_CHUNK_BYTES)] or [b""]
    return [shell_write(path, piece, append=index > 0) for index, piece in enumerate(pieces)]


# Replaces the first occurrence of old by new, byte for byte; exits 1 (and says so) when old is missing.
EDIT_PROGRAM = (
    "import base64,sys;"
    "p,o,n=(base64.b64decode(a) for a in sys.argv[1:4]);"
    "d=open(p,'rb').read();i=d.find(o);"
    "i<0 and sys.exit('edit failed: the old text is not in '+p.decode(errors='replace'));"
    "open(p,'wb').write(d[:i]+n+d[i+len(o):])"
)


def shell_edit(path: str, old: str, new: str) -> str:
    args = " ".join(shlex.quote(base64.b64encode(s.encode("utf-8")).decode("ascii")) for s in (path, old, new))
    return f"python3 -c {shlex.quote(EDIT_PROGRAM)} {args}"


def shell_read(path: str) -> str:
    return f"cat -- {shlex.quote(path)}"


# ------------------------------------------------------------------------------- the adapter


@dataclass(frozen=True)
class Toolbox:
    """The tools of one request that the solution's steps map onto."""

    write: WriteTool | None
    edit: EditTool | None
    read: ReadTool | None
    shell: ShellTool | None

    @classmethod
    def of(cls, raw_tools: list[Any]) -> Toolbox:
        tools = [t for t in (Tool.parse(raw) for raw in raw_tools) if t is not None]
        read = ReadTool.find(tools)
        write, edit = WriteTool.find(tools), EditTool.find(tools)
        if read is None:  # a tool that must read first cannot be used without a read tool
            write = write if write is None or not write.read_first else None
            edit = edit if edit is None or not edit.read_first else None
        return cls(write, edit, read, ShellTool.find(tools))


def adapted_turns(task: PiTask, raw_tools: list[Any], submit_command: str | None = None) -> list[ScriptedTurn]:
    """The solution as calls of the tools in `raw_tools` (a request's `tools`), then the end."""
    if not task.solution:
        solution_turns(task)  # raises the same error
    box = Toolbox.of(raw_tools)
    calls: list[ScriptedToolCall | str] = []  # a str: the oracle cannot do this step (said as text)
    may_exist = set(task.files)
    anything_may_exist = bool(task.setup)

    def read_first(path: str) -> None:  # unless the call just before read that very file
        assert box.read is not None
        read = box.read.read(path)
        if not calls or calls[-1] != read:
            calls.append(read)

    def shell(command: str, what: str) -> ScriptedToolCall | str:
        if box.shell is None:
            return f"The oracle cannot {what}: this agent has no shell tool and no tool for it."
        return box.shell.run(command)

    for step in task.solution or []:
        if isinstance(step, WriteStep):
            if box.write is not None:
                if box.write.read_first and box.read and (anything_may_exist or step.path in may_exist):
                    read_first(step.path)
                calls.append(box.write.write(step.path, step.content))
            else:
                calls += [shell(c, f"write {step.path}") for c in shell_writes(step.path, step.content)]
            may_exist.add(step.path)
        elif isinstance(step, EditStep):
            if box.edit is not None:
                if box.edit.read_first and box.read:
                    read_first(step.path)
                calls.append(box.edit.edit(step.path, step.old, step.new))
            else:
                calls.append(shell(shell_edit(step.path, step.old, step.new), f"edit {step.path}"))
        elif isinstance(step, ReadStep):
            calls.append(box.read.read(step.path) if box.read else shell(shell_read(step.path), f"read {step.path}"))
        elif isinstance(step, BashStep):
            calls.append(shell(step.command, "run a command"))
            anything_may_exist = True  # a command may create any file
    turns: list[ScriptedTurn] = []
    for call in calls:
        if isinstance(call, str):  # stop here, saying why: the rest cannot follow
            return [*turns, ScriptedTurn(text=call)]
        turns.append(ScriptedTurn(tool_calls=[call]))
    if submit_command and box.shell is not None:
        turns.append(ScriptedTurn(tool_calls=[box.shell.run(submit_command)]))
    else:
        turns.append(ScriptedTurn(text=FINAL_MESSAGE))
    return turns


TITLE_TURN = ScriptedTurn(text=TITLE_MESSAGE)


class OracleScript:
    """The scripted server's adapter for one task: each request's script is the solution adapted
    to that request's tools (computed once per distinct tool list)."""

    def __init__(self, task: PiTask, submit_command: str | None = None):
        self.task = task
        self.submit_command = submit_command
        self._adapted: dict[str, list[ScriptedTurn]] = {}
        self._lock = threading.Lock()
        adapted_turns(task, [], submit_command)  # fails now, not on the first request, without a solution

    def __call__(self, body: dict[str, Any]) -> list[ScriptedTurn]:
        tools = body.get("tools")
        if not tools or not isinstance(tools, list) or body.get("tool_choice") == "none":
            # a side call (a title): text, and nothing advances (the turn index is its own count)
            messages = body.get("messages") or []
            count = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
            answer = _json_answer(body.get("response_format"))
            return [TITLE_TURN if answer is None else ScriptedTurn(text=answer)] * (count + 1)
        key = json.dumps(tools)
        with self._lock:
            turns = self._adapted.get(key)
            if turns is None:
                if len(self._adapted) >= MAX_ADAPTED:
                    self._adapted.clear()
                turns = self._adapted[key] = adapted_turns(self.task, tools, self.submit_command)
        return turns


def _json_answer(response_format: Any) -> str | None:
    """A side call that asks for JSON (Gemini CLI's next-speaker and loop checks): the smallest
    object its schema allows, its required properties neutral ("user" where an enum offers it,
    confidence 0), so the check says "go on as you would"; None: it asks for text."""
    if not isinstance(response_format, dict) or response_format.get("type") not in ("json_schema", "json_object"):
        return None
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or not isinstance(properties, dict):
        return "{}"
    required = [name for name in schema.get("required") or () if isinstance(properties.get(name), dict)]
    return json.dumps({name: neutral_value(properties[name], "user") for name in required})


def _shared_server() -> ScriptedServer:
    global _server
    with _server_lock:
        if _server is None:
            _server = ScriptedServer(record_requests=0)  # long-lived: keeps nothing per request
            _server.start()
        return _server


def oracle_endpoint(task: PiTask, *, submit_command: str | None = None) -> Endpoint:
    """Register the task's solution with the process-wide scripted server; the returned
    endpoint's api key selects that script, adapted on each request to the agent's tools.
    `submit_command`: the agent's `Agent.submit_command` (its last call runs it through the
    shell tool instead of a final text). Release it with `release_oracle`."""
    return script_endpoint(_shared_server(), task, submit_command)


def script_endpoint(server: ScriptedServer, task: PiTask, submit_command: str | None = None) -> Endpoint:
    """The oracle's script for `task` on `server` (the shared one, or an install's warm-up run's)."""
    key = server.add_script(OracleScript(task, submit_command))
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
