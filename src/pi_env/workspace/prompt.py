"""The prompt of a workspace task: language, files, the program to write, the exact command,
and how to state the answer."""

from __future__ import annotations

from pi_env.workspace.tasks import WorkspaceTask

SYSTEM_PROMPT = (
    "You are a careful programmer working in a small workspace of text files. Use the tools: "
    "`read` to look at a file, `write` to create one, `edit` to change one (oldText must match "
    "exactly once), and `bash` to run a program you wrote. bash runs only `<runtime> <file>`, "
    "in a sandbox without network, with the workspace files beside the program."
)


def user_prompt(task: WorkspaceTask) -> str:
    files = "\n".join(f"- `{path}` ({len(content.encode())} bytes)" for path, content in sorted(task.files.items()))
    return (
        f"{task.question}\n\n"
        f"Language: {task.lang.name}.\n"
        f"Workspace files:\n{files}\n\n"
        f"Write a {task.lang.name} program `{task.program}` that reads the files and prints the "
        f"answer as the last line of its output. Run it with exactly `{task.command}`. "
        f"Then end your final message with the answer as a plain integer (digits only, no "
        f"separators)."
    )


def initial_messages(task: WorkspaceTask, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_prompt(task)}]
