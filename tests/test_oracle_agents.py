"""The oracle adapts a task's solution to each agent's own tool list (by name and schema), falls
back to exact shell commands, answers a no-tools side call with text, and ends with the agent's
submit command. The tool lists are the agents' own (schemas and the descriptions that matter
copied from their packages: Pi 1.6.0 as captured from a real request, OpenCode 1.18.33,
Qwen Code 0.24.4; Claude Code, Codex and mini-swe-agent as documented in
shared/notes/agents.md). The shell commands run for real under bash."""

import json
import subprocess
from pathlib import Path

import pytest

from helpers import USER, direct_answer
from pi_env import PiTask, load_tasks
from pi_env.oracle import (
    FINAL_MESSAGE,
    SHELL_CHUNK_BYTES,
    TITLE_MESSAGE,
    OracleScript,
    Toolbox,
    adapted_turns,
    neutral_value,
    oracle_endpoint,
    release_oracle,
    shell_edit,
    shell_read,
    shell_writes,
    solution_turns,
)
from pi_env.sandbox import SANDBOX_WORKDIR
from pi_env.scripted import ScriptedServer

EXAMPLES = load_tasks(Path(__file__).parent.parent / "examples")
WORKDIR = "/root/workdir"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def fn(name, description, properties, required=()):
    """A Chat Completions tool."""
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def s(description=""):
    return {"type": "string", "description": description}


PI_TOOLS = [
    fn("read", "Read the contents of a file. Supports text files and images (jpg, png, gif, webp, bmp). Images are "
       "sent as attachments. For text files, output is truncated to 2000 lines or 50KB (whichever is hit first). "
       "Use offset/limit for large files. When you need the full file, continue with offset until complete.",
       {"path": s("Path to the file to read (relative or absolute)"),
        "offset": {"type": "number", "description": "Line number to start reading from (1-indexed)"},
        "limit": {"type": "number", "description": "Maximum number of lines to read"}}, ["path"]),
    fn("bash", "Execute a bash command in the current working directory. Returns stdout and stderr. Output is "
       "truncated to last 2000 lines or 50KB (whichever is hit first). If truncated, full output is saved to a temp "
       "file. Optionally provide a timeout in seconds.",
       {"command": s("Shell command to execute"),
        "timeout": {"type": "number", "description": "Timeout in seconds (optional, no default timeout)"}},
       ["command"]),
    fn("edit", "Edit a single file using exact text replacement. Every edits[].oldText must match a unique, "
       "non-overlapping region of the original file. If two changes affect the same block or nearby lines, merge "
       "them into one edit instead of emitting overlapping edits. Do not include large unchanged regions just to "
       "connect distant changes.",
       {"path": s("Path to the file to edit (relative or absolute)"),
        "edits": {"type": "array", "description": "One or more targeted replacements.",
                  "items": {"type": "object", "required": ["oldText", "newText"],
                            "properties": {"oldText": s("Exact text for one targeted replacement."),
                                           "newText": s("Replacement text for this targeted edit.")}}}},
       ["path", "edits"]),
    fn("write", "Write content to a file. Creates the file if it doesn't exist, overwrites if it does. "
       "Automatically creates parent directories.",
       {"path": s("Path to the file to write (relative or absolute)"), "content": s("Content to write to the file")},
       ["path", "content"]),
]

OPENCODE_TOOLS = [
    fn("bash", "Executes a given bash command in a persistent shell session with optional timeout.\n"
       "All commands run in the current working directory by default. Use the `workdir` parameter if you need to "
       "run a command in a different directory. AVOID using `cd <directory> && <command>` patterns.",
       {"command": s("The command to execute"),
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
        "workdir": s("The working directory to run the command in. Defaults to the current directory."),
        "description": s("Clear, concise description of what this command does in 5-10 words.")},
       ["command", "description"]),  # older OpenCode releases require `description`
    fn("edit", "Performs exact string replacements in files. \n\nUsage:\n- You must use your `Read` tool at least "
       "once in the conversation before editing. This tool will error if you attempt an edit without reading the "
       "file. \n- The edit will FAIL if `oldString` is not found in the file.",
       {"filePath": s("The absolute path to the file to modify"), "oldString": s("The text to replace"),
        "newString": s("The text to replace it with (must be different from oldString)"),
        "replaceAll": {"type": "boolean", "description": "Replace all occurrences of oldString (default false)"}},
       ["filePath", "oldString", "newString"]),
    fn("glob", "Fast file pattern matching tool", {"pattern": s("The glob pattern"), "path": s("The directory")},
       ["pattern"]),
    fn("read", "Read a file or directory from the local filesystem.",
       {"filePath": s("The absolute path to the file or directory to read"),
        "offset": {"type": "number", "description": "The line number to start reading from (1-indexed)"},
        "limit": {"type": "number", "description": "The maximum number of lines to read (defaults to 2000)"}},
       ["filePath"]),
    fn("todowrite", "Use this tool to create and manage a structured task list",
       {"todos": {"type": "array", "items": {"type": "object"}}}, ["todos"]),
    fn("write", "Writes a file to the local filesystem.\n- This tool will overwrite the existing file if there is "
       "one at the provided path.\n- If this is an existing file, you MUST use the Read tool first to read the "
       "file's contents. This tool will fail if you did not read the file first.",
       {"content": s("The content to write to the file"),
        "filePath": s("The absolute path to the file to write (must be absolute, not relative)")},
       ["content", "filePath"]),
]

QWEN_TOOLS = [
    fn("list_directory", "Lists files", {"path": s("The absolute path to the directory to list")}, ["path"]),
    fn("read_file", "Reads and returns the content of a specified file. The file_path argument MUST be an absolute "
       "path.", {"file_path": s("The absolute path to the file to read (e.g., '/home/user/project/file.txt'). "
                                "Relative paths are not supported. You must provide an absolute path."),
                 "offset": {"type": ["integer", "null"]}, "limit": {"type": ["integer", "null"]}}, ["file_path"]),
    fn("grep_search", "Searches", {"pattern": s(), "path": s()}, ["pattern"]),
    fn("edit", "Replaces text within a file. By default, replaces a single occurrence. Always use the read_file "
       "tool to examine the file's current content before attempting a text replacement.\n\nExpectation for "
       "required parameters:\n1. `file_path` MUST be an absolute path; otherwise an error will be thrown.",
       {"file_path": s("The absolute path to the file to modify. Must start with '/'."),
        "old_string": s("The exact literal text to replace, preferably unescaped."),
        "new_string": s("The exact literal text to replace `old_string` with, preferably unescaped."),
        "replace_all": {"type": "boolean", "description": "Replace all occurrences of old_string (default false)."}},
       ["file_path", "old_string", "new_string"]),
    fn("write_file", "Writes content to a specified file in the local filesystem. Unless the target's absence or "
       "current text contents have already been established in this session, you MUST use the read_file tool "
       "first; if the file does not exist, then create it. The file_path argument MUST be an absolute path.",
       {"file_path": s("The absolute path to the file to write to (e.g., '/home/user/project/file.txt'). "
                       "Relative paths are not supported."),
        "content": s("The content to write to the file."),
        "record_as_artifact": {"type": "boolean", "description": "Set false for intermediate files."}},
       ["file_path", "content"]),
    fn("run_shell_command", "This tool executes a given shell command as `bash -c <command>`.",
       {"command": s("Exact bash command to execute as `bash -c <command>`"),
        "is_background": {"type": "boolean", "description": "Optional: Whether to run the command in background."},
        "timeout": {"type": "integer", "minimum": 1, "maximum": 600000},
        "description": s("Brief description of the command for the user."),
        "directory": s("(OPTIONAL) The absolute path of the directory to run the command in.")},
       ["command"]),
    fn("todo_write", "Creates a todo list", {"todos": {"type": "array"}}, ["todos"]),
]

MINI_TOOLS = [fn("bash", "Execute a bash command", {"command": s("The bash command to execute")}, ["command"])]


def anthropic(name, description, properties, required=()):
    """A tool as Claude Code sends it (Anthropic Messages: `input_schema`)."""
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": properties, "required": list(required),
                             "additionalProperties": False}}


CLAUDE_TOOLS = [
    anthropic("Task", "Launch a new agent", {"description": s(), "prompt": s(), "subagent_type": s()},
              ["description", "prompt", "subagent_type"]),
    anthropic("Bash", "Executes a given bash command in a persistent shell session with optional timeout.",
              {"command": s("The command to execute"), "timeout": {"type": "number"},
               "description": s("Clear, concise description of what this command does in 5-10 words"),
               "run_in_background": {"type": "boolean"}}, ["command"]),
    anthropic("BashOutput", "Retrieves output from a running background bash shell", {"bash_id": s()}, ["bash_id"]),
    anthropic("Read", "Reads a file from the local filesystem. The file_path parameter must be an absolute path, "
              "not a relative path.", {"file_path": s("The absolute path to the file to read"),
                                       "offset": {"type": "number"}, "limit": {"type": "number"}}, ["file_path"]),
    anthropic("Edit", "Performs exact string replacements in files. \n\nUsage:\n- You must use your `Read` tool at "
              "least once in the conversation before editing. This tool will error if you attempt an edit without "
              "reading the file.",
              {"file_path": s("The absolute path to the file to modify"), "old_string": s("The text to replace"),
               "new_string": s("The text to replace it with (must be different from old_string)"),
               "replace_all": {"type": "boolean", "default": False}}, ["file_path", "old_string", "new_string"]),
    anthropic("MultiEdit", "Multiple edits to one file",
              {"file_path": s("The absolute path to the file to modify"),
               "edits": {"type": "array", "items": {"type": "object", "properties": {
                   "old_string": s(), "new_string": s()}}}}, ["file_path", "edits"]),
    anthropic("Write", "Writes a file to the local filesystem.\n- If this is an existing file, you MUST use the "
              "Read tool first to read the file's contents. This tool will fail if you did not read the file first.",
              {"file_path": s("The absolute path to the file to write (must be absolute, not relative)"),
               "content": s("The content to write to the file")}, ["file_path", "content"]),
    anthropic("NotebookEdit", "Edit a Jupyter notebook cell",
              {"notebook_path": s("The absolute path"), "new_source": s(), "cell_id": s()},
              ["notebook_path", "new_source"]),
    anthropic("TodoWrite", "Task list", {"todos": {"type": "array"}}, ["todos"]),
    anthropic("KillShell", "Kills a background shell", {"shell_id": s()}, ["shell_id"]),
]

# Codex speaks the Responses API: function tools carry name/parameters at the top level.
CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY, returning output or a "
     "session ID for ongoing interaction.", "strict": False, "parameters": {
         "type": "object", "additionalProperties": False, "required": ["cmd"], "properties": {
             "cmd": s("Shell command to execute."),
             "workdir": s("Optional working directory to run the command in; defaults to the turn cwd."),
             "login": {"type": "boolean"}, "yield_time_ms": {"type": "number"},
             "max_output_tokens": {"type": "number"}}}},
    {"type": "function", "name": "write_stdin", "description": "Writes characters to an existing unified exec "
     "session", "parameters": {"type": "object", "required": ["session_id"], "properties": {
         "session_id": {"type": "number"}, "chars": s(), "yield_time_ms": {"type": "number"}}}},
    {"type": "function", "name": "update_plan", "description": "Updates the task plan", "parameters": {
        "type": "object", "required": ["plan"], "properties": {"plan": {"type": "array"}}}},
    {"type": "function", "name": "view_image", "description": "Attach a local image",
     "parameters": {"type": "object", "required": ["path"], "properties": {"path": s("Local filesystem path")}}},
    {"type": "custom", "name": "apply_patch", "description": "Use the `apply_patch` tool to edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}},
]

TASK = PiTask(
    task_id="mix", instruction="do it", files={"app.py": "x = 1\n"},
    solution=[
        {"tool": "read", "path": "app.py"},
        {"tool": "edit", "path": "app.py", "old": "x = 1", "new": "x = 2"},
        {"tool": "write", "path": "pkg/new.py", "content": "print('hi')\n"},
        {"tool": "bash", "command": "python3 app.py"},
    ],
)


def calls(turns):
    """Each turn as (tool name, arguments), or the text of a text turn."""
    out = []
    for turn in turns:
        if turn.tool_calls:
            (call,) = turn.tool_calls
            out.append((call.name, json.loads(call.arguments_json())))
        else:
            out.append(turn.text)
    return out


def test_the_sandbox_work_dir_is_where_absolute_paths_point():
    assert SANDBOX_WORKDIR == WORKDIR


@pytest.mark.parametrize("task", EXAMPLES, ids=[task.task_id for task in EXAMPLES])
def test_pi_sees_exactly_the_calls_it_always_saw(task):
    adapted, fixed = adapted_turns(task, PI_TOOLS), solution_turns(task)
    assert adapted == fixed
    assert [t.tool_calls[0].arguments_json() for t in adapted if t.tool_calls] == \
        [t.tool_calls[0].arguments_json() for t in fixed if t.tool_calls]  # byte for byte, key order too


def test_pi_mixed_steps():
    assert calls(adapted_turns(TASK, PI_TOOLS)) == [
        ("read", {"path": "app.py"}),
        ("edit", {"path": "app.py", "edits": [{"oldText": "x = 1", "newText": "x = 2"}]}),
        ("write", {"path": "pkg/new.py", "content": "print('hi')\n"}),
        ("bash", {"command": "python3 app.py"}),
        FINAL_MESSAGE,
    ]


def test_opencode_absolute_paths_read_first_and_the_required_description():
    neutral = neutral_value({"type": "string"}, "run")
    assert calls(adapted_turns(TASK, OPENCODE_TOOLS)) == [
        ("read", {"filePath": f"{WORKDIR}/app.py"}),  # the edit tool asks for a read first: this one
        ("edit", {"filePath": f"{WORKDIR}/app.py", "oldString": "x = 1", "newString": "x = 2"}),
        # pkg/new.py cannot exist yet (not staged, no setup, no command before): no read before the write
        ("write", {"filePath": f"{WORKDIR}/pkg/new.py", "content": "print('hi')\n"}),
        ("bash", {"command": "python3 app.py", "description": neutral}),
        FINAL_MESSAGE,
    ]


def test_a_write_that_may_replace_a_file_reads_it_first():
    task = PiTask(instruction="x", files={"a.txt": "old"}, setup=[],
                  solution=[{"tool": "write", "path": "a.txt", "content": "new"},
                            {"tool": "bash", "command": "true"},
                            {"tool": "write", "path": "b.txt", "content": "b"}])
    assert calls(adapted_turns(task, OPENCODE_TOOLS))[:4] == [
        ("read", {"filePath": f"{WORKDIR}/a.txt"}),  # staged by the task
        ("write", {"content": "new", "filePath": f"{WORKDIR}/a.txt"}),
        ("bash", {"command": "true", "description": neutral_value({"type": "string"}, "run")}),
        ("read", {"filePath": f"{WORKDIR}/b.txt"}),  # a command ran: it may have made b.txt
    ]


def test_an_edit_after_a_command_reads_the_file_again():
    task = PiTask(instruction="x", files={"a.txt": "1"},
                  solution=[{"tool": "edit", "path": "a.txt", "old": "1", "new": "2"},
                            {"tool": "bash", "command": "true"},
                            {"tool": "edit", "path": "a.txt", "old": "2", "new": "3"}])
    names = [call[0] for call in calls(adapted_turns(task, QWEN_TOOLS))[:-1]]
    assert names == ["read_file", "edit", "run_shell_command", "read_file", "edit"]


def test_qwen_code_tools():
    assert calls(adapted_turns(TASK, QWEN_TOOLS)) == [
        ("read_file", {"file_path": f"{WORKDIR}/app.py"}),
        ("edit", {"file_path": f"{WORKDIR}/app.py", "old_string": "x = 1", "new_string": "x = 2"}),
        ("write_file", {"file_path": f"{WORKDIR}/pkg/new.py", "content": "print('hi')\n"}),
        ("run_shell_command", {"command": "python3 app.py"}),
        FINAL_MESSAGE,
    ]


def test_claude_code_tools_in_anthropic_shape():
    box = Toolbox.of(CLAUDE_TOOLS)
    assert (box.write.tool.name, box.edit.tool.name, box.read.tool.name, box.shell.tool.name) == \
        ("Write", "Edit", "Read", "Bash")  # not MultiEdit, NotebookEdit, TodoWrite, BashOutput, KillShell
    assert calls(adapted_turns(TASK, CLAUDE_TOOLS)) == [
        ("Read", {"file_path": f"{WORKDIR}/app.py"}),
        ("Edit", {"file_path": f"{WORKDIR}/app.py", "old_string": "x = 1", "new_string": "x = 2"}),
        ("Write", {"file_path": f"{WORKDIR}/pkg/new.py", "content": "print('hi')\n"}),
        ("Bash", {"command": "python3 app.py"}),
        FINAL_MESSAGE,
    ]


def test_mini_swe_agent_does_everything_through_bash_and_submits():
    step = TASK.solution
    assert calls(adapted_turns(TASK, MINI_TOOLS, SUBMIT)) == [
        ("bash", {"command": shell_read("app.py")}),
        ("bash", {"command": shell_edit("app.py", step[1].old, step[1].new)}),
        ("bash", {"command": shell_writes("pkg/new.py", step[2].content)[0]}),
        ("bash", {"command": "python3 app.py"}),
        ("bash", {"command": SUBMIT}),  # its only way to end
    ]


def test_codex_exec_command_in_responses_shape():
    box = Toolbox.of(CODEX_TOOLS)
    assert box.write is None and box.edit is None and box.read is None  # view_image is no file reader
    turns = calls(adapted_turns(TASK, CODEX_TOOLS))
    assert [name for name, _ in turns[:-1]] == ["exec_command"] * 4
    assert turns[1][1] == {"cmd": shell_edit("app.py", "x = 1", "x = 2")}
    assert turns[3][1] == {"cmd": "python3 app.py"} and turns[-1] == FINAL_MESSAGE


def test_a_command_given_as_an_argv_array():
    tools = [fn("shell", "Runs a command", {"command": {"type": "array", "items": {"type": "string"}}}, ["command"])]
    assert calls(adapted_turns(TASK, tools))[3] == ("shell", {"command": ["bash", "-c", "python3 app.py"]})


def test_an_agent_without_a_way_to_run_a_step_is_told_why_and_stops_there():
    tools = [PI_TOOLS[3]]  # write only
    turns = calls(adapted_turns(TASK, tools))
    assert len(turns) == 1 and "no shell tool" in turns[0]  # the read step already needs a shell


def test_neutral_values_pass_a_schema():
    assert neutral_value({"type": "boolean"}, "run") is False
    assert neutral_value({"type": "integer", "minimum": 1}, "run") == 1
    assert neutral_value({"type": ["integer", "null"]}, "run") == 0
    assert neutral_value({"type": "string", "enum": ["view", "create", "str_replace"]}, "replace") == "str_replace"
    assert neutral_value({"type": "array"}, "run") == [] and neutral_value({"type": "object"}, "run") == {}
    assert neutral_value({"type": "boolean", "default": True}, "run") is True
    required = fn("run_command", "Run a shell command", {"command": s(), "is_background": {"type": "boolean"},
                                                 "timeout": {"type": "integer", "minimum": 1}},
                  ["command", "is_background", "timeout"])
    assert calls(adapted_turns(TASK, [required]))[3] == \
        ("run_command", {"command": "python3 app.py", "is_background": False, "timeout": 1})


# --------------------------------------------------------------- the shell fallback, for real

NASTY = [
    "plain\n",
    "no trailing newline",
    "",
    "-n leading dash\n",
    "--\n",
    "quotes ' \" ` $HOME $(false) \\n \\ %s %%\n",
    "tabs\tand\r\nCRLF\nand blank\n\n\n",
    "non-ASCII: é ü 中文 🎉\n",
    "\x01\x7f control bytes\n",
]


def run(command, cwd):
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, timeout=60)


@pytest.mark.parametrize("content", NASTY, ids=range(len(NASTY)))
@pytest.mark.parametrize("path", ["out.txt", "deep/er/out file.txt", "-dash.txt", "it's.txt"])
def test_shell_write_leaves_exactly_the_bytes(tmp_path, path, content):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_bytes(b"previous content, longer than the new one\n")
    for command in shell_writes(path, content):
        done = run(command, tmp_path)
        assert done.returncode == 0, done.stderr
    assert (tmp_path / path).read_bytes() == content.encode()
    done = run(shell_read(path), tmp_path)
    assert done.returncode == 0 and done.stdout == content.encode()


def test_a_large_shell_write_is_split_into_command_lines_that_fit(tmp_path):
    content = "".join(f"line {i}: é 'q' \"d\"\n" for i in range(20000))  # ~ 450 KB
    commands = shell_writes("big/file.txt", content)
    assert len(commands) > 1 and all(len(c) < 100 * 1024 for c in commands)  # one argv string holds 128 KiB
    assert len(content.encode()) > 3 * SHELL_CHUNK_BYTES
    for command in commands:
        assert run(command, tmp_path).returncode == 0
    assert (tmp_path / "big/file.txt").read_bytes() == content.encode()
    task = PiTask(instruction="x", solution=[{"tool": "write", "path": "big/file.txt", "content": content}])
    assert len(adapted_turns(task, MINI_TOOLS)) == len(commands) + 1  # one call per piece, then the end


@pytest.mark.parametrize("old,new", [
    ("x = 1", "x = 2"),
    ("'quoted' \"both\"", "$(touch pwned) `x`"),
    ("é\n", "ü 🎉"),
    ("-n", "--"),
    ("line\n", ""),
])
def test_shell_edit_replaces_exactly_the_first_occurrence(tmp_path, old, new):
    before = f"head\n{old}middle {old} tail".encode()
    (tmp_path / "f.txt").write_bytes(before)
    done = run(shell_edit("f.txt", old, new), tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "f.txt").read_bytes() == before.replace(old.encode(), new.encode(), 1)
    assert not (tmp_path / "pwned").exists()


def test_shell_edit_fails_loudly_when_the_old_text_is_missing(tmp_path):
    (tmp_path / "f.txt").write_bytes(b"x = 1\n")
    done = run(shell_edit("f.txt", "x = 3", "x = 4"), tmp_path)
    assert done.returncode != 0 and b"old text is not in f.txt" in done.stderr
    assert (tmp_path / "f.txt").read_bytes() == b"x = 1\n"
    assert run(shell_edit("missing.txt", "a", "b"), tmp_path).returncode != 0


# ----------------------------------------------------------- over HTTP: the side call, the end


def body(tools, assistant_turns=0, stream=False):
    messages = [{"role": "system", "content": "You are a coding agent."}, USER]
    for i in range(assistant_turns):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}_0", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": f"call_{i}_0", "content": "ok"}]
    out = {"model": "pi-env-oracle", "messages": messages, "stream": stream}
    if tools is not None:
        out["tools"] = tools
    return out


class At:
    """What `direct_answer` needs of a server: its base URL (here the oracle's shared server)."""

    def __init__(self, base_url):
        self.base_url = base_url


@pytest.fixture
def oracle():
    endpoint = oracle_endpoint(TASK, submit_command=SUBMIT)
    yield At(endpoint.base_url), endpoint.api_key
    release_oracle(endpoint)


def message(answer):
    assert answer["system_fingerprint"] == "pi-env-synthetic"
    return answer["choices"][0]["message"]


def test_a_call_without_tools_gets_text_and_the_conversation_goes_on_where_it_was(oracle):
    server, key = oracle
    first = message(direct_answer(server, key, body(OPENCODE_TOOLS)))
    assert first["tool_calls"][0]["function"]["name"] == "read"
    for tools in (None, []):  # the title call, with no tools at all or an empty list
        for seen in (0, 3):
            assert message(direct_answer(server, key, body(tools, seen))) == \
                {"role": "assistant", "content": TITLE_MESSAGE}
    no_calls = {**body(OPENCODE_TOOLS, 1), "tool_choice": "none"}  # tools listed, none allowed
    assert message(direct_answer(server, key, no_calls))["content"] == TITLE_MESSAGE
    second = message(direct_answer(server, key, body(OPENCODE_TOOLS, 1)))["tool_calls"][0]["function"]
    assert second["name"] == "edit" and json.loads(second["arguments"])["filePath"] == f"{WORKDIR}/app.py"
    third = message(direct_answer(server, key, body(OPENCODE_TOOLS, 2)))
    assert third["tool_calls"][0]["function"]["name"] == "write"


def test_the_last_call_is_the_submit_command_through_the_agents_shell(oracle):
    server, key = oracle
    turns = len(adapted_turns(TASK, MINI_TOOLS))
    last = message(direct_answer(server, key, body(MINI_TOOLS, turns - 1)))
    assert last["tool_calls"][0]["function"] == {"name": "bash", "arguments": json.dumps({"command": SUBMIT})}
    # without a submit command (Pi) the same position is the final text
    endpoint = oracle_endpoint(TASK)
    try:
        pi_last = message(direct_answer(server, endpoint.api_key, body(PI_TOOLS, len(TASK.solution))))
        assert pi_last["content"] == FINAL_MESSAGE
    finally:
        release_oracle(endpoint)


def test_an_adapter_answers_each_tool_list_with_the_same_turn_objects():
    script = OracleScript(TASK)
    a, b = script(body(QWEN_TOOLS)), script(json.loads(json.dumps(body(QWEN_TOOLS, 2))))
    assert a is b and a[0] is b[0]  # computed once per tool list: the render cache stays warm
    assert script(body(PI_TOOLS)) == solution_turns(TASK)
    with pytest.raises(Exception, match="no solution"):
        OracleScript(PiTask(instruction="x"))


def test_the_scripted_server_takes_a_script_adapter():
    seen = []

    def adapter(request_body):
        seen.append(request_body)
        return adapted_turns(TASK, request_body.get("tools") or [])

    with ScriptedServer() as server:
        key = server.add_script(adapter)
        answer = direct_answer(server, key, body(CLAUDE_TOOLS, 1, stream=True))
        call = answer["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "Edit" and call["id"] == "call_1_0"
        assert len(seen) == 1 and seen[0]["tools"] == CLAUDE_TOOLS
