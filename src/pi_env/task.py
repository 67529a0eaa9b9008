"""`PiTask`: one unit of work for the agent, and loading task sets from files."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadInputError


class TaskError(BadInputError, ValueError):
    """A task (or task file) is malformed; the message says where and what to fix."""


MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 4096  # Linux's NAME_MAX and PATH_MAX
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # any phase limit beyond a week is a mistake (and 1e308 s overflows)
MAX_TASK_FILE_BYTES = 64 << 20  # a task file or one JSONL line
MAX_JSON_DEPTH = 100  # tasks nest a few levels; deeper is not a task (and recursion has limits)


def check_text(value: Any, where: str) -> None:
    """Every string in `value` is valid Unicode (a lone surrogate cannot be written to a file or
    a command line), and commands hold no NUL byte (no exec can carry one)."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(
                    f"{at}: holds a lone surrogate at character {error.start} (not valid Unicode); send UTF-8 text"
                ) from None
        elif isinstance(item, dict):
            stack.extend((v, f"{at}[{k!r}]") for k, v in item.items())
            stack.extend((k, f"{at} key {k!r}") for k in item if isinstance(k, str))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))


def check_command(command: str, where: str) -> str:
    if "\x00" in command:
        raise ValueError(f"{where}: contains a NUL byte, which no command line can carry")
    return command


def json_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (iteratively: any depth)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(text: str | bytes, where: str) -> Any:
    """JSON from a file, a line or a request, as a TaskError naming `where` when it is not valid
    UTF-8 JSON or nests deeper than MAX_JSON_DEPTH."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise TaskError(f"{where}: not UTF-8 (byte {error.start}); save it as UTF-8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise TaskError(f"{where}: not valid JSON (line {error.lineno}, column {error.colno}): {error.msg}") from None
    except RecursionError:
        raise TaskError(f"{where}: JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise TaskError(f"{where}: JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return value


def read_bounded(path: Path, what: str, limit: int = MAX_TASK_FILE_BYTES) -> bytes:
    """A whole file, but never more than `limit` bytes (`/dev/zero` is a file too)."""
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        raise TaskError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise TaskError(f"{path}: is a directory, not a {what}") from None
    except OSError as error:
        raise TaskError(f"{path}: cannot read {what}: {error.strerror or error}") from None
    if len(data) > limit:
        raise TaskError(f"{path}: larger than {limit >> 20} MiB; a {what} this big is not supported")
    return data


def check_file_keys(files: dict[str, str], field: str) -> dict[str, str]:
    """`files` (a `files` or `verify_files` map) when every key is a relative work-dir path."""
    for path in files:
        check_relative_path(path, f"{field}[{path!r}]")
    return files


def check_solution(steps: list[SolutionStep] | None) -> list[SolutionStep] | None:
    """`steps` when each tool call's path is relative and each bash command well-formed."""
    for index, step in enumerate(steps or []):
        if isinstance(step, (WriteStep, EditStep, ReadStep)):
            check_relative_path(step.path, f"solution[{index}].path")
        elif isinstance(step, BashStep):
            check_command(step.command, f"solution[{index}].command")
    return steps


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
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES or any(
        len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in parts
    ):
        raise ValueError(f"{where}: path too long (at most {MAX_NAME_BYTES} bytes a name, {MAX_PATH_BYTES} in all)")
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
SolutionStep = Annotated[WriteStep | EditStep | BashStep | ReadStep, Field(discriminator="tool")]


class PhaseTimeouts(BaseModel):
    """Per-phase wall-clock limits in seconds; None falls back to the PiConfig default."""

    model_config = ConfigDict(extra="forbid")
    setup_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    agent_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    verify_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)


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
    # What of the agent's work dir reaches verify (globs relative to the work dir, `**` for any
    # depth; a dir brings what is below it). None: all of it, under the clean room's rules
    # (pi_env.verify.room). The task's own `files` outside these reach verify as the task wrote them.
    outputs: list[str] | None = None
    solution: list[SolutionStep] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    timeouts: PhaseTimeouts = Field(default_factory=PhaseTimeouts)
    limits: TaskLimits = Field(default_factory=TaskLimits)
    setup_network: bool = True  # tasks often install packages during setup
    verify_network: bool = False
    # Does a reward file (logs/verifier/reward.txt or reward.json) decide the reward? None: yes
    # when a verify command or verify file names logs/verifier/reward (Harbor tasks: always);
    # otherwise the reward is the pass rate and a reward file is ignored (pi_env.verify).
    reward_file: bool | None = None
    # A reward file's value must lie in this range; outside it (or not a finite number) is 0.0.
    reward_range: tuple[float, float] = (0.0, 1.0)

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
        return check_file_keys(files, info.field_name)

    @field_validator("outputs")
    @classmethod
    def _relative_globs(cls, outputs: list[str] | None) -> list[str] | None:
        for index, glob in enumerate(outputs or []):
            check_relative_path(glob, f"outputs[{index}]")
            if "\0" in glob or "\n" in glob:
                raise ValueError(f"outputs[{index}]: {glob!r} holds a NUL or newline; give a glob of a path")
        return outputs

    @field_validator("solution")
    @classmethod
    def _relative_solution_paths(cls, steps):
        return check_solution(steps)

    @field_validator("metadata")
    @classmethod
    def _format_facts(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        # Another format's facts (metadata["harbor"]), checked by that format (TaskFormat.check).
        for key, task_format in (task_formats() if metadata else {}).items():
            if key in metadata:
                task_format.check(metadata[key])
        return metadata

    @field_validator("setup", "verify")
    @classmethod
    def _commands(cls, commands: list[str], info) -> list[str]:
        for index, command in enumerate(commands):
            check_command(command, f"{info.field_name}[{index}]")
        return commands

    @model_validator(mode="after")
    def _valid_unicode(self) -> PiTask:
        for name in ("task_id", "instruction", "setup", "verify", "files", "verify_files", "metadata"):
            check_text(getattr(self, name), name)
        for index, step in enumerate(self.solution or []):
            check_text(step.model_dump(), f"solution[{index}]")
        return self

    @field_validator("reward_range")
    @classmethod
    def _ordered_range(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        low, high = bounds
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"reward_range must be two finite numbers, low <= high; got {list(bounds)}")
        return bounds

    @model_validator(mode="after")
    def _default_task_id(self) -> PiTask:
        if not self.task_id:
            self.task_id = "task-" + self.digest()[:12]
        return self

    def digest(self) -> str:
        """A content hash of what defines the task (not its id or metadata)."""
        payload = self.model_dump(include={"instruction", "setup", "verify", "files", "verify_files"})
        if self.outputs is not None:  # what verify sees of the work: part of the task (older digests unchanged)
            payload["outputs"] = self.outputs
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    @classmethod
    def coerce(cls, value: str | dict | PiTask) -> PiTask:
        """Accept a PiTask, a dict (validated) or a plain instruction string."""
        if isinstance(value, PiTask):
            return value
        if isinstance(value, str):
            return cls(instruction=value)
        if isinstance(value, dict):
            return validate_task(value, source="task")
        raise TaskError(f"cannot make a task from {type(value).__name__}; give a str, dict or PiTask")

    @classmethod
    def from_file(cls, path: str | Path) -> PiTask:
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
        message = item["msg"].removeprefix("Value error, ")
        # A whole-task check names its field in the message.
        lines.append(
            f"  - {'.'.join(str(part) for part in item['loc'])}: {message}" if item["loc"] else f"  - {message}"
        )
    return "\n".join(lines)


def _read_json(path: Path) -> Any:
    return parse_json(read_bounded(path, "task file"), str(path))


@dataclass(frozen=True)
class TaskFormat:
    """A task format beyond pi-env's JSON, plugged in by its own package (`pi_env.harbor`): the
    package imports this module and registers its format; this module knows it only by the
    package's name (FORMAT_PACKAGES), so nothing is loaded before a task needs a format."""

    key: str  # its facts live under PiTask.metadata[key]
    what: str  # what one of its task directories is, for load_tasks's error
    task_dirs: Callable[[Path], list[Path]]  # its task directories at a directory ([]: none)
    load: Callable[[Path], list[PiTask]]  # the tasks of those directories
    check: Callable[[Any], object]  # metadata[key] checked; a ValueError naming what to fix


_FORMATS: dict[str, TaskFormat] = {}
# The packages that plug in a task format (each calls register_task_format when imported),
# imported on first need: `import pi_env` loads none of them.
FORMAT_PACKAGES = ("pi_env.harbor",)


def register_task_format(task_format: TaskFormat) -> None:
    """`load_tasks` takes the format's directories; a task's metadata[key] is checked by it."""
    _FORMATS[task_format.key] = task_format


def task_formats() -> dict[str, TaskFormat]:
    """Every task format beyond pi-env's JSON, by its metadata key (FORMAT_PACKAGES loaded)."""
    for package in FORMAT_PACKAGES:
        importlib.import_module(package)  # at once when loaded; waits for another thread importing it
    return _FORMATS


def load_tasks(path: str | Path) -> list[PiTask]:
    """A task set: a JSONL file (one task per line), a JSON file (one task or a list), a
    directory of task JSON files (sorted by name), or a Harbor task directory or a directory of
    them (see pi_env.harbor, a `TaskFormat`). Task ids must be unique."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".json")
        if files:
            tasks = [PiTask.from_file(p) for p in files]
        else:
            task_format = next((f for f in task_formats().values() if f.task_dirs(path)), None)
            if task_format is None:
                raise TaskError(
                    f"{path}: directory holds no *.json task files"
                    + "".join(f" and no {f.what}" for f in task_formats().values())
                )
            tasks = task_format.load(path)
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
    for number, line in enumerate(_bounded_lines(path), start=1):
        if not line.strip():
            continue
        data = parse_json(line, f"{path}:{number}")
        if not isinstance(data, dict):
            raise TaskError(f"{path}:{number}: expected a task object, found {type(data).__name__}")
        tasks.append(validate_task(data, source=f"{path}:{number}"))
    if not tasks:
        raise TaskError(f"{path}: the task set is empty")
    return tasks


def _bounded_lines(path: Path):
    """The lines of a JSONL file, each at most MAX_TASK_FILE_BYTES."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise TaskError(f"{path}: no such task set") from None
    except OSError as error:
        raise TaskError(f"{path}: cannot read task set: {error.strerror or error}") from None
    with handle:
        for number, line in enumerate(iter(lambda: handle.readline(MAX_TASK_FILE_BYTES + 1), b""), start=1):
            if len(line) > MAX_TASK_FILE_BYTES:
                raise TaskError(f"{path}:{number}: line longer than {MAX_TASK_FILE_BYTES >> 20} MiB")
            yield line
