"""`PiTask`: one unit of work for the agent, and loading task sets from files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class TaskError(ValueError):
    """A task (or task file) is malformed; the message says where and what to fix."""


def check_relative_path(path: str, where: str) -> str:
    """A path inside the work dir: relative, no `..`, not empty."""
    if not path or not path.strip():
        raise ValueError(f"{where}: empty path; give a path relative to the work dir")
    if path.startswith("/") or path.startswith("~"):
        raise ValueError(f"{where}: {path!r} is absolute; give a path relative to the work dir")
    parts = PurePosixPath(path).parts
    if ".." in parts:
        raise ValueError(f"{where}: {path!r} contains '..'; paths must stay inside the work dir")
    if "\x00" in path:
        raise ValueError(f"{where}: {path!r} contains a NUL byte")
    if all(part == "." for part in parts):
        raise ValueError(f"{where}: {path!r} names the work dir itself, not a file")
    return path


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WriteStep(_Step):
    tool: Literal["write"]
    path: str
    content: str


class EditStep(_Step):
    tool: Literal["edit"]
    path: str
    old: str
    new: str


class BashStep(_Step):
    tool: Literal["bash"]
    command: str


class ReadStep(_Step):
    tool: Literal["read"]
    path: str


# One tool call per oracle turn (see pi_env.oracle).
SolutionStep = Annotated[Union[WriteStep, EditStep, BashStep, ReadStep], Field(discriminator="tool")]


class PhaseTimeouts(BaseModel):
    """Per-phase wall-clock limits in seconds; None falls back to the PiConfig default."""

    model_config = ConfigDict(extra="forbid")
    setup_s: float | None = Field(None, gt=0)
    agent_s: float | None = Field(None, gt=0)
    verify_s: float | None = Field(None, gt=0)


class TaskLimits(BaseModel):
    """What the task needs of its sandbox (Harbor's [environment] memory_mb / storage_mb); None
    falls back to the PiConfig default (max_total_memory_bytes, max_disk_bytes)."""

    model_config = ConfigDict(extra="forbid")
    memory_mb: int | None = Field(None, gt=0)
    storage_mb: int | None = Field(None, gt=0)


class PiTask(BaseModel):
    """A task: an instruction for the agent, commands around it, and files to stage.

    `files` are staged before setup; `verify_files` only after the agent has finished (the
    agent can neither read nor tamper with them). Keys of both are paths relative to the
    work dir. Reference aliases accepted on input: `upload_files` (= files) and
    `setup_shell` (a string, = one setup command).
    """

    model_config = ConfigDict(extra="forbid")

    task_id: str = ""
    instruction: str = Field(min_length=1)
    setup: list[str] = Field(default_factory=list)
    verify: list[str] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)
    verify_files: dict[str, str] = Field(default_factory=dict)
    solution: list[SolutionStep] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    timeouts: PhaseTimeouts = Field(default_factory=PhaseTimeouts)
    limits: TaskLimits = Field(default_factory=TaskLimits)
    setup_network: bool = True  # tasks often install packages during setup
    verify_network: bool = False

    @model_validator(mode="before")
    @classmethod
    def _reference_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "upload_files" in data:
            if "files" in data:
                raise ValueError("give either 'files' or its alias 'upload_files', not both")
            data["files"] = data.pop("upload_files")
        if "setup_shell" in data:
            shell = data.pop("setup_shell")
            if shell:
                data["setup"] = [shell, *data.get("setup", [])]
        return data

    @field_validator("files", "verify_files")
    @classmethod
    def _relative_keys(cls, files: dict[str, str], info) -> dict[str, str]:
        for path in files:
            check_relative_path(path, f"{info.field_name}[{path!r}]")
        return files

    @field_validator("solution")
    @classmethod
    def _relative_solution_paths(cls, steps):
        for index, step in enumerate(steps or []):
            if isinstance(step, (WriteStep, EditStep, ReadStep)):
                check_relative_path(step.path, f"solution[{index}].path")
        return steps

    @model_validator(mode="after")
    def _default_task_id(self) -> "PiTask":
        if not self.task_id:
            self.task_id = "task-" + self.digest()[:12]
        return self

    def digest(self) -> str:
        """A content hash of what defines the task (not its id or metadata)."""
        payload = self.model_dump(include={"instruction", "setup", "verify", "files", "verify_files"})
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    @classmethod
    def coerce(cls, value: "str | dict | PiTask") -> "PiTask":
        """Accept a PiTask, a dict (validated) or a plain instruction string."""
        if isinstance(value, PiTask):
            return value
        if isinstance(value, str):
            return cls(instruction=value)
        if isinstance(value, dict):
            return validate_task(value, source="task")
        raise TaskError(f"cannot make a task from {type(value).__name__}; give a str, dict or PiTask")

    @classmethod
    def from_file(cls, path: str | Path) -> "PiTask":
        path = Path(path)
        data = _read_json(path)
        if not isinstance(data, dict):
            raise TaskError(f"{path}: a task file holds one JSON object, found {type(data).__name__}")
        return validate_task(data, source=str(path))


def validate_task(data: dict, *, source: str) -> PiTask:
    try:
        return PiTask.model_validate(data)
    except ValidationError as error:
        raise TaskError(f"{source}: invalid task:\n{_describe(error)}") from None


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "task"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  - {where}: {message}")
    return "\n".join(lines)


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskError(f"{path}: no such task file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise TaskError(f"{path}: cannot read task file: {error}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise TaskError(f"{path}: not valid JSON (line {error.lineno}, column {error.colno}): {error.msg}") from None


def load_tasks(path: str | Path) -> list[PiTask]:
    """A task set: a JSONL file (one task per line), a JSON file (one task or a list), a
    directory of task JSON files (sorted by name), or a Harbor task directory or a directory of
    them (see pi_env.harbor). Task ids must be unique."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".json")
        if files:
            tasks = [PiTask.from_file(p) for p in files]
        else:
            from .harbor import harbor_task_dirs, load_harbor_tasks

            if not harbor_task_dirs(path):
                raise TaskError(f"{path}: directory holds no *.json task files and no Harbor task "
                                "(a directory with instruction.md and task.toml)")
            tasks = load_harbor_tasks(path)
    elif path.suffix == ".jsonl":
        tasks = _load_jsonl(path)
    else:
        data = _read_json(path)
        items = data if isinstance(data, list) else [data]
        tasks = []
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                raise TaskError(f"{path}[{index}]: expected a task object, found {type(item).__name__}")
            tasks.append(validate_task(item, source=f"{path}[{index}]"))
    seen: dict[str, int] = {}
    for index, task in enumerate(tasks):
        if task.task_id in seen:
            raise TaskError(f"{path}: task_id {task.task_id!r} appears twice (tasks {seen[task.task_id]} and {index})")
        seen[task.task_id] = index
    return tasks


def _load_jsonl(path: Path) -> list[PiTask]:
    tasks = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TaskError(f"{path}: no such task set") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            raise TaskError(f"{path}:{number}: not valid JSON (column {error.colno}): {error.msg}") from None
        if not isinstance(data, dict):
            raise TaskError(f"{path}:{number}: expected a task object, found {type(data).__name__}")
        tasks.append(validate_task(data, source=f"{path}:{number}"))
    if not tasks:
        raise TaskError(f"{path}: the task set is empty")
    return tasks
