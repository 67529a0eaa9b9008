"""What the remote sandbox backends (hf.py, e2b.py) share: the whole sandbox protocol built on
five service primitives, so each service adapter stays small and both behave the same.

A service adapter (a `RemoteSession`) only has to: run a short shell script and return its exit
code and stdout (`run`), start a script in the background (`spawn`), upload and download a file
(`upload`, `download`) and delete the sandbox (`destroy`). Everything else happens here:

- Every command runs under a launcher script (`/tmp/.pi-env/<job>/launch.sh`) that gives it a
  clean environment (no service tokens), its stdin, its cwd, output files and an exit-code
  file, and tags it with PI_ENV_JOB=<sandbox>.<n>. Killing a command kills every process
  carrying its tag, found through /proc: that reaches what it started with setsid too.
  An exit code the launcher did not write (a killed command) is None: unknown, never success.
- exec() is start() + wait(); wait polls inside the sandbox (one request per 10 s slice), so
  a command costs three requests (upload launcher, spawn, wait+result).
- File operations check every path component for symlinks inside the sandbox and move data
  through a private staging dir, so a planted symlink never redirects them (the check and the
  move are two steps: an agent racing them can only affect its own sandbox's files).
- Retries with backoff only on transient transport errors (the adapter's `transient`), never
  on a command's failure; every request is safe to repeat (the launcher starts once).
- A hard lifetime: the service's own timeout where it has one (E2B); otherwise (HF) a watchdog
  inside the sandbox kills every command at the deadline and the service's idle timeout then
  stops the sandbox: a crashed client leaks no paid sandbox beyond lifetime + idle timeout.
- spec.ro_mounts are delivered by upload: a directory as one tar.gz, cached in spec.archive_dir
  (the Pi runtime is one prebuilt archive per runtime, never an npm install per sandbox) unpacked and made
  read-only, a file as itself. Read-only is chmod only: the sandbox runs as root.

The model gateway: a remote sandbox cannot see the host gateway's Unix socket, so
network="gateway" commands get PI_ENV_GATEWAY_URL, the host gateway's URL as the service
reaches it, and the agent's forwarder proxies to it; the agent holds only its per-session token.
The gateway never runs inside the sandbox: the agent is root there and would read its key.

Network modes per command only where the service has egress rules (E2B: the session's
`set_network`, called when a command's mode differs from the last one's); elsewhere (HF) the
network is the service's for every command. What a remote sandbox does NOT do (see
docs/backends.md, "Remote sandboxes"): spec.limits beyond ulimit (open files, file size),
agent_masked_paths.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import posixpath
import random
import re
import secrets
import shlex
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from pi_env.sandbox.base import (
    SANDBOX_HOME,
    SANDBOX_WORKDIR,
    ExecResult,
    Network,
    SandboxError,
    SandboxSpec,
)
from pi_env.sandbox.nofollow_files import relative_to_home
from pi_env.sandbox.processes import EXEC_OUTPUT_LIMIT_BYTES, _TailBuffer

log = logging.getLogger(__name__)

T = TypeVar("T")

LABEL = "pi-env"  # every remote sandbox carries LABEL=1 and LABEL-sandbox=<id>: find leftovers by it
DEFAULT_LIFETIME_S = 4 * 3600
JOBS_DIR = "/tmp/.pi-env"
WAIT_SLICE_S = 10.0  # one wait request blocks at most this long inside the sandbox
CONTROL_SLACK_S = 60.0  # a control script's own time plus the service's latency

# The host gateway's root URL as remote sandboxes reach it (see remote_gateway_url).
GATEWAY_URL_ENV = "PI_ENV_GATEWAY_URL"

# Exit codes of the file-operation scripts.
_SYMLINK, _MISSING, _IS_DIR = 40, 41, 42


class RemoteSession(Protocol):
    """One sandbox of a remote service, as the adapter of that service drives it."""

    id: str

    def run(self, script: str, timeout_s: float) -> tuple[int | None, str]:
        """`/bin/sh -c script`, waited for; (exit code or None if unknown, stdout)."""
        ...

    def spawn(self, script_path: str) -> None:
        """`/bin/sh script_path` in the background; returns once it is started."""
        ...

    def upload(self, path: str, data: bytes) -> None: ...

    def download(self, path: str) -> bytes: ...

    def destroy(self) -> None:
        """Delete the sandbox. Idempotent."""
        ...


class Retrying:
    """Calls repeated with exponential backoff and jitter while `transient(exc)` says the
    failure was the transport's (connection reset, 429/502/503/504), at most `attempts` times."""

    def __init__(
        self, transient: Callable[[BaseException], bool], attempts: int = 5, base_s: float = 0.5, cap_s: float = 8.0
    ):
        self.transient, self.attempts, self.base_s, self.cap_s = transient, attempts, base_s, cap_s

    def __call__(self, what: str, call: Callable[[], T]) -> T:
        attempt = 0
        while True:
            attempt += 1
            last: Exception
            try:
                return call()
            except (OSError, ValueError, SandboxError) as exc:  # ours (FileNotFoundError, ...)
                if not self.transient(exc):
                    raise
                last = exc
            except Exception as exc:
                if not self.transient(exc):  # the service said no: infrastructure, never reward 0
                    raise SandboxError(f"remote sandbox: {what} failed: {type(exc).__name__}: {exc}") from exc
                last = exc
            if attempt >= self.attempts:
                raise SandboxError(
                    f"remote sandbox: {what} still failing after {attempt} attempts: {type(last).__name__}: {last}"
                ) from last
            delay = min(self.cap_s, self.base_s * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            log.warning(
                "remote sandbox: %s failed transiently (%s: %s); retry %d/%d in %.1f s",
                what,
                type(last).__name__,
                last,
                attempt,
                self.attempts - 1,
                delay,
            )
            time.sleep(delay)


# ---------------------------------------------------------------------------------------------
# The runtime archive: one tar.gz per host directory, built once and cached


def remote_gateway_url(configured: str | None) -> str | None:
    """The gateway URL a remote backend hands its agents: the argument, else $PI_ENV_GATEWAY_URL.
    It must lead to this process's gateway TCP listener (Gateway.tcp_port), which authenticates
    every call by its per-session token; the upstream key never leaves this host."""
    url = configured or os.environ.get(GATEWAY_URL_ENV) or None
    if url and not url.startswith(("http://", "https://")):
        raise ValueError(f"{GATEWAY_URL_ENV} must be an http(s) URL, not {url!r}")
    return url.rstrip("/") if url else None


def open_sandbox(
    spec: SandboxSpec,
    open_session: Callable[[dict[str, str]], RemoteSession],
    *,
    labels: dict[str, str],
    retrying: Retrying,
    gateway_url: str | None,
    watchdog_s: float | None,
) -> RemoteSandbox:
    """What every remote backend's create() does around its service's own create call
    (`open_session(labels)`): refuse a spec whose gateway it cannot reach before paying for a
    sandbox, label it, retry the create, set it up, and delete it if the setup fails.
    watchdog_s: the lifetime a watchdog inside enforces (None: the service's own timeout does)."""
    if spec.gateway_socket and not gateway_url:
        raise SandboxError(
            "a remote sandbox cannot reach the host gateway's Unix socket: expose the gateway's TCP "
            "listener to the service (an authenticating tunnel or reverse proxy) and set "
            f"{GATEWAY_URL_ENV} (or gateway_url=) to its URL"
        )
    labels = {**labels, LABEL: "1", f"{LABEL}-sandbox": secrets.token_hex(8)}
    session = retrying("create", lambda: open_session(labels))
    sandbox = RemoteSandbox(session, spec, retrying, gateway_url=gateway_url)
    try:
        sandbox.setup(watchdog_s)
    except BaseException:
        sandbox.close()
        raise
    return sandbox


def directory_archive(path: str, cache_dir: Path) -> Path:
    """A cached tar.gz of the host directory `path` (for the Pi runtime: one prebuilt Node+Pi
    archive). Keyed by the path and every file's size and mtime, so a changed tree is rebuilt."""
    root = Path(path)
    digest = hashlib.sha256(str(root.resolve()).encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            st = os.lstat(os.path.join(dirpath, name))
            digest.update(
                f"{os.path.relpath(os.path.join(dirpath, name), root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode()
            )
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{digest.hexdigest()[:32]}.tar.gz"
    if not target.exists():
        fd, staging = tempfile.mkstemp(prefix=".building-", dir=cache)
        try:
            with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w:gz", compresslevel=6) as tar:
                tar.add(str(root), arcname=".")
            os.replace(staging, target)  # complete or absent, even with concurrent builders
        except BaseException:
            os.unlink(staging)
            raise
    return target


# ---------------------------------------------------------------------------------------------
# Scripts run inside the sandbox


def _q(value: str) -> str:
    return shlex.quote(value)


def _killer(pattern: str) -> str:
    """Shell: SIGKILL every process whose environment has a PI_ENV_JOB matching the grep
    regex `pattern`, again until none is left (a fork bomb keeps forking), at most 100 rounds."""
    return (
        "r=0; while [ $r -lt 100 ]; do r=$((r+1)); n=0; "
        "for e in /proc/[0-9]*/environ; do "
        f'if grep -qzx {_q("PI_ENV_JOB=" + pattern)} "$e" 2>/dev/null; then '
        'p=${e#/proc/}; kill -KILL "${p%/environ}" 2>/dev/null && n=1; fi; done; '
        "[ $n = 0 ] && break; done; true"
    )


def _no_symlink_in(full: str, *, last: bool) -> str:
    """Shell: exit _SYMLINK if a component of `full` below /root (the last one too if `last`)
    is a symlink."""
    parts = full[len(SANDBOX_HOME) + 1 :].split("/") if full != SANDBOX_HOME else []
    checks, current = [], SANDBOX_HOME
    for i, part in enumerate(parts):
        current = f"{current}/{part}"
        if i < len(parts) - 1 or last:
            checks.append(f"[ -L {_q(current)} ] && exit {_SYMLINK}; ")
    return "".join(checks)


def _clear_the_way(full: str) -> str:
    """Shell: remove whatever stands where write_file puts `full` and its parents (a symlink or
    a file where a directory goes, a directory where the file goes), never following it."""
    parts = full[len(SANDBOX_HOME) + 1 :].split("/")
    checks, current = [], SANDBOX_HOME
    for part in parts[:-1]:
        current = f"{current}/{part}"
        checks.append(
            f"if [ -L {_q(current)} ] || {{ [ -e {_q(current)} ] && [ ! -d {_q(current)} ]; }}; "
            f"then rm -f {_q(current)}; fi; "
        )
    checks.append(f"if [ -d {_q(full)} ] && [ ! -L {_q(full)} ]; then chmod -R u+w {_q(full)}; rm -rf {_q(full)}; fi; ")
    return "".join(checks)


def _safe_tree(data: bytes) -> bytes:
    """A tar archive of the members of `data` that extract inside their target dir: regular
    files, dirs and symlinks (as links, never followed on extraction) with relative names free
    of '..', none below a symlink member; hard links only to such a file. Device nodes, FIFOs
    and everything else are dropped. Bad archives give an empty one."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as clean:
        links: set[str] = set()
        files: set[str] = set()
        try:
            if data:  # no archive at all: an empty one
                with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                    for member in tar:
                        name = posixpath.normpath(member.name)
                        parts = name.split("/")
                        if (
                            name == "."
                            or name.startswith("/")
                            or ".." in parts
                            or any("/".join(parts[:i]) in links for i in range(1, len(parts)))
                        ):
                            continue
                        member.name, member.uid, member.gid, member.uname, member.gname = name, 0, 0, "root", "root"
                        member.mode &= 0o7777 & ~0o6000  # no setuid/setgid bits
                        if member.issym():
                            links.add(name)
                            clean.addfile(member)
                        elif member.islnk():
                            target = posixpath.normpath(member.linkname)
                            if target in files:
                                member.linkname = target
                                clean.addfile(member)
                        elif member.isdir():
                            clean.addfile(member)
                        elif member.isreg():
                            files.add(name)
                            clean.addfile(member, tar.extractfile(member))
        except (tarfile.TarError, EOFError, OSError) as error:
            log.warning("an exported tree was not a readable tar archive (%s): using what was read", error)
    return out.getvalue()


def _full_path(path: str) -> str:
    relative = relative_to_home(path)  # ValueError naming /root for anything outside it
    return f"{SANDBOX_HOME}/{relative}" if relative else SANDBOX_HOME


class RemoteProcess:
    """A command started by RemoteSandbox.start; its state lives in the sandbox's job dir."""

    def __init__(self, sandbox: RemoteSandbox, job: str, output_limit: int):
        self._sandbox, self._job, self._limit = sandbox, job, output_limit
        self._dir = f"{JOBS_DIR}/{job}"
        self._started = time.monotonic()
        self._killed = False
        self._result: ExecResult | None = None
        self._exit: int | None = None
        self._done = False
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        if self._done:
            return self._exit
        if self._sandbox._closed:  # deleted with its sandbox
            return -9
        code, out = self._sandbox._control(f"cat {_q(self._dir + '/rc')} 2>/dev/null", 60)
        if code == 0 and out.strip():
            self._done = True
            self._exit = int(out.strip())  # a killed command's too (137): poll() says "ended"
            return self._exit
        return None

    def kill(self) -> None:
        with self._lock:
            if self._done or self._result is not None:
                return
            self._killed = True
        if not self._sandbox._closed:
            self._sandbox._control(_killer(re.escape(self._job)), 120)

    def wait(self, timeout_s: float | None = None) -> ExecResult:
        with self._lock:
            if self._result is None and self._sandbox._closed:
                self._result = ExecResult(None, "", "", time.monotonic() - self._started)
            if self._result is not None:
                return self._result
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        timed_out = False
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                timed_out = True
                self.kill()
                remaining = WAIT_SLICE_S  # the launcher now writes its rc at once
            result = self._wait_slice(min(WAIT_SLICE_S, remaining or WAIT_SLICE_S))
            if result is not None:
                break
        with self._lock:
            if self._result is None:
                code, stdout, stderr = result
                self._done, self._exit = True, code
                self._result = ExecResult(
                    exit_code=None if self._killed else code,
                    stdout=stdout,
                    stderr=stderr,
                    duration_s=time.monotonic() - self._started,
                    timed_out=timed_out,
                )
            return self._result

    def _wait_slice(self, seconds: float) -> tuple[int, str, str] | None:
        """One request: wait up to `seconds` inside the sandbox for the exit-code file, then
        print it with the base64 tails of stdout and stderr."""
        d, limit, ticks = _q(self._dir), self._limit, max(1, int(seconds / 0.05))
        script = (
            f"i=0; while [ ! -e {d}/rc ] && [ $i -lt {ticks} ]; do sleep 0.05; i=$((i+1)); done; "
            f"[ -e {d}/rc ] || exit 3; cat {d}/rc; "
            f"for s in out err; do wc -c < {d}/$s; tail -c {limit} {d}/$s | base64 -w0; echo; done"
        )
        code, out = self._sandbox._control(script, seconds)
        if code == 3:
            return None
        if code != 0:
            raise SandboxError(f"remote sandbox {self._sandbox.id}: reading job {self._job} failed ({code})")
        lines = out.split("\n")
        streams = []
        for size, data in ((lines[1], lines[2]), (lines[3], lines[4])):
            buffer = _TailBuffer(limit)
            tail = base64.b64decode(data)
            buffer._dropped = int(size) - len(tail)
            buffer.append(tail)
            streams.append(buffer.text())
        return int(lines[0]), streams[0], streams[1]


class RemoteSandbox:
    """The sandbox protocol over a RemoteSession (see the module docstring)."""

    home = SANDBOX_HOME
    workdir = SANDBOX_WORKDIR

    def __init__(
        self, session: RemoteSession, spec: SandboxSpec, retrying: Retrying, *, gateway_url: str | None = None
    ):
        self._session, self._spec, self._retry = session, spec, retrying
        self.id = session.id
        self._tag = secrets.token_hex(6)  # the PI_ENV_JOB prefix of this sandbox's commands
        self._counter = 0
        self._lock = threading.Lock()
        self._closed = False
        self._processes: list[RemoteProcess] = []
        self._gateway_url = gateway_url
        self._network: Network | None = None  # the egress rules last set (services that have them)

    # -- plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    def _control(self, script: str, timeout_s: float) -> tuple[int, str]:
        code, out = self._retry("run", lambda: self._session.run(script, timeout_s + CONTROL_SLACK_S))
        if code is None:
            raise SandboxError(f"remote sandbox {self.id}: a control command ended with an unknown exit code")
        return code, out

    def _next(self) -> str:
        with self._lock:
            self._counter += 1
            return f"{self._tag}.{self._counter}"

    def setup(self, lifetime_s: float | None) -> None:
        """The work dir, the job dir, the lifetime watchdog (None: the service enforces the
        lifetime) and the read-only mounts."""
        self._control(f"mkdir -p {SANDBOX_WORKDIR} {JOBS_DIR} && chmod 700 {JOBS_DIR}", 60)
        if lifetime_s is not None:
            watchdog = f"{JOBS_DIR}/watchdog.sh"
            self._retry(
                "upload",
                lambda: self._session.upload(
                    watchdog, f"sleep {int(lifetime_s)}; {_killer(re.escape(self._tag) + '[.].*')}\n".encode()
                ),
            )
            self._retry("spawn", lambda: self._session.spawn(watchdog))
        for target, host in self._spec.ro_mounts.items():
            self._mount(target, host)

    def _archive(self, host: str) -> bytes:
        if self._spec.archive_dir:
            return directory_archive(host, Path(self._spec.archive_dir)).read_bytes()
        with tempfile.TemporaryDirectory(prefix="pi-env-archive-") as scratch:
            return directory_archive(host, Path(scratch)).read_bytes()

    def _mount(self, target: str, host: str) -> None:
        staging = f"{JOBS_DIR}/mount-{secrets.token_hex(4)}"
        if os.path.isdir(host):
            data = self._archive(host)
            unpack = f"mkdir -p {_q(target)} && tar -xzf {staging} -C {_q(target)} --no-same-owner && rm {staging}"
        else:
            data = Path(host).read_bytes()
            unpack = f"mkdir -p {_q(posixpath.dirname(target))} && mv {staging} {_q(target)}"
        self._retry("upload", lambda: self._session.upload(staging, data))
        code, out = self._control(f"{unpack} && chmod -R a-w {_q(target)}", 600)
        if code != 0:
            raise SandboxError(f"remote sandbox {self.id}: unpacking {host} at {target} failed: {out[-500:]}")

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
        process = self._launch(command, cwd, env, network, stdin, None, EXEC_OUTPUT_LIMIT_BYTES)
        return process.wait(timeout_s)

    def start(
        self,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        network: Network = "none",
        stdin_path: str | None = None,
        output_limit_bytes: int = 4 << 20,
    ) -> RemoteProcess:
        return self._launch(command, cwd, env, network, None, stdin_path, output_limit_bytes)

    def _launch(self, command, cwd, env, network, stdin, stdin_path, limit) -> RemoteProcess:
        self._check_open()
        if isinstance(command, str):  # bash where the image has it, as locally
            program = '"$(command -v bash || echo /bin/sh)" -c ' + _q(command)
        elif not command:
            raise ValueError("empty command")
        else:
            program = " ".join(_q(a) for a in command)
        extra = self._network_env(network)
        set_network = getattr(self._session, "set_network", None)  # a service with egress rules (E2B)
        if set_network is not None and network != self._network:
            host = urlsplit(self._gateway_url).hostname if self._gateway_url else None
            self._retry("network", lambda: set_network(network, host))
            self._network = network
        job = self._next()
        d = f"{JOBS_DIR}/{job}"
        environment = {
            "HOME": SANDBOX_HOME,
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            **self._spec.env,
            **(env or {}),
            **extra,
            "PI_ENV_JOB": job,
        }
        if stdin_path is not None:
            stdin_file = posixpath.normpath(posixpath.join(SANDBOX_WORKDIR, stdin_path))
        else:
            stdin_file = f"{d}/stdin" if stdin is not None else "/dev/null"
        workdir = posixpath.normpath(posixpath.join(SANDBOX_WORKDIR, cwd or "."))
        limits = self._spec.limits
        ulimits = f"ulimit -n {limits.max_open_files}; ulimit -f {limits.max_file_bytes // 512}; "
        # mkdir is atomic: a retried spawn starts the command once.
        # Commands run as root without capabilities (an empty bounding set), as locally with
        # --cap-drop ALL: read-only means read-only for them; control scripts keep theirs.
        script = (
            f"mkdir {d}/started 2>/dev/null || exit 0\n"
            "drop=; command -v setpriv >/dev/null && drop='setpriv --bounding-set=-all --inh-caps=-all'\n"
            f"( cd {_q(workdir)} && {ulimits}exec $drop env -i "
            + " ".join(_q(f"{k}={v}") for k, v in environment.items())
            + " "
            + program
            + f" ) < {_q(stdin_file)} > {d}/out 2> {d}/err\n"
            f"echo $? > {d}/rc.tmp && mv {d}/rc.tmp {d}/rc\n"
        )
        self._retry("upload", lambda: self._session.upload(f"{d}/launch.sh", script.encode()))
        if stdin is not None:
            self._retry("upload", lambda: self._session.upload(f"{d}/stdin", stdin))
        self._retry("spawn", lambda: self._session.spawn(f"{d}/launch.sh"))
        process = RemoteProcess(self, job, limit)
        with self._lock:
            self._processes.append(process)
        return process

    def _network_env(self, network: Network) -> dict[str, str]:
        if network not in ("none", "full", "gateway"):
            raise ValueError(f"network must be 'none', 'full' or 'gateway', not {network!r}")
        if network == "gateway":
            if not self._spec.gateway_socket:
                raise ValueError("network='gateway' needs a gateway: this sandbox's spec has none")
            if not self._gateway_url:
                raise ValueError(
                    "network='gateway' in a remote sandbox needs the host gateway's URL as the service "
                    "reaches it (its TCP listener behind an authenticating tunnel or reverse proxy): set "
                    f"{GATEWAY_URL_ENV} or pass gateway_url= to the backend"
                )
            return {GATEWAY_URL_ENV: self._gateway_url}  # read by the agent's forwarder (forward.mjs)
        return {}

    def kill_all(self) -> None:
        if self._closed:
            return
        with self._lock:
            for process in self._processes:
                process._killed = True  # whatever exit code they leave is ours, not theirs
        self._control(_killer(re.escape(self._tag) + "[.].*"), 120)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for process in self._processes:
                process._killed = True
        try:
            self._retry("destroy", self._session.destroy)
        except Exception as exc:  # the lifetime still bounds it; say which sandbox to find
            log.error("remote sandbox %s could not be deleted (%s); it ends at its lifetime", self.id, exc)
            raise SandboxError(f"deleting remote sandbox {self.id} failed: {exc}") from exc

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- files

    def _file_script(self, script: str, timeout_s: float = 120) -> tuple[int, str]:
        self._check_open()
        return self._control(script, timeout_s)

    def _raise_for(self, code: int, path: str, out: str) -> None:
        if code == _SYMLINK:
            raise SandboxError(f"{path!r}: refusing to follow a symlink in the sandbox")
        if code == _MISSING:
            raise FileNotFoundError(path)
        if code == _IS_DIR:
            raise IsADirectoryError(path)
        if code != 0:
            raise SandboxError(f"remote sandbox {self.id}: file operation on {path!r} failed ({code}): {out[-300:]}")

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        full = _full_path(path)
        if isinstance(data, str):
            data = data.encode()
        staging = f"{JOBS_DIR}/up-{secrets.token_hex(6)}"
        self._check_open()
        self._retry("upload", lambda: self._session.upload(staging, data))
        # mv replaces a symlink at the target itself (rename never follows it).
        code, out = self._file_script(
            f"{_clear_the_way(full)}mkdir -p {_q(posixpath.dirname(full))} || exit 1; "
            f"chmod {mode:o} {staging} && mv -fT {staging} {_q(full)}"
        )
        self._raise_for(code, path, out)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        full = _full_path(path)
        staging = f"{JOBS_DIR}/down-{secrets.token_hex(6)}"
        copy = f"head -c {max_bytes} {_q(full)}" if max_bytes is not None else f"cat {_q(full)}"
        code, out = self._file_script(
            f"{_no_symlink_in(full, last=False)}[ -L {_q(full)} ] && exit {_MISSING}; "
            f"[ -d {_q(full)} ] && exit {_IS_DIR}; [ -f {_q(full)} ] || exit {_MISSING}; "
            f"{copy} > {staging}"
        )
        if code == _SYMLINK:
            code = _MISSING  # through a symlinked dir: as good as missing, never followed
        self._raise_for(code, path, out)
        try:
            return self._retry("download", lambda: self._session.download(staging))
        finally:
            self._control(f"rm -f {staging}", 60)

    def exists(self, path: str) -> bool:
        full = _full_path(path)
        code, _ = self._file_script(f"{_no_symlink_in(full, last=True)}[ -e {_q(full)} ] || exit {_MISSING}")
        return code == 0

    def remove(self, path: str) -> None:
        full = _full_path(path)
        if full in (SANDBOX_HOME, SANDBOX_WORKDIR):
            script = f"find {_q(full)} -mindepth 1 -maxdepth 1 -exec chmod -R u+w {{}} + -exec rm -rf {{}} +"
        else:
            script = f"chmod -R u+w {_q(full)} 2>/dev/null; rm -rf {_q(full)}"
        code, out = self._file_script(f"{_no_symlink_in(full, last=False)}{script}")
        self._raise_for(code, path, out)

    def export_tree(self, path: str) -> bytes:
        """The directory `path` as a tar archive (symlinks as symlinks, nothing followed), for
        import_tree() into another sandbox; a missing one (or a symlink) as an empty archive.
        What comes back is rebuilt host-side from safe members only (_safe_tree): the agent
        was root here and may have replaced tar itself."""
        full = _full_path(path)
        staging = f"{JOBS_DIR}/export-{secrets.token_hex(6)}.tar"
        code, out = self._file_script(
            f"{_no_symlink_in(full, last=True)}[ -d {_q(full)} ] || exit {_MISSING}; tar -C {_q(full)} -cf {staging} .",
            600,
        )
        if code in (_MISSING, _SYMLINK):
            return _safe_tree(b"")  # an empty archive
        self._raise_for(code, path, out)
        try:
            return _safe_tree(self._retry("download", lambda: self._session.download(staging)))
        finally:
            self._control(f"rm -f {staging}", 60)

    def import_tree(self, path: str, data: bytes) -> None:
        """Replace the directory `path` with the content of an export_tree() archive."""
        full = _full_path(path)
        staging = f"{JOBS_DIR}/import-{secrets.token_hex(6)}.tar"
        self._check_open()
        self._retry("upload", lambda: self._session.upload(staging, data))
        code, out = self._file_script(
            f"{_clear_the_way(full)}mkdir -p {_q(full)} && "
            f"tar -C {_q(full)} -xf {staging} --no-same-owner; c=$?; rm -f {staging}; exit $c",
            600,
        )
        self._raise_for(code, path, out)

    def snapshot(
        self, path: str, *, max_files: int = 200, max_file_bytes: int = 256 << 10, max_total_bytes: int | None = None
    ) -> dict[str, bytes]:
        full = _full_path(path)
        staging = f"{JOBS_DIR}/snap-{secrets.token_hex(6)}.tar"
        code, out = self._file_script(
            f"{_no_symlink_in(full, last=True)}[ -d {_q(full)} ] || exit {_MISSING}; cd {_q(full)} && "
            f"find . -type f -size -{max_file_bytes + 1}c -print0 | sort -z | head -z -n {max_files} "
            f"| tar -cf {staging} --null -T -"
        )
        if code in (_MISSING, _SYMLINK):
            return {}
        self._raise_for(code, path, out)
        try:
            data = self._retry("download", lambda: self._session.download(staging))
        finally:
            self._control(f"rm -f {staging}", 60)
        files = {}
        left = max_total_bytes
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.isfile() and (left is None or member.size <= left):
                    content = tar.extractfile(member)
                    assert content is not None, "a regular file member has its data in the archive"
                    files[posixpath.normpath(member.name)] = content.read()
                    left = None if left is None else left - member.size
        return files
