"""What the agent wrote, read back onto the host within one budget per rollout: `ReadBudget`.

Every byte a rollout reads of what the agent left in its sandbox comes out of one budget,
`PiConfig.limits.max_read_bytes`, so an agent cannot make the host read more than that however it
spreads its output: the agent's own transcript after each agent (`transcript`, kept only as the
untrusted `agent_transcript`), a task's artifacts after each step (`artifacts`), the work dir
kept for reverify (`keep_workdir`) and the work dir's files on the result (`files`, when the
rollout is collected). Each read takes what it read off what is left; a later one gets the rest.
`PiSession` (pi_env.rollout) holds one per rollout and decides when to read; this module decides
how much.
"""

from __future__ import annotations

import base64

from .agent.base import Agent
from .harbor.rules import collect_artifacts
from .results import RolloutResult
from .sandbox import SANDBOX_WORKDIR, Sandbox, SandboxError
from .task import PiTask
from .verify.workdir import WorkdirLimits, capture_workdir

# An agent's own transcript is parsed into Python objects, about ten times its size in memory (64
# MB of short JSON lines held 720 MB): it gets at most this much of the budget, all its files
# together, so a run that left huge records (by accident, or an agent on purpose) cannot make the
# host hold gigabytes. A file over it is not read; the gateway's record is the run's conversation.
TRANSCRIPT_MAX_BYTES = 16 << 20


class ReadBudget:
    """What is left (`left`, bytes) of one rollout's `max_read_bytes`, and the reads that use it."""

    def __init__(self, max_bytes: int):
        self.left = max_bytes

    def tree(self, sandbox: Sandbox, path: str, max_files: int, max_file_bytes: int) -> dict[str, bytes]:
        """Files the agent may have written under `path`, within what is left of the budget."""
        files = sandbox.snapshot(
            path,
            max_files=max_files,
            max_file_bytes=min(max_file_bytes, self.left),
            max_total_bytes=self.left,
        )
        self.left -= sum(len(data) for data in files.values())
        return files

    def files(self, sandbox: Sandbox, max_files: int, max_file_bytes: int) -> dict[str, str]:
        """The work dir's files as the result holds them: text, or a binary file named with its size."""
        snapshot = self.tree(sandbox, SANDBOX_WORKDIR, max_files, max_file_bytes)
        return {path: _as_text(data) for path, data in snapshot.items()}

    def transcript(self, agent: Agent, sandbox: Sandbox) -> list[dict]:
        """The agent's own record of its run, as it left it (it may have rewritten it), within
        TRANSCRIPT_MAX_BYTES of the budget; [] when unreadable."""
        spent = 0

        def read(path: str, max_files: int, max_bytes: int) -> dict[str, bytes]:
            nonlocal spent
            cap = max(0, min(self.left, TRANSCRIPT_MAX_BYTES - spent))
            files = sandbox.snapshot(path, max_files=max_files, max_file_bytes=min(max_bytes, cap), max_total_bytes=cap)
            used = sum(len(data) for data in files.values())
            spent += used
            self.left -= used
            return files

        try:
            return agent.transcript(read)
        except (SandboxError, OSError, ValueError):
            return []

    def artifacts(self, task: PiTask, sandbox: Sandbox | None, result: RolloutResult, step: int | None = None) -> None:
        """`task`'s artifacts (a Harbor task's; `step`: that step's own) into `result.artifacts`."""
        self.left -= collect_artifacts(task, sandbox, result, step=step, max_total_bytes=self.left)

    def keep_workdir(self, sandbox: Sandbox, limits: WorkdirLimits) -> tuple[str | None, str | None]:
        """The work dir archived for reverify (pi_env.verify.workdir), base64 for the result, or
        None and why it was not kept (not the rollout's failure: only its kept copy's)."""
        try:
            kept = capture_workdir(sandbox, limits, read_left=self.left)
        except (SandboxError, OSError) as error:
            return None, f"could not read the work dir: {type(error).__name__}: {error}"
        if kept.archive is None:
            return None, kept.reason
        self.left -= kept.bytes
        return base64.b64encode(kept.archive).decode("ascii"), None


def _as_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return f"<binary file, {len(data)} bytes>"
