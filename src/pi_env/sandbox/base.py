"""The sandbox protocol: what every backend (local bubblewrap, podman, remote services) offers.

A backend knows nothing about Pi. Paths given to a sandbox are sandbox paths: absolute ones
(``/root/workdir/x.py``) or relative ones, which are relative to the work dir.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from ..errors import InfraError, exit_code_for

# "none": loopback only; "full": the host's network (setup may install packages);
# "gateway": no network, but the model gateway's Unix socket is bound at GATEWAY_SOCKET.
Network = Literal["none", "full", "gateway"]

SANDBOX_HOME = "/root"
SANDBOX_WORKDIR = "/root/workdir"
GATEWAY_SOCKET = "/run/pi-env/gateway.sock"
RUNTIME_DIR = "/opt/pi-env"


class SandboxError(InfraError, RuntimeError):
    """The sandbox itself failed (infrastructure), as opposed to a command inside it failing."""


class EnvironmentUnsupported(SandboxError):
    """The backend cannot honour the spec's environment (the message says what and why)."""

    error_kind = "environment_unsupported"
    exit_code = exit_code_for("environment_unsupported")


class EnvironmentBuildError(SandboxError):
    """Building the spec's environment failed (the message has the build log's tail)."""

    error_kind = "environment_build_failed"
    exit_code = exit_code_for("environment_build_failed")


class SandboxUnavailable(SandboxError):
    """The backend cannot run on this machine (for example bubblewrap is not installed)."""


@dataclass(frozen=True)
class SandboxLimits:
    max_processes: int = 256  # RLIMIT_NPROC of the sandbox's own uid: stops fork bombs
    max_file_bytes: int = 1 << 30  # RLIMIT_FSIZE
    max_memory_bytes: int | None = 8 << 30  # RLIMIT_DATA (RLIMIT_AS breaks node)
    max_open_files: int = 4096
    # Per sandbox, whatever it forks or writes (see sandbox/totals.py); None: no total.
    max_total_memory_bytes: int | None = 4 << 30  # the memory cgroup: RSS, tmpfs and page cache
    max_disk_bytes: int | None = 10 << 30  # its home (work dir included): a size-capped tmpfs


@dataclass(frozen=True)
class EnvironmentSpec:
    """A container environment for the sandbox: a Dockerfile and its build context (Harbor's
    environment/ dir), or a prebuilt image. Backends that build environments (local: layers,
    podman: images) honour it in create(); the others never get one (see pi_env.harbor)."""

    dockerfile: str | None = None  # host path
    context: str | None = None  # host dir the Dockerfile's COPY sources are relative to
    image: str | None = None  # a prebuilt image instead of a build (Harbor's docker_image)
    build_timeout_s: float = 600.0


@dataclass(frozen=True)
class SandboxSpec:
    """What a new sandbox looks like. `ro_mounts` maps sandbox path -> host path (read-only)."""

    ro_mounts: dict[str, str] = field(default_factory=dict)
    gateway_socket: str | None = None  # host path of the gateway's Unix socket
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    env: dict[str, str] = field(default_factory=dict)  # base environment of every command
    # Sandbox paths hidden behind an empty tmpfs while a "gateway" (agent) command runs.
    agent_masked_paths: tuple[str, ...] = ()
    # Host dir where a backend that uploads ro_mounts (the remote ones) keeps a directory's
    # archive between sandboxes; None: the archive is built afresh for each sandbox.
    archive_dir: str | None = None
    environment: EnvironmentSpec | None = None
    # Root of a container (Docker's default capabilities, uid 0 and nobody mapped) for every
    # command but the agent's (network="gateway"), which stays without capabilities.
    container_root: bool = False


@dataclass
class ExecResult:
    exit_code: int | None  # None: unknown (killed, timed out); never read as success
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False


@runtime_checkable
class SandboxProcess(Protocol):
    """A command started in the background."""

    def wait(self, timeout_s: float | None = None) -> ExecResult:
        """Wait for exit; on timeout kill the whole command and return timed_out=True."""
        ...

    def poll(self) -> int | None: ...

    def kill(self) -> None:
        """Kill the command and every process it started. Idempotent."""
        ...


@runtime_checkable
class Sandbox(Protocol):
    id: str
    home: str
    workdir: str

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
        """Run a command (a str goes through `bash -c`) and wait for it."""
        ...

    def start(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        network: Network = "none",
        stdin_path: str | None = None,
        output_limit_bytes: int = 4 << 20,
    ) -> SandboxProcess:
        """Start a command in the background. stdin_path is a sandbox path read as stdin
        (the command sees EOF at its end); stdout/stderr are kept on the host side,
        bounded to the last `output_limit_bytes`."""
        ...

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write a file, creating parent directories. Whatever the sandbox put in the way (a
        symlink or a file where a directory goes, a directory or symlink where the file goes)
        is replaced, never followed."""
        ...

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Read a file; FileNotFoundError when it is missing (or is a symlink)."""
        ...

    def exists(self, path: str) -> bool: ...

    def remove(self, path: str) -> None:
        """Remove a file or a directory tree, if present. Never follows symlinks."""
        ...

    def snapshot(
        self,
        path: str,
        *,
        max_files: int = 200,
        max_file_bytes: int = 256 << 10,
        max_total_bytes: int | None = None,
    ) -> dict[str, bytes]:
        """Regular files under `path` (relative path -> bytes), skipping symlinks and files
        larger than max_file_bytes or than what is left of max_total_bytes, at most max_files
        of them."""
        ...

    def kill_all(self) -> None:
        """Kill every process of the sandbox (the sandbox stays usable)."""
        ...

    def close(self) -> None:
        """Kill everything and delete the sandbox. Idempotent."""
        ...

    # Optional abilities, each a Protocol below, checked with isinstance(): RestoresHome or
    # ExportsTrees (one of them is needed for verify's clean world), HostPaths.


@runtime_checkable
class RestoresHome(Protocol):
    """A sandbox whose commands can write only its home (local, podman, unsafe-local): verify
    runs in it once the home is back as setup left it (pi_env.verify.world: VerifyWorld.build)."""

    def checkpoint_home(self) -> None:
        """After setup, with nothing running: keep the home (all but the work dir) out of reach."""
        ...

    def restore_home(self, keep: tuple[str, ...] = (), *, set_aside: bool = False) -> list[str]:
        """Before verify: kill every command, put all but the work dir and `keep` back as
        checkpointed; `set_aside` keeps the agent's home for put_back_agent_home(). Returns
        what could not be put back, as sentences."""
        ...

    def reset_home(self, keep: tuple[str, ...] = ()) -> list[str]:
        """Between verify commands: setup's home again, but the work dir, `keep` and what
        restore_home set aside (an earlier command's agent code changed the rest)."""
        ...

    def put_back_agent_home(self) -> None:
        """Undo a set-aside restore: a multi-step task's next agent continues in its home."""
        ...


@runtime_checkable
class ExportsTrees(Protocol):
    """A sandbox whose commands can change the whole machine (remote services): verify runs in a
    fresh sandbox that receives only the agent's work dir and output dirs."""

    def export_tree(self, path: str) -> bytes:
        """The directory `path` as a tar archive (nothing followed)."""
        ...

    def import_tree(self, path: str, data: bytes) -> None:
        """Replace the directory `path` with an export_tree() archive."""
        ...


@runtime_checkable
class HostPaths(Protocol):
    """A sandbox that mounts nothing (unsafe-local): its commands see host paths."""

    def host_path(self, path: str) -> str:
        """The host path standing for a sandbox path."""
        ...


@runtime_checkable
class SandboxBackend(Protocol):
    name: str

    def create(self, spec: SandboxSpec) -> Sandbox: ...
