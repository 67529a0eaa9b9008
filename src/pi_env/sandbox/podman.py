"""Podman sandbox backend: every command runs in a fresh container from one image.

For tasks that need a real distribution image rather than the host's /usr (the local
backend's view). No Python dependency: it shells out to `podman` (rootful, run as root).

A sandbox is a host dir, as for the local backend (hostdir.py): its `home/` is bind-mounted
at /root, so the file API (write_file, read_file, ...) works on the host side with the same
symlink-safe code, and the home persists across commands until close(). Each exec()/start()
is one `podman run --rm` of the image, so like the local backend's namespaces:
- the image's root filesystem is read-only; /tmp, /run and /dev/shm are size-capped tmpfs
  mounts private to each command; spec.ro_mounts are bound read-only;
- no capabilities (`--cap-drop all`, no-new-privileges), uid 0 of the container, which on the
  host is root without capabilities: it can write only what root owns (its home), and sees no
  host path but its mounts;
- network "none" and "gateway": `--network none` (loopback only), with the gateway's Unix
  socket bound at GATEWAY_SOCKET and spec.agent_masked_paths hidden behind empty dirs in
  "gateway"; network "full": a network namespace of the sandbox's own given the internet, but
  no host service, by slirp4netns (usernet.NetworkHolder, joined with `--network ns:PATH`);
- limits: `--pids-limit` (max_processes: the container's pids cgroup; RLIMIT_NPROC, given
  because podman needs it explicit here, is never enforced for host root), `--memory`
  (max_memory_bytes, a cgroup limit, so stricter than the local backend's RLIMIT_DATA),
  `--ulimit` nofile/fsize/core;
- a command and everything it started die together: killing it removes its container.

Every container is labelled `pi-env.sandbox=<id>` and `pi-env.host-dir=<host dir>`; kill_all()
and close() remove the sandbox's containers by label, and a new backend removes the
containers of sandboxes whose owner died (their host dir's lock is free; see owned_dirs.py).

Host facts this is built for (Debian 12, podman 4.3): crun fails on hybrid cgroup v1 layouts,
so the runtime is runc (`PI_ENV_PODMAN_RUNTIME` to change), and ulimits are always given
explicitly. Images: `scripts/podman_image.sh` builds the default one offline from debootstrap
(bookworm minbase with python3); `PI_ENV_PODMAN_IMAGE` names another. The Pi runtime (a glibc
Node) is bound read-only from the host, so any glibc image (Debian, Ubuntu, python:*-slim)
runs it; musl images (Alpine) do not.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

from pi_env.sandbox.base import (
    GATEWAY_SOCKET,
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    EnvironmentBuildError,
    EnvironmentSpec,
    ExecResult,
    Network,
    SandboxError,
    SandboxSpec,
    SandboxUnavailable,
)
from pi_env.sandbox.hostdir import HostDirSandbox
from pi_env.sandbox.layers import DOCKER_CAPS
from pi_env.sandbox.local import _DEFAULT_ENV, SMALL_TMPFS_BYTES, init_argv
from pi_env.sandbox.owned_dirs import (
    LOCK_SUFFIX,
    default_root,
    discard_host_dir,
    make_host_dir,
    private_dir,
    sweep_stale_host_dirs,
)
from pi_env.sandbox.usernet import SLIRP_DNS, NetworkHolder

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "localhost/pi-env-base:bookworm"
BUILD_HINT = "build it with `scripts/podman_image.sh` (or name another image in PI_ENV_PODMAN_IMAGE)"
LABEL_SANDBOX = "pi-env.sandbox"
LABEL_HOST_DIR = "pi-env.host-dir"
PODMAN_FAILED = 125  # `podman run`'s own exit code when it could not run the container
KILL_WAIT_S = 10.0  # how long `podman run` may take to notice its container is gone
PODMAN_TIMEOUT_S = 60.0  # a podman management command (ps, kill, rm)


class PodmanSandbox(HostDirSandbox):
    """A host dir mounted at /root, and one container per command (see the module doc)."""

    def __init__(
        self,
        host_dir: str,
        lock_fd: int,
        spec: SandboxSpec,
        backend: PodmanBackend,
        image: str | None = None,
        image_env: dict[str, str] | None = None,
    ):
        """image: the sandbox's own image (a built environment) instead of the backend's;
        image_env: its ENV, which stands above pi-env's defaults and below spec.env."""
        super().__init__(host_dir, None, lock_fd)
        self._image_env = image_env or {}
        self._spec = spec
        self._podman = backend.podman
        self._counter = itertools.count()
        limits = spec.limits
        ulimits = {
            "nofile": limits.max_open_files,
            "nproc": limits.max_processes,
            "fsize": limits.max_file_bytes,
            "core": 0,
        }
        # fmt: off
        self._base_args = [
            backend.podman, "run", "--rm", "--interactive", "--pull", "never",
            "--runtime", backend.runtime, "--log-driver", "none",
            "--label", f"{LABEL_SANDBOX}={self.id}", "--label", f"{LABEL_HOST_DIR}={host_dir}",
            "--cap-drop", "all", "--security-opt", "no-new-privileges", "--user", "0:0",
            "--hostname", "pi-env", "--read-only", "--read-only-tmpfs=false",
            "--tmpfs", f"/tmp:rw,mode=1777,size={limits.max_file_bytes}",
            "--tmpfs", f"/run:rw,mode=755,size={SMALL_TMPFS_BYTES}",
            "--shm-size", str(SMALL_TMPFS_BYTES),
            "--pids-limit", str(limits.max_processes),
            *(f"--ulimit={name}={value}:{value}" for name, value in ulimits.items()),
            "--volume", f"{self.host_home}:{SANDBOX_HOME}:rw",
        ]
        # fmt: on
        # A cgroup limit of the container (RSS, tmpfs, page cache; no swap): the agent's Pi and
        # every tool it runs are one container, so this is the agent's memory total.
        memory = min((m for m in (limits.max_total_memory_bytes, limits.max_memory_bytes) if m), default=None)
        if memory is not None:
            self._base_args += ["--memory", str(memory), "--memory-swap", str(memory)]
        for target in sorted(spec.ro_mounts, key=lambda t: t.count("/")):  # parents first
            self._base_args += ["--volume", f"{os.path.abspath(spec.ro_mounts[target])}:{target}:ro"]
        self._gateway_args: list[str] = []
        if spec.gateway_socket:
            self._gateway_args = ["--volume", f"{spec.gateway_socket}:{GATEWAY_SOCKET}"]
            # An empty read-only dir over each masked path (a --tmpfs would be mounted before
            # the home volume, which then covers it).
            empty = os.path.join(host_dir, "empty")
            os.mkdir(empty, 0o555)
            for masked in spec.agent_masked_paths:
                self._gateway_args += ["--volume", f"{empty}:{masked}:ro"]
        self._image = image or backend.image
        self._network: NetworkHolder | None = None  # made by the first network="full" command
        self.environment_info: dict | None = None

    def exec(self, command: str | list[str], **kwargs) -> ExecResult:
        result = super().exec(command, **kwargs)
        if result.exit_code == PODMAN_FAILED and result.stderr.startswith("Error: "):
            # podman failed, not the command: infrastructure, never the command's outcome
            raise SandboxError(f"podman could not run the command: {result.stderr.strip()[-500:]}")
        return result

    def _popen_args(
        self,
        command: str | list[str],
        cwd: str | None,
        env: dict[str, str] | None,
        network: Network,
    ) -> dict:
        argv = init_argv(command)
        args = [*self._base_args, "--name", f"pi-env-{self.id}-{next(self._counter)}"]
        if self._spec.container_root and network != "gateway":
            # Harbor's setup and verifier: Docker's default capabilities and a writable (per
            # command, discarded) root fs, as in `docker run`; the agent never gets them.
            args.remove("--read-only")
            args += [arg for cap in DOCKER_CAPS for arg in ("--cap-add", cap)]
        if network == "full":
            # The sandbox's own namespace with the internet but not the host (usernet.py).
            if self._network is None:
                self._network = NetworkHolder()
            args += ["--network", f"ns:{self._network.path}", "--dns", SLIRP_DNS]
        elif network in ("none", "gateway"):
            args += ["--network", "none"]
            if network == "gateway":
                if not self._gateway_args:
                    raise ValueError('network="gateway" needs spec.gateway_socket')
                args += self._gateway_args
        else:
            raise ValueError(f"unknown network mode {network!r}")
        for name, value in {**_DEFAULT_ENV, **self._image_env, **self._spec.env, **(env or {})}.items():
            args += ["--env", f"{name}={value}"]
        args += ["--workdir", posixpath.normpath(posixpath.join(SANDBOX_WORKDIR, cwd or "."))]
        return {"args": [*args, self._image, *argv], "cwd": "/", "env": _podman_env()}

    def _terminate(self, popen: subprocess.Popen) -> None:
        """Remove the command's container (the kernel kills all of its processes with it);
        `podman run` then exits. A container still being created is retried until it exists
        or the client gave up."""
        args = popen.args
        assert isinstance(args, list), "_popen_kwargs gives podman run its arguments as a list"
        name = args[args.index("--name") + 1]
        deadline = time.monotonic() + KILL_WAIT_S
        while popen.poll() is None:
            _podman(self._podman, "rm", "--force", "--time", "0", name, check=False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(0.5)
                return
            if time.monotonic() > deadline:
                popen.kill()  # the client is stuck: kill_all()'s label sweep gets its container
                popen.wait()
                return

    def _release(self) -> None:
        if self._network is not None:
            self._network.stop()

    def kill_all(self) -> None:
        super().kill_all()
        # By label too: containers whose `podman run` client is gone, or was still creating
        # them when it was killed. close() calls this once no new command can start.
        remove_containers(self._podman, f"{LABEL_SANDBOX}={self.id}")


class PodmanBackend:
    """Sandboxes in podman containers. SandboxUnavailable when podman, its runtime or the
    image is missing, or when not run as root (the backend uses rootful podman)."""

    name = "podman"

    def __init__(self, image: str | None = None, root: str | None = None, *, podman: str = "podman"):
        self.image = image or os.environ.get("PI_ENV_PODMAN_IMAGE") or DEFAULT_IMAGE
        self.runtime = os.environ.get("PI_ENV_PODMAN_RUNTIME", "runc")
        found = shutil.which(podman)
        if found is None:
            raise SandboxUnavailable(
                f"podman ({podman!r}) was not found: install it (`apt-get install podman runc` on "
                f"Debian/Ubuntu) and {BUILD_HINT}"
            )
        self.podman = found
        if os.geteuid() != 0:
            raise SandboxUnavailable("the podman backend uses rootful podman: run as root")
        if shutil.which(self.runtime) is None:
            raise SandboxUnavailable(
                f"the OCI runtime {self.runtime!r} was not found: install it (`apt-get install "
                f"{self.runtime}`) or name another in PI_ENV_PODMAN_RUNTIME"
            )
        if _podman(self.podman, "image", "exists", self.image, check=False).returncode != 0:
            raise SandboxUnavailable(f"podman image {self.image!r} is missing: {BUILD_HINT}")
        self.root = root or default_root() + "-podman"
        private_dir(self.root, 0o700)
        sweep_stale_host_dirs(self.root, self._reclaim)
        self._sweep_orphan_containers()

    def create(self, spec: SandboxSpec) -> PodmanSandbox:
        for target in (*spec.ro_mounts, *spec.agent_masked_paths):
            if not posixpath.isabs(target) or posixpath.normpath(target) != target:
                raise ValueError(f"sandbox path {target!r} must be a normalised absolute path")
        for target, source in spec.ro_mounts.items():
            if not os.path.exists(source):
                raise SandboxError(f"ro_mount source {source} (for {target}) does not exist")
            if ":" in source or ":" in target or "," in source:
                raise SandboxError(f"ro_mount {source} -> {target}: podman cannot mount paths with ':' or ','")
        if spec.gateway_socket and not stat.S_ISSOCK(os.stat(spec.gateway_socket).st_mode):
            raise SandboxError(f"gateway socket {spec.gateway_socket} is not a Unix socket")
        image, info = self._environment_image(spec.environment) if spec.environment else (None, None)
        host_dir, lock_fd = make_host_dir(self.root, None, spec.limits.max_disk_bytes)
        try:
            image_env = {}
            if spec.container_root:  # nobody must reach the work dir, as /app in a container
                os.chmod(os.path.join(host_dir, "home"), 0o711)
            if image:
                config = _image_config(self.podman, image)
                image_env = dict(item.partition("=")[::2] for item in config.get("Env") or [])
                self._copy_workdir(image, config.get("WorkingDir") or "", host_dir)
            sandbox = PodmanSandbox(host_dir, lock_fd, spec, self, image, image_env)
            sandbox.environment_info = info
            return sandbox
        except BaseException:
            discard_host_dir(host_dir, lock_fd)
            raise

    builds_environments = True

    def _environment_image(self, environment: EnvironmentSpec) -> tuple[str, dict]:
        """The image a task's environment runs in: its docker_image, or its Dockerfile built once
        (tagged by a hash of the Dockerfile and its context, under a flock, with the host's
        network); a base image that is neither local nor pullable is named in the error."""
        if environment.image:
            if _podman(self.podman, "image", "exists", environment.image, check=False).returncode != 0:
                pulled = _podman(
                    self.podman, "pull", environment.image, check=False, timeout=environment.build_timeout_s
                )
                if pulled.returncode != 0:
                    raise EnvironmentBuildError(
                        f"docker_image {environment.image!r} is not a local image and cannot "
                        f"be pulled: {pulled.stderr.strip()[-400:]}"
                    )
            return environment.image, {"image": environment.image, "built_now": False, "build_s": 0.0}
        dockerfile = environment.dockerfile
        if not dockerfile:  # task metadata can say needs_build with neither
            raise EnvironmentBuildError("the task's environment names neither a docker_image nor a Dockerfile")
        key = _context_key(dockerfile, environment.context)
        tag = f"localhost/pi-env-env:{key}"
        private_dir(self.root, 0o700)
        fd = os.open(os.path.join(self.root, f"build-{key}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _podman(self.podman, "image", "exists", tag, check=False).returncode == 0:
                return tag, {"image": tag, "built_now": False, "build_s": 0.0}
            started = time.monotonic()
            # The host's trusted CAs overlaid on the build steps' (writes discarded, never in the
            # image): builds reach package indexes behind a TLS-inspecting proxy as the host does.
            certs = ["--volume", "/etc/ssl/certs:/etc/ssl/certs:O"] if os.path.isdir("/etc/ssl/certs") else []
            built = _podman(
                self.podman,
                "build",
                "--network",
                "host",
                "--runtime",
                self.runtime,
                "--pull=missing",
                *certs,
                "--ulimit",
                "nofile=4096:4096",
                "--ulimit",
                "nproc=4096:4096",
                "--tag",
                tag,
                "--file",
                dockerfile,
                environment.context or os.path.dirname(dockerfile),
                check=False,
                timeout=environment.build_timeout_s,
            )
            if built.returncode != 0:
                log_tail = (built.stdout + built.stderr).strip()[-2500:]
                bases = [
                    b
                    for b in _from_images(dockerfile)
                    if _podman(self.podman, "image", "exists", b, check=False).returncode != 0
                ]
                if bases and re.search(
                    r"initializing source|pulling image|manifest unknown|resolve|"
                    r"short-name|name unknown|requested access",
                    log_tail,
                    re.I,
                ):
                    raise EnvironmentBuildError(
                        f"base image {bases[0]!r} (FROM) is not a local image and cannot be pulled here; "
                        f"`podman pull` or `podman tag` a local image as {bases[0]!r}. podman said:\n{log_tail[-800:]}"
                    )
                raise EnvironmentBuildError(f"podman build of {dockerfile} failed; log tail:\n{log_tail}")
            return tag, {"image": tag, "built_now": True, "build_s": round(time.monotonic() - started, 3)}
        finally:
            os.close(fd)

    def _copy_workdir(self, image: str, workdir: str, host_dir: str) -> None:
        """What the image holds in its WORKDIR becomes the sandbox's work dir (/root/workdir)."""
        if workdir in ("", "/", SANDBOX_HOME) or workdir.startswith(SANDBOX_HOME + "/"):
            return
        target = os.path.join(host_dir, "home")
        done = _podman(
            self.podman,
            "run",
            "--rm",
            "--pull",
            "never",
            "--runtime",
            self.runtime,
            "--network",
            "none",
            "--ulimit",
            "nofile=4096:4096",
            "--ulimit",
            "nproc=4096:4096",
            "--user",
            "0:0",
            "--volume",
            f"{target}:/mnt/pi-env-home:rw",
            "--entrypoint",
            "/bin/sh",
            image,
            "-c",
            'test -d "$1" || exit 0; cp -a "$1"/. /mnt/pi-env-home/workdir/',
            "sh",
            workdir,
            check=False,
        )
        if done.returncode != 0:
            raise SandboxError(f"could not copy {workdir} out of {image}: {done.stderr.strip()[-400:]}")

    def _reclaim(self, host_dir: str) -> None:
        remove_containers(self.podman, f"{LABEL_HOST_DIR}={host_dir}")

    def _sweep_orphan_containers(self) -> None:
        """Remove containers of sandboxes whose host dir is gone (a sweep by another process
        deleted it, or the machine rebooted): nothing can own them any more."""
        listing = _podman(
            self.podman,
            "ps",
            "--all",
            "--filter",
            f"label={LABEL_HOST_DIR}",
            "--format",
            f'{{{{.ID}}}} {{{{index .Labels "{LABEL_HOST_DIR}"}}}}',
        ).stdout
        orphans = [
            cid
            for cid, _, host_dir in (line.partition(" ") for line in listing.splitlines())
            if host_dir.startswith(self.root + "/") and not os.path.exists(host_dir + LOCK_SUFFIX)
        ]
        if orphans:
            log.warning("removing %d podman container(s) of dead pi-env sandboxes", len(orphans))
            _podman(self.podman, "rm", "--force", "--time", "0", *orphans, check=False)


def remove_containers(podman: str, label: str) -> None:
    """Remove (killing first) every container with `label` ("key=value")."""
    ids = _podman(podman, "ps", "--all", "--quiet", "--filter", f"label={label}").stdout.split()
    if ids:
        _podman(podman, "rm", "--force", "--time", "0", *ids, check=False)


def _podman_env() -> dict[str, str]:
    # podman needs PATH (for conmon and the runtime); nothing else of ours should reach it.
    return {"PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")}


def _image_config(podman: str, image: str) -> dict:
    listing = _podman(podman, "image", "inspect", "--format", "{{json .Config}}", image).stdout
    return json.loads(listing or "{}") or {}


def _context_key(dockerfile: str, context: str | None) -> str:
    """A hash of the Dockerfile and every file of its build context (names and contents)."""
    digest = hashlib.sha256(Path(dockerfile).read_bytes())
    root = Path(context or os.path.dirname(dockerfile))
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:32]


def _from_images(dockerfile: str) -> list[str]:
    from pi_env.sandbox.layers import instructions

    images = []
    for _, instruction in instructions(Path(dockerfile).read_text(encoding="utf-8")):
        word, _, rest = instruction.partition(" ")
        if word.upper() == "FROM":
            args = [a for a in rest.split() if not a.startswith("--")]
            if args and args[0].lower() != "scratch":
                images.append(args[0])
    return images


def _podman(
    podman: str, *args: str, check: bool = True, timeout: float = PODMAN_TIMEOUT_S
) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(
            [podman, *args], capture_output=True, text=True, cwd="/", env=_podman_env(), timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise SandboxError(f"`podman {' '.join(args[:2])}` did not answer in {timeout:g} s") from exc
    if check and result.returncode != 0:
        raise SandboxError(f"`podman {' '.join(args[:2])}` failed: {result.stderr.strip()[-500:]}")
    return result
