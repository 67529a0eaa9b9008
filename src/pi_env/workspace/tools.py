"""Pi's four tools (read, write, edit, bash) as in-process functions over a bounded workspace.

The workspace is a dict of UTF-8 text files held by the host (the task's starting files plus
what the model writes); paths never touch the host filesystem, so there is nothing to escape
to. Only `bash` runs anything: `<runtime> <file>` for the task's language, in the local
bubblewrap sandbox (no network, own uid, process and memory limits, a timeout), with a fresh
copy of the workspace beside the program at every run.

Every result is a JSON object: {"schema", "tool", "status", ...fields}. Status `ok`; `error`
(the call failed in a way the model can fix: bad path, no match, the program failed);
`submission_error` (bash was asked for something it does not run); `infrastructure_error`
(the machine failed: sandbox unavailable, runtime not installed), never the model's fault.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pi_env.task import check_relative_path
from pi_env.workspace.tasks import SANDBOX_BIN_DIRS, WorkspaceTask

if TYPE_CHECKING:
    from pi_env.sandbox import Sandbox

RESULT_SCHEMA = "pi-env.workspace.tool-result/v1"
STATUSES = ("ok", "error", "submission_error", "infrastructure_error")
RUN_DIR = "/root/run"  # each program run gets a fresh copy of the workspace here


@dataclass(frozen=True)
class WorkspaceLimits:
    max_files: int = 32
    max_file_bytes: int = 64 << 10
    max_total_bytes: int = 512 << 10
    max_path_chars: int = 200
    read_chars: int = 16_000  # a read returns at most this much of a file
    output_chars: int = 4_000  # the tail of stdout/stderr kept in a bash result
    timeout_s: float = 10.0
    max_processes: int = 64  # RLIMIT_NPROC of the sandbox uid: fork bombs stop here
    max_memory_bytes: int = 1 << 30  # RLIMIT_DATA
    max_output_file_bytes: int = 8 << 20  # RLIMIT_FSIZE and the size of the sandbox's /tmp


def _spec(description: str, **properties: str) -> dict[str, Any]:
    """A tool's description and JSON schema: every argument is a required string."""
    return {
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {name: {"type": "string", "description": text} for name, text in properties.items()},
            "required": list(properties),
            "additionalProperties": False,
        },
    }


_PATH = "Path relative to the workspace"
TOOL_SPECS: dict[str, dict[str, Any]] = {
    "read": _spec("Read a text file of the workspace.", path=_PATH),
    "write": _spec("Create or overwrite a text file of the workspace.", path=_PATH, content="The whole new content"),
    "edit": _spec(
        "Replace text in a file: oldText must occur exactly once.",
        path=_PATH,
        oldText="Exact text to replace (must match once)",
        newText="Replacement text",
    ),
    "bash": _spec(
        "Run a program you wrote: exactly `<runtime> <file>` (for example `python3 solution.py`), "
        "in a sandbox with the workspace files beside it.",
        command="`<runtime> <relative-file>`",
    ),
}


def tool_schemas() -> list[dict[str, Any]]:
    """OpenAI-style function tool schemas of the four tools."""
    return [{"type": "function", "function": {"name": name, **spec}} for name, spec in TOOL_SPECS.items()]


def _tail(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[-limit:], True)


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


class Workspace:
    """The files of one episode and the tools over them. Not shared between episodes: close()
    (or `with`) deletes the sandbox the first bash call created."""

    def __init__(self, task: WorkspaceTask, *, limits: WorkspaceLimits | None = None, backend: str = "local"):
        self.task = task
        self.limits = limits or WorkspaceLimits()
        self.backend = backend
        self.files: dict[str, str] = dict(task.files)
        self.authored: set[str] = set()  # written or edited by the model: only these may run
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()  # tool calls change shared state: one at a time
        self._sandbox_lock = threading.Lock()  # close() must not wait for a running program
        self._closed = False

    # -- entry point

    def call(self, name: str, args: Any) -> dict[str, Any]:
        """Run tool `name` with `args` (a dict, or its JSON text); always returns a result."""
        if name not in TOOL_SPECS:
            return self._result(name, "error", error=f"unknown tool {name!r}; the tools are {', '.join(TOOL_SPECS)}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                return self._result(name, "error", error=f"arguments are not valid JSON: {exc}")
        if not isinstance(args, dict):
            return self._result(name, "error", error=f"arguments must be a JSON object, got {type(args).__name__}")
        params = TOOL_SPECS[name]["parameters"]
        for key in args:
            if key not in params["properties"]:
                return self._result(
                    name, "error", error=f"unknown argument {key!r}; {name} takes {', '.join(params['properties'])}"
                )
        for key in params["required"]:
            if key not in args:
                return self._result(name, "error", error=f"missing argument {key!r}")
            if not isinstance(args[key], str):
                return self._result(
                    name, "error", error=f"argument {key!r} must be a string, got {type(args[key]).__name__}"
                )
        with self._lock:
            if self._closed:
                return self._result(name, "infrastructure_error", error="the workspace is closed")
            return getattr(self, "_" + name)(**args)

    def read(self, path: str) -> dict[str, Any]:
        return self.call("read", {"path": path})

    def write(self, path: str, content: str) -> dict[str, Any]:
        return self.call("write", {"path": path, "content": content})

    def edit(self, path: str, oldText: str, newText: str) -> dict[str, Any]:
        return self.call("edit", {"path": path, "oldText": oldText, "newText": newText})

    def bash(self, command: str) -> dict[str, Any]:
        return self.call("bash", {"command": command})

    # -- the tools

    def _read(self, path: str) -> dict[str, Any]:
        checked, why = self._check_path(path)
        if why:
            return self._result("read", "error", path=path, error=why)
        if checked not in self.files:
            return self._result(
                "read",
                "error",
                path=checked,
                error=f"no file {checked!r}; the workspace holds {', '.join(sorted(self.files)) or 'no files'}",
            )
        content, truncated = self.files[checked], False
        if len(content) > self.limits.read_chars:
            content, truncated = content[: self.limits.read_chars], True
        return self._result(
            "read", "ok", path=checked, content=content, bytes=len(self.files[checked].encode()), truncated=truncated
        )

    def _write(self, path: str, content: str) -> dict[str, Any]:
        checked, why = self._check_path(path)
        return self._store("write", path, checked, content, why)

    def _edit(self, path: str, oldText: str, newText: str) -> dict[str, Any]:
        checked, why = self._check_path(path)
        content = ""
        if why is None and checked not in self.files:
            why = f"no file {checked!r} to edit; write it first"
        if why is None and not oldText:
            why = "oldText is empty; give the exact text to replace"
        if why is None:
            count = self.files[checked].count(oldText)
            if count != 1:
                why = (
                    f"oldText occurs {count} times in {checked!r}; it must match exactly once "
                    "(include more surrounding text)"
                    if count
                    else f"oldText not found in {checked!r}"
                )
        if why is None:
            content = self.files[checked].replace(oldText, newText, 1)
        return self._store("edit", path, checked, content, why)

    def _store(self, tool: str, path: str, checked: str, content: str, why: str | None) -> dict[str, Any]:
        """The end of write and edit: refuse with `why`, or check the bounds and keep it."""
        if why is None:
            why = self._check_content(checked, content)
        if why:
            return self._result(tool, "error", path=path, error=why)
        self.files[checked] = content
        self.authored.add(checked)
        return self._result(tool, "ok", path=checked, bytes_written=len(content.encode()))

    def _bash(self, command: str) -> dict[str, Any]:
        lang = self.task.lang
        usage = f"run your program as `{self.task.command}` (this task's language is {lang.name})"
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            return self._result(
                "bash", "submission_error", command=command, error=f"cannot parse the command ({exc}); {usage}"
            )
        if len(argv) != 2 or argv[0] not in lang.commands:
            return self._result(
                "bash",
                "submission_error",
                command=command,
                error=f"bash only runs `<runtime> <file>` with runtime {' or '.join(lang.commands)}; {usage}",
            )
        program, why = self._check_path(argv[1])
        if why is None and program not in self.files:
            why = f"no file {program!r}; write it first"
        elif why is None and program not in self.authored:
            why = f"{program!r} was not written by you; only a program you wrote or edited may run"
        if why:
            return self._result("bash", "submission_error", command=command, error=why)
        runtime = lang.runtime_path()
        if runtime is None:
            return self._result(
                "bash",
                "infrastructure_error",
                command=command,
                error=f"the {lang.name} runtime `{lang.binary}` is not installed on this "
                f"machine (looked in {', '.join(SANDBOX_BIN_DIRS)})",
            )
        from pi_env.sandbox import SandboxError

        try:
            sandbox = self._open_sandbox()
            sandbox.remove(RUN_DIR)  # nothing a previous run left (or planted) survives
            for path, content in self.files.items():
                sandbox.write_file(f"{RUN_DIR}/{path}", content)
            done = sandbox.exec([runtime, program], cwd=RUN_DIR, timeout_s=self.limits.timeout_s, network="none")
        except (SandboxError, OSError) as exc:
            return self._result(
                "bash", "infrastructure_error", command=command, error=f"sandbox failure: {type(exc).__name__}: {exc}"
            )
        if self._closed:  # killed by close(): the program's fate says nothing about it
            return self._result(
                "bash", "infrastructure_error", command=command, error="the workspace was closed while the program ran"
            )
        stdout, stdout_truncated = _tail(done.stdout, self.limits.output_chars)
        stderr, stderr_truncated = _tail(done.stderr, self.limits.output_chars)
        succeeded = done.exit_code == 0 and not done.timed_out
        output_correct = succeeded and _last_line(done.stdout) == str(self.task.expected)
        fields: dict[str, Any] = {
            "command": command,
            "returncode": done.exit_code,
            "timed_out": done.timed_out,
            "stdout": stdout,
            "stderr": stderr,
            "stdout_truncated": stdout_truncated,
            "stderr_truncated": stderr_truncated,
            "duration_s": round(done.duration_s, 3),
            "output_correct": output_correct,
        }
        if done.timed_out:
            fields["error"] = f"timed out after {self.limits.timeout_s:g} s and was killed"
        elif not succeeded:
            fields["error"] = f"the program exited with code {done.exit_code}"
        return self._result("bash", "ok" if succeeded else "error", **fields)

    # -- helpers

    def _open_sandbox(self) -> Sandbox:
        from pi_env.sandbox import SandboxError, SandboxLimits, SandboxSpec, get_backend

        with self._sandbox_lock:
            if self._closed:
                raise SandboxError("the workspace is closed")
            if self._sandbox is not None:
                return self._sandbox
            limits = SandboxLimits(
                max_processes=self.limits.max_processes,
                max_file_bytes=self.limits.max_output_file_bytes,
                max_memory_bytes=self.limits.max_memory_bytes,
                max_open_files=256,
            )
            self._sandbox = get_backend(self.backend).create(
                SandboxSpec(limits=limits, env={"PYTHONDONTWRITEBYTECODE": "1"})
            )
            return self._sandbox

    def _check_path(self, path: str) -> tuple[str, str | None]:
        """(normalised path, None) or (path, why it is refused)."""
        if len(path) > self.limits.max_path_chars:
            return path, f"path is longer than {self.limits.max_path_chars} characters"
        try:
            check_relative_path(path, "path")
        except ValueError as exc:
            return path, str(exc).replace("work dir", "workspace")
        if path.endswith("/"):
            return path, f"path: {path!r} names a directory; give a file path"
        if any(ord(ch) < 32 for ch in path):
            return path, f"path: {path!r} contains a control character"
        return posixpath.normpath(path), None

    def _check_content(self, path: str, content: str) -> str | None:
        try:
            size = len(content.encode("utf-8"))
        except UnicodeEncodeError as exc:
            return f"content is not valid UTF-8 text ({exc.reason})"
        if size > self.limits.max_file_bytes:
            return f"content is {size} bytes; a file may hold at most {self.limits.max_file_bytes}"
        if path not in self.files and len(self.files) >= self.limits.max_files:
            return f"the workspace already holds {len(self.files)} files (the limit)"
        total = sum(len(c.encode()) for p, c in self.files.items() if p != path) + size
        if total > self.limits.max_total_bytes:
            return f"the workspace would hold {total} bytes; the limit is {self.limits.max_total_bytes}"
        return None

    @staticmethod
    def _result(tool: str, status: str, **fields: Any) -> dict[str, Any]:
        return {"schema": RESULT_SCHEMA, "tool": tool, "status": status, **fields}

    def close(self) -> None:
        """Kill whatever still runs and delete the sandbox. Idempotent; safe from another
        thread while a program runs (that bash call then returns an infrastructure_error)."""
        with self._sandbox_lock:
            self._closed = True
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
