"""The world verify runs in, for one rollout: one the agent did not shape.

`PiSession` (pi_env.rollout) holds one `VerifyWorld` per sandbox spec and calls it twice:

- `keep_setup` (after setup, before the agent): which of the verifier's files setup made
  (`record_setup`), the home checkpointed where the sandbox can put it back in place
  (`RestoresHome`), room kept for verify in a capped home (`reserve`), and the verify commands'
  environment (`verify_env`: `VERIFY_HOOKS` setup did not make turned off) as `env`.
- `build` (after each agent, a multi-step task's later steps included): everything outside the
  work dir and `AGENT_OUTPUT_DIRS` back to what setup left. In place where commands can write
  only the home (local, podman, unsafe-local: /tmp is per command there, or the sandbox's own
  TMPDIR); else (remote services, where the agent was root of the whole machine) a fresh
  sandbox gets the task's files, setup again, and the agent's work dir (`ExportsTrees`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..results import CommandResult
from ..sandbox import SANDBOX_HOME, SANDBOX_WORKDIR, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from ..sandbox.base import ExportsTrees, RestoresHome
from ..task import PiTask
from . import RESERVE_DIR, VERIFY_ENV, missing_runner, record_setup, reserve, verifier_modules_env, verify_env
from .room import AGENT_OUTPUT_DIRS


class VerifyWorld:
    """Verify's world for the sandboxes of one spec. `note` gets what the rollout should be
    told (a sentence), `caller_env` is PiConfig.sandbox.extra_env, `extra_setup` whether the config adds
    setup commands of its own (PiConfig.sandbox.extra_setup_shell)."""

    def __init__(
        self,
        backend: SandboxBackend,
        spec: SandboxSpec,
        *,
        caller_env: dict[str, str],
        extra_setup: bool,
        note: Callable[[str], None],
    ):
        self.backend, self.spec = backend, spec
        self.caller_env, self.extra_setup, self.note = caller_env, extra_setup, note
        self.env: dict[str, str] = dict(VERIFY_ENV)  # every verify command's (keep_setup sets it)

    def setup_ran(self, task: PiTask) -> bool:
        """Did anything but pi-env make the work dir (setup commands, a built environment)?"""
        return bool(task.setup or self.extra_setup or self.spec.environment)

    def keep_setup(self, sandbox: Sandbox, task: PiTask) -> str | None:
        """Remember the world setup left: which of the verifier's files setup made, the home but
        the work dir where the sandbox can put it back in place, which hooks setup itself made.
        Returns the task's error when a verify runner is missing from it (`missing_runner`)."""
        setup_env = record_setup(sandbox, task, setup_ran=self.setup_ran(task), env=self.spec.env)
        self.env = verify_env(sandbox, task, setup_env, self.caller_env)
        if why := missing_runner(sandbox, task, self.env_for(task)):
            return why
        if isinstance(sandbox, RestoresHome):
            sandbox.checkpoint_home()
            self.reserve(sandbox, task)
        return None

    def env_for(self, task: PiTask) -> dict[str, str]:
        """Every verify command's environment when verifying `task`: setup's world as kept, with
        `task`'s own hidden modules (a later step's, not the first step's)."""
        return {**self.env, **verifier_modules_env(task)}

    def reserve(self, sandbox: Sandbox, task: PiTask) -> None:
        """Room for verify's own files in a capped home, out of the agent's reach (pi_env.verify)."""
        if not isinstance(sandbox, RestoresHome):
            return  # verify gets a fresh sandbox
        try:
            reserve(sandbox, task, self.spec.limits.max_disk_bytes)
        except OSError as error:  # a later step's agent filled its home already: verify goes without
            self.note(f"no room kept for verify ({error.strerror or error})")

    def build(
        self,
        sandbox: Sandbox,
        task: PiTask,
        *,
        more_steps: bool,
        setup_again: Callable[[Sandbox], CommandResult | None],
    ) -> tuple[Sandbox, bool]:
        """The sandbox verify runs in for `task`'s agent, and whether the agent's home was set
        aside (`more_steps`: a later step's agent continues in it; put_back_agent_home()).
        In place: `sandbox` itself. Else a fresh sandbox, where `setup_again` runs the task's
        setup and returns the command that failed (None: all passed); the caller closes the
        old one once the fresh one is its sandbox."""
        if isinstance(sandbox, RestoresHome):
            # The reserve stays through the restore (which may not fit if the agent filled its
            # home), then makes room for verify's own files.
            reserved = RESERVE_DIR.removeprefix(f"{SANDBOX_HOME}/")
            for problem in sandbox.restore_home((*AGENT_OUTPUT_DIRS, reserved), set_aside=more_steps):
                self.note(problem)
            sandbox.remove(RESERVE_DIR)
            return sandbox, more_steps
        if not isinstance(sandbox, ExportsTrees):
            raise SandboxError(
                f"the {self.backend.name!r} backend can neither restore its home "
                "(restore_home) nor hand a work dir to a fresh sandbox (export_tree/import_tree): "
                "verify would run in the world the agent shaped"
            )
        trees = {
            path: sandbox.export_tree(path)
            for path in (SANDBOX_WORKDIR, *(f"{SANDBOX_HOME}/{name}" for name in AGENT_OUTPUT_DIRS))
        }
        fresh = self.backend.create(self.spec)
        try:
            assert isinstance(fresh, ExportsTrees)  # the backend that made `sandbox`, which exports
            for path, text in task.files.items():
                fresh.write_file(path, text)
            if failed := setup_again(fresh):
                raise SandboxError(
                    f"setup command {failed.cmd!r} passed before the agent but failed in the "
                    f"fresh verify sandbox: {_tail(failed.stderr or failed.stdout, 300)}"
                )
            record_setup(fresh, task, setup_ran=self.setup_ran(task), env=self.spec.env)
            for path, data in trees.items():
                fresh.import_tree(path, data)
        except BaseException:
            fresh.close()
            raise
        return fresh, False


def _tail(text: str, limit: int) -> str:
    return text[-limit:] if len(text) > limit else text
