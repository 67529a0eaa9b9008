"""The home checkpointed after setup and restored for verify: the world verify runs in
(pi_env.rollout: verify in phases.verify, its world pi_env.verify.world; the RestoresHome ability of base.py).

checkpoint_home() copies the home as setup left it, all but the work dir, to
`<host dir>/setup-home`, outside the home where no command reaches it. restore_home() kills
every command and puts that copy back in place of whatever the agent made of the home (a
usercustomize.py, a .pth, a git config, a shell rc), keeping only the work dir and the agent's
output dirs; the rest of the agent's home is deleted, or set aside inside the home (renamed,
never copied) for put_back_agent_home(), so a later step of a multi-step task continues in it.
Every step goes through the no-follow file access of nofollow_files.py (HomeFiles).
"""

from __future__ import annotations

import os
import stat
import subprocess

from pi_env.sandbox.base import SANDBOX_HOME, SANDBOX_WORKDIR, SandboxError
from pi_env.sandbox.nofollow_files import _DIR_FLAGS, HomeFiles, _remove_entry, delete_tree
from pi_env.sandbox.owned_dirs import make_dir

SETUP_HOME = "setup-home"  # <host dir>/setup-home: the home as setup left it (checkpoint_home)
# The agent's home, set aside while verify runs (a multi-step task's next agent gets it back):
# a dir of the home itself, renamed into (never copied: what the agent wrote stays inside its
# disk total and off the host's disk), named so no tool looks inside.
AGENT_HOME = ".pi-env-agent-home"
WORKDIR_NAME = SANDBOX_WORKDIR[len(SANDBOX_HOME) + 1 :]


def _copy_entries(source: str, names: list[str], target: str) -> None:
    """Copy the entries `names` of the dir `source` into `target` as they are: symlinks stay
    symlinks (nothing is followed), owners, modes and times are kept; reflinks where the
    filesystem has them. Called with nothing running in the sandbox."""
    if names:
        done = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", *(os.path.join(source, n) for n in names), target + "/"],
            capture_output=True,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        if done.returncode != 0:
            raise SandboxError(f"copying into {target} failed: {done.stderr.decode(errors='replace')[-300:]}")


class HomeCheckpoints(HomeFiles):
    """checkpoint_home, restore_home and put_back_agent_home (see the module doc) of a sandbox
    (HostDirSandbox) that sets `id`, `host_dir` and `host_home` and whose kill_all() kills
    every command."""

    id: str
    host_dir: str
    host_home: str

    def kill_all(self) -> None:
        raise NotImplementedError

    def checkpoint_home(self) -> None:
        """Keep a copy of the home as setup left it, all but the work dir (dotfiles, ~/.local,
        ~/.config, ~/.cache, ...), outside the home where no command reaches it, for
        restore_home(). Call with nothing running."""
        self._check_open()
        saved = os.path.join(self.host_dir, SETUP_HOME)
        if os.path.lexists(saved):
            delete_tree(saved)
        make_dir(saved, 0o700)
        self._setup_home_mode = stat.S_IMODE(os.fstat(self._home_fd).st_mode)
        _copy_entries(self.host_home, [n for n in os.listdir(self._home_fd) if n != WORKDIR_NAME], saved)

    def restore_home(self, keep: tuple[str, ...] = (), *, set_aside: bool = False) -> list[str]:
        """Kill every command and put the home back as checkpoint_home() saved it, but for the
        work dir and the home-relative dirs `keep` (the agent's output: they stay as the agent
        left them; one that is a symlink or a file now is an empty dir). Whatever a command
        planted elsewhere (a usercustomize.py, a .pth, a git config, a shell rc) is gone.
        set_aside: the rest of the agent's home is kept for put_back_agent_home() (a later
        step of a multi-step task continues in it), else deleted. Returns what went wrong on the
        way that the agent could have caused (its output filling a capped home, say): never
        anything of the agent's outside its output, at worst less of setup's home."""
        self._check_open()
        saved = os.path.join(self.host_dir, SETUP_HOME)
        if not os.path.isdir(saved):
            raise SandboxError(f"sandbox {self.id}: restore_home() without checkpoint_home()")
        self.kill_all()
        self._kept_paths = keep
        kept = self._take_out((WORKDIR_NAME, *keep))
        problems = []
        _remove_entry(self._home_fd, AGENT_HOME)  # the agent's own, in the way
        if set_aside:
            os.mkdir(AGENT_HOME, 0o700, dir_fd=self._home_fd)
            for name in os.listdir(self._home_fd):
                if name not in kept and name != AGENT_HOME:
                    os.rename(name, f"{AGENT_HOME}/{name}", src_dir_fd=self._home_fd, dst_dir_fd=self._home_fd)
            kept[AGENT_HOME] = AGENT_HOME
        self._clear_home(kept)  # first: whatever fails below, nothing of the agent's is left in place
        try:
            _copy_entries(saved, os.listdir(saved), self.host_home)
        except SandboxError as error:
            problems.append(f"setup's home was restored only in part for verify ({error})")
        os.fchmod(self._home_fd, self._setup_home_mode)
        self._put_in({temp: path for temp, path in kept.items() if temp != AGENT_HOME})
        return problems

    def reset_home(self, keep: tuple[str, ...] = ()) -> list[str]:
        """Between two verify commands: kill every command and put setup's home back again, but
        for the work dir, `keep` and the agent's home restore_home() set aside (a multi-step
        task's next agent still gets it). Returns what could not be put back, as sentences."""
        self._check_open()
        saved = os.path.join(self.host_dir, SETUP_HOME)
        if not os.path.isdir(saved):
            raise SandboxError(f"sandbox {self.id}: reset_home() without checkpoint_home()")
        self.kill_all()
        kept = self._take_out((WORKDIR_NAME, *keep))
        try:
            if stat.S_ISDIR(os.stat(AGENT_HOME, dir_fd=self._home_fd, follow_symlinks=False).st_mode):
                kept[AGENT_HOME] = AGENT_HOME  # left where it is
        except FileNotFoundError:
            pass
        self._clear_home(kept)
        problems = []
        try:
            _copy_entries(saved, os.listdir(saved), self.host_home)
        except SandboxError as error:
            problems.append(f"setup's home was restored only in part ({error})")
        os.fchmod(self._home_fd, self._setup_home_mode)
        self._put_in({temp: path for temp, path in kept.items() if temp != AGENT_HOME})
        return problems

    def put_back_agent_home(self) -> None:
        """Undo restore_home(set_aside=True): the agent's home in place of verify's, but for the
        work dir and `keep` as they are now. Nothing set aside: verify's stays."""
        self._check_open()
        try:
            is_dir = stat.S_ISDIR(os.stat(AGENT_HOME, dir_fd=self._home_fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            is_dir = False
        if not is_dir:
            return
        self.kill_all()
        kept = self._take_out((WORKDIR_NAME, *self._kept_paths))
        self._clear_home({**kept, AGENT_HOME: AGENT_HOME})
        aside_fd = os.open(AGENT_HOME, _DIR_FLAGS, dir_fd=self._home_fd)
        try:
            for name in os.listdir(aside_fd):
                if name not in kept:
                    os.rename(name, name, src_dir_fd=aside_fd, dst_dir_fd=self._home_fd)
        finally:
            os.close(aside_fd)
        _remove_entry(self._home_fd, AGENT_HOME)
        self._put_in(kept)

    def _take_out(self, paths: tuple[str, ...]) -> dict[str, str]:
        """Rename each home-relative dir of `paths` to a top-level name of its own (never
        following a symlink on the way): temporary name -> path. A path that is missing, a
        symlink or a file is dropped (and later made an empty dir)."""
        kept: dict[str, str] = {}
        for index, path in enumerate(paths):
            temp = f".pi-env-kept-{index}"
            _remove_entry(self._home_fd, temp)  # a command's, in the way
            try:
                with self._parent_dir(f"{SANDBOX_HOME}/{path}", create=False) as (dir_fd, name):
                    if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        os.rename(name, temp, src_dir_fd=dir_fd, dst_dir_fd=self._home_fd)
            except FileNotFoundError:
                pass
            kept[temp] = path
        return kept

    def _put_in(self, kept: dict[str, str]) -> None:
        for temp, path in kept.items():
            with self._parent_dir(f"{SANDBOX_HOME}/{path}", create=True) as (dir_fd, name):
                _remove_entry(dir_fd, name)
                try:
                    os.rename(temp, name, src_dir_fd=self._home_fd, dst_dir_fd=dir_fd)
                except FileNotFoundError:  # it was not a dir: an empty one
                    os.mkdir(name, 0o755, dir_fd=dir_fd)
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        self._chown(fd)
                    finally:
                        os.close(fd)

    def _clear_home(self, kept: dict[str, str]) -> None:
        for name in os.listdir(self._home_fd):  # deleted in place, never followed
            if name not in kept:
                _remove_entry(self._home_fd, name)
