"""The host-directory sandbox that the local backends build on (local.py: bubblewrap;
unsafe_local.py: plain subprocesses; podman.py: a container per command).

A sandbox is a host dir `<root>/sb-<id>/` whose `home/` stands for the sandbox's /root (and
`home/workdir/` for its work dir). HostDirSandbox is that sandbox's commands and lifetime: each
command spawned, tracked so that kill_all() and close() reach every one of them, and close()
deleting the dir. A subclass says how a command is spawned (_popen_args) and killed
(_terminate). The rest it is made of lives in a module per concept:
- owned_dirs.py: the host dir made, its owner's lock, the dirs of dead owners swept;
- processes.py: a command as a host process (LocalProcess: its output drained by a thread into
  bounded tail buffers), the rlimits and the shell;
- nofollow_files.py: host-side file access (write_file, read_file, exists, remove, snapshot)
  that never follows a symlink a command planted (HomeFiles);
- home_checkpoints.py: the home checkpointed after setup and restored for verify
  (HomeCheckpoints).
The names that lived here before that split are still importable from here (__all__).
"""

from __future__ import annotations

import os
import subprocess
import threading

from pi_env.sandbox.base import (
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    ExecResult,
    Network,
    SandboxError,
)
from pi_env.sandbox.home_checkpoints import AGENT_HOME, SETUP_HOME, WORKDIR_NAME, HomeCheckpoints
from pi_env.sandbox.nofollow_files import (
    _DIR_FLAGS,
    WALK_MAX_DEPTH,
    HomeFiles,
    delete_tree,
    relative_to_home,
)
from pi_env.sandbox.owned_dirs import (
    LOCK_SUFFIX,
    STALE_LOCK_AGE_S,
    UNLOCKED_DIR_AGE_S,
    default_root,
    discard_host_dir,
    make_dir,
    make_host_dir,
    make_owned_dir,
    private_dir,
    sweep_stale_host_dirs,
)
from pi_env.sandbox.processes import (
    DRAIN_AFTER_KILL_S,
    EXEC_OUTPUT_LIMIT_BYTES,
    LocalProcess,
    _spawner,
    sandbox_rlimits,
    shell,
)

# The public names of this module before it was split (issue 28), importable from here as they
# were (pi_env.proxy.gateway imports its host dirs from here). To change a constant, patch it in
# the module that reads it (owned_dirs.STALE_LOCK_AGE_S, say), not here.
__all__ = [
    "AGENT_HOME",
    "DRAIN_AFTER_KILL_S",
    "EXEC_OUTPUT_LIMIT_BYTES",
    "LOCK_SUFFIX",
    "SETUP_HOME",
    "STALE_LOCK_AGE_S",
    "UNLOCKED_DIR_AGE_S",
    "WALK_MAX_DEPTH",
    "WORKDIR_NAME",
    "HostDirSandbox",
    "LocalProcess",
    "default_root",
    "delete_tree",
    "discard_host_dir",
    "make_dir",
    "make_host_dir",
    "make_owned_dir",
    "private_dir",
    "relative_to_home",
    "sandbox_rlimits",
    "shell",
    "sweep_stale_host_dirs",
]


# ---------------------------------------------------------------------------------------------
# The sandbox


class HostDirSandbox(HomeCheckpoints, HomeFiles):
    """A host dir whose `home/` is the sandbox's /root (see the module doc). Subclasses say
    how a command is spawned (_popen_args) and killed (_terminate)."""

    def __init__(self, host_dir: str, owner: int | None, lock_fd: int):
        self.id = os.path.basename(host_dir)
        self._lock_fd = lock_fd  # held until close(): the dir has a living owner
        self.home = SANDBOX_HOME
        self.workdir = SANDBOX_WORKDIR
        self.host_dir = host_dir
        self.host_home = os.path.join(host_dir, "home")
        self._owner = owner  # uid (and gid) that must own what the host creates; None: ours
        self._home_fd = os.open(self.host_home, _DIR_FLAGS)
        self._lock = threading.Lock()
        self._processes: set[LocalProcess] = set()
        self._closed = False

    # -- subclass hooks

    def _popen_args(
        self,
        command: str | list[str],
        cwd: str | None,
        env: dict[str, str] | None,
        network: Network,
    ) -> dict:
        """subprocess.Popen keyword arguments (args included) that run `command`."""
        raise NotImplementedError

    def _terminate(self, popen: subprocess.Popen) -> None:
        raise NotImplementedError

    def _kill_leftovers(self) -> None:
        """Called by kill_all() after killing every tracked command."""

    def _release(self) -> None:
        """Called once by close() after the host dir is gone."""

    # -- commands

    def exec(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        network: Network = "none",
        stdin: bytes | None = None,
    ) -> ExecResult:
        process = self._launch(
            self._popen_args(command, cwd, env, network),
            stdin_file=None,
            stdin_data=stdin or b"",
            output_limit=EXEC_OUTPUT_LIMIT_BYTES,
            background=False,
        )
        try:
            return process.wait(timeout_s)
        finally:
            with self._lock:
                self._processes.discard(process)

    def start(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        network: Network = "none",
        stdin_path: str | None = None,
        output_limit_bytes: int = 4 << 20,
    ) -> LocalProcess:
        popen_args = self._popen_args(command, cwd, env, network)
        stdin_file = self._open_for_reading(stdin_path) if stdin_path else None
        try:
            return self._launch(
                popen_args,
                stdin_file=stdin_file,
                stdin_data=b"",
                output_limit=output_limit_bytes,
                background=True,
            )
        finally:
            if stdin_file is not None:
                os.close(stdin_file)  # the child has its own copy

    def _launch(
        self,
        popen_args: dict,
        *,
        stdin_file: int | None,
        stdin_data: bytes,
        output_limit: int,
        background: bool,
    ) -> LocalProcess:
        # Pipes of our own, owned by the sandbox uid: a command that reopens its output through
        # /dev/stdout or /dev/stderr (/proc/self/fd/N) needs permission on the pipe itself.
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        stdin_r, stdin_w = os.pipe() if stdin_data else (None, None)
        for fd in (stdout_w, stderr_w, stdin_r):
            if fd is not None:
                self._chown(fd)
        if stdin_r is None:
            stdin_r = subprocess.DEVNULL if stdin_file is None else stdin_file
        usernet = popen_args.pop("usernet", None)  # local.py: a network to attach once spawned

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(
                **popen_args,
                stdin=stdin_r,
                stdout=stdout_w,
                stderr=stderr_w,
                start_new_session=True,
            )

        process = None
        try:
            with self._lock:  # close() cannot slip in between the check and the tracking
                self._check_open()
                popen = _spawner.submit(spawn).result() if background else spawn()
                process = LocalProcess(popen, self._terminate, stdin_w, stdin_data, stdout_r, stderr_r, output_limit)
                self._processes = {p for p in self._processes if p.poll() is None}
                self._processes.add(process)
        except BaseException:
            if usernet is not None:
                usernet.abandon()
            if process is None:
                for fd in (stdout_r, stderr_r, stdin_w):
                    if fd is not None:
                        os.close(fd)
            else:
                process.kill()
            raise
        finally:  # the child's ends: it has its own copies now
            for fd in (stdout_w, stderr_w, stdin_r if stdin_data else None):
                if fd is not None:
                    os.close(fd)
        if usernet is not None:
            try:
                usernet.attach()
            except BaseException:
                process.kill()
                raise
        return process

    def kill_all(self) -> None:
        with self._lock:
            running = [p for p in self._processes if p.poll() is None]
        for process in running:
            process.kill()
        if running:
            self._kill_leftovers()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.kill_all()
            os.close(self._home_fd)
        finally:
            try:
                discard_host_dir(self.host_dir, self._lock_fd)
            finally:
                self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
