"""The `unsafe-local` backend: commands run directly on this machine, WITHOUT ANY ISOLATION.

For machines without bubblewrap, and only by explicit choice. What it does:
- each sandbox gets a host dir whose `home/` stands for /root: the file API and `cwd` map
  sandbox paths under /root there (the symlink-safe file access of nofollow_files.py, as for the
  local backend);
- commands run as the caller, in that dir, with HOME set to it and a small environment
  (the caller's PATH, spec.env, the per-call env); the rlimits of spec.limits apply, with
  RLIMIT_NPROC counting every process of the caller.
What it cannot do:
- no file isolation: commands see and can change everything the caller can (restore_home()
  resets only the sandbox's home and its own TMPDIR, not the host's /tmp or the caller's files);
- no network isolation: every `network` mode is the host's network; the gateway socket is
  not bound at GATEWAY_SOCKET and agent_masked_paths hide nothing;
- ro_mounts are not mounted, and absolute sandbox paths inside commands or env values
  (/root/..., /opt/pi-env/...) are not translated: use host_path() to build them;
- a command that escapes its process group (setsid) survives kill_all() and close().
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import signal
import subprocess
import warnings

from pi_env.sandbox.base import Network, SandboxSpec
from pi_env.sandbox.hostdir import HostDirSandbox
from pi_env.sandbox.nofollow_files import delete_tree, relative_to_home
from pi_env.sandbox.owned_dirs import default_root, make_host_dir, private_dir, sweep_stale_host_dirs
from pi_env.sandbox.processes import sandbox_rlimits, shell

log = logging.getLogger(__name__)

WARNING = (
    "pi-env is using the `unsafe-local` sandbox backend: commands run directly on this machine "
    "as {user}, with no file, network or process isolation. Use it only for trusted code."
)


def _apply_rlimits(rlimits: dict[int, int]) -> None:
    # Popen's preexec_fn, in the child before exec: portable (no prlimit binary needed), and
    # only plain setrlimit calls, nothing that could wait for a lock held by another thread.
    for res, value in rlimits.items():
        resource.setrlimit(res, (value, value))


class UnsafeLocalSandbox(HostDirSandbox):
    """A host dir standing for /root, and commands run as plain subprocesses in it."""

    def __init__(self, host_dir: str, lock_fd: int, spec: SandboxSpec):
        super().__init__(host_dir, None, lock_fd)
        self._spec = spec
        rlimits = sandbox_rlimits(spec.limits, exclusive_uid=False)
        self._rlimits = functools.partial(_apply_rlimits, rlimits)
        # The sandbox's own TMPDIR (the host's /tmp is shared with everything): emptied by
        # restore_home(), so what the agent left there never reaches verify through $TMPDIR.
        self._tmp = os.path.join(host_dir, "tmp")
        os.mkdir(self._tmp, 0o700)

    def restore_home(self, keep: tuple[str, ...] = (), *, set_aside: bool = False) -> list[str]:
        problems = super().restore_home(keep, set_aside=set_aside)
        delete_tree(self._tmp)
        os.mkdir(self._tmp, 0o700)
        return problems

    def host_path(self, path: str) -> str:
        """The host path standing for a sandbox path under /root (relative: to the workdir)."""
        relative = relative_to_home(path)
        return os.path.join(self.host_home, relative) if relative else self.host_home

    def _popen_args(
        self,
        command: str | list[str],
        cwd: str | None,
        env: dict[str, str] | None,
        network: Network,
    ) -> dict:
        if isinstance(command, str):
            command = [shell(), "-c", command]
        elif not command:
            raise ValueError("empty command")
        environment = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "TMPDIR": self._tmp,
            "USER": os.environ.get("USER", "root"),
            **self._spec.env,
            **(env or {}),
            "HOME": self.host_home,
        }
        return {
            "args": command,
            "cwd": self.host_path(cwd or "."),
            "env": environment,
            "preexec_fn": self._rlimits,
        }

    def _terminate(self, popen: subprocess.Popen) -> None:
        if popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)  # the group start_new_session made
        popen.wait()


class UnsafeLocalBackend:
    """See the module docstring: no isolation at all."""

    name = "unsafe-local"

    def __init__(self, root: str | None = None):
        self.root = root or default_root()
        private_dir(self.root, 0o711)
        sweep_stale_host_dirs(self.root)

    def create(self, spec: SandboxSpec) -> UnsafeLocalSandbox:
        message = WARNING.format(user=os.environ.get("USER") or f"uid {os.getuid()}")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log.warning(message)
        host_dir, lock_fd = make_host_dir(self.root, owner=None)
        return UnsafeLocalSandbox(host_dir, lock_fd, spec)
