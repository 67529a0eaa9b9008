"""The Pi runtime: the pinned Pi CLI plus a Node that satisfies it, installed once per machine
into a cache directory and mounted read-only into every sandbox (no per-rollout install).

Layout of one runtime (cache/runtimes/<key>/):
    pi/     npm prefix holding the Pi package
    node/   npm prefix holding node-linux-<arch> (only when the system node is too old)
    runtime.json   what was installed; written last, so its presence means "complete"
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

SANDBOX_RUNTIME_DIR = "/opt/pi-env/runtime"  # where a runtime appears inside every sandbox
NPM_INSTALL_TIMEOUT_S = 900


class RuntimeInstallError(RuntimeError):
    """Installing the Pi runtime failed; the message says what and how to fix it."""


@dataclass(frozen=True)
class PiRuntime:
    root: str  # host path of the runtime directory
    pi_package: str
    pi_version: str
    node_version: str  # version of the node that runs Pi
    node_in_runtime: bool  # False: the system node (/usr/bin/node) is used
    pi_cli_relpath: str  # the CLI entry point, relative to root
    flags: tuple[str, ...]  # options Pi's --help lists (older versions lack some)
    install_s: float = 0.0  # how long the first install took

    @property
    def archive_dir(self) -> str:
        """Where sandbox backends that upload the runtime keep its archive (beside the runtimes)."""
        return str(Path(self.root).parent.parent / "archives")

    @property
    def host_node(self) -> str:
        return str(Path(self.root) / self.node_relpath) if self.node_in_runtime else shutil.which("node") or "node"

    @property
    def host_cli(self) -> str:
        return str(Path(self.root) / self.pi_cli_relpath)

    @property
    def node_relpath(self) -> str:
        return f"node/node_modules/node-linux-{_node_arch()}/bin/node"

    @property
    def sandbox_node(self) -> str:
        return f"{SANDBOX_RUNTIME_DIR}/{self.node_relpath}" if self.node_in_runtime else "/usr/bin/node"

    @property
    def sandbox_cli(self) -> str:
        return f"{SANDBOX_RUNTIME_DIR}/{self.pi_cli_relpath}"

    def supports(self, flag: str) -> bool:
        return flag in self.flags


def default_cache_dir() -> Path:
    """$PI_ENV_CACHE, else a machine-wide cache for root (sandboxes run as other uids and
    cannot enter /root), else ~/.cache/pi-env (sandboxes of an ordinary user run as that user)."""
    if os.environ.get("PI_ENV_CACHE"):
        return Path(os.environ["PI_ENV_CACHE"])
    return Path("/var/cache/pi-env") if os.geteuid() == 0 else Path.home() / ".cache" / "pi-env"


def ensure_runtime(
    pi_package: str,
    pi_version: str,
    node_version: str,
    cache_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> PiRuntime:
    """Return the installed runtime, installing it first if needed. Safe when many processes
    call it at once: one installs under a lock, the others wait and reuse its result."""
    _check_version(pi_version)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = f"{pi_package.replace('/', '+').lstrip('@')}-{pi_version}"
    target = cache / "runtimes" / key
    runtime = _load(target)
    if runtime:
        return runtime
    _mkdir(cache / "locks")
    with open(cache / "locks" / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing: wait for it
        runtime = _load(target)
        if runtime:
            return runtime
        return _install(pi_package, pi_version, node_version, cache, target, progress or _stderr)


def _load(target: Path) -> PiRuntime | None:
    try:
        data = json.loads((target / "runtime.json").read_text())
        data["flags"] = tuple(data["flags"])
        runtime = PiRuntime(**data)
    except (FileNotFoundError, json.JSONDecodeError, TypeError, KeyError):
        return None
    return runtime if runtime.root == str(target) else None


def _install(
    package: str, version: str, node_version: str, cache: Path, target: Path, progress: Callable[[str], None]
) -> PiRuntime:
    npm = shutil.which("npm")
    if not npm:
        raise RuntimeInstallError("npm is not installed; install Node.js and npm (Debian: apt-get install nodejs npm)")
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=".installing-", dir=_mkdir(cache / "runtimes")))
    try:
        progress(f"Installing {package}@{version} into {target} (once per machine; about 20 s)...")
        _npm_install(npm, staging / "pi", f"{package}@{version}")
        package_dir = staging / "pi" / "node_modules" / package
        manifest = json.loads((package_dir / "package.json").read_text())
        required = manifest.get("engines", {}).get("node", "")
        system_node = _system_node_version()
        node_in_runtime = not (system_node and _satisfies(system_node, required))
        node_used = system_node or ""
        if node_in_runtime:
            progress(
                f"System node {system_node or '(none)'} does not satisfy {required!r}; "
                f"installing node-linux-{_node_arch()}@{node_version}..."
            )
            _npm_install(npm, staging / "node", f"node-linux-{_node_arch()}@{node_version}")
            node_used = node_version
            if not _satisfies(node_version, required):
                raise RuntimeInstallError(
                    f"node {node_version} does not satisfy {package}@{version}'s "
                    f"engines.node {required!r}; set PiConfig.node_version"
                )
        bin_entry = manifest["bin"]["pi"] if isinstance(manifest.get("bin"), dict) else manifest["bin"]
        cli_relpath = str(Path("pi/node_modules") / package / bin_entry)
        node = (staging / f"node/node_modules/node-linux-{_node_arch()}/bin/node") if node_in_runtime else "node"
        flags = _help_flags(str(node), str(staging / cli_relpath), staging)
        runtime = PiRuntime(
            root=str(target),
            pi_package=package,
            pi_version=version,
            node_version=node_used,
            node_in_runtime=node_in_runtime,
            pi_cli_relpath=cli_relpath,
            flags=flags,
            install_s=round(time.monotonic() - started, 2),
        )
        (staging / "runtime.json").write_text(json.dumps(asdict(runtime), indent=2))
        os.chmod(staging, 0o755)  # sandboxes run as other uids and must read it
        if target.exists():
            shutil.rmtree(target)  # a broken leftover (no runtime.json)
        os.rename(staging, target)
        progress(f"Pi runtime ready in {runtime.install_s:.0f} s.")
        return runtime
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _mkdir(path: Path) -> Path:
    """Create `path` traversable by every uid: sandboxes mount the runtime as other uids."""
    path.mkdir(parents=True, exist_ok=True)
    for directory in (path, path.parent):
        if directory.stat().st_uid == os.geteuid():
            directory.chmod(directory.stat().st_mode | 0o755)
    return path


def _npm_install(npm: str, prefix: Path, spec: str) -> None:
    command = [
        npm,
        "install",
        "--prefix",
        str(prefix),
        "--save-exact",
        "--ignore-scripts",
        "--no-audit",
        "--no-fund",
        "--no-update-notifier",
        "--loglevel=error",
        spec,
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=NPM_INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise RuntimeInstallError(
            f"`npm install {spec}` did not finish in {NPM_INSTALL_TIMEOUT_S} s; is the npm registry reachable?"
        ) from None
    if done.returncode != 0:
        head = "\n".join((done.stderr or done.stdout).strip().splitlines()[:6])  # npm puts the cause first
        hint = ""
        if re.search(r"ENOTFOUND|ECONNREFUSED|ETIMEDOUT|EAI_AGAIN|ECONNRESET|network", head, re.I):
            hint = (
                "\nThe npm registry is unreachable from this machine: check the network, or set "
                "npm_config_registry to a mirror you can reach."
            )
        elif re.search(r"E404|ETARGET|No matching version", head):
            hint = f"\n{spec} does not exist in the registry: check the package name and version."
        raise RuntimeInstallError(f"`npm install {spec}` failed (exit {done.returncode}):\n{head}{hint}")


def _help_flags(node: str, cli: str, home: Path) -> tuple[str, ...]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "PI_OFFLINE": "1",
        "PI_TELEMETRY": "0",
        "PI_CODING_AGENT_DIR": str(home / ".probe-agent"),
    }
    try:
        done = subprocess.run(
            [node, cli, "--help"], capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeInstallError(f"the installed Pi CLI does not start: {error}") from None
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", done.stdout + done.stderr))
    shutil.rmtree(home / ".probe-agent", ignore_errors=True)
    if "--print" not in flags:
        raise RuntimeInstallError(
            f"the installed Pi CLI does not look like Pi (no --print in --help):\n{(done.stdout + done.stderr)[-2000:]}"
        )
    return tuple(sorted(flags))


def _system_node_version() -> str | None:
    node = shutil.which("node")
    if not node:
        return None
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().lstrip("v") or None


def _node_arch() -> str:
    return {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), "x64"
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _satisfies(version: str, requirement: str) -> bool:
    """Enough of npm's semver for engines.node: space-separated >=, >, <, <=, = terms and
    `||` alternatives; an empty requirement is satisfied."""
    have = _version_tuple(version)
    for alternative in requirement.split("||"):
        terms = re.findall(r"(>=|<=|>|<|=|\^|~)?\s*v?(\d+(?:\.\d+){0,2})", alternative)
        ok = True
        for op, want_text in terms:
            want = _version_tuple(want_text)
            padded = have[: len(want)]
            if op == ">=" and not have >= want:
                ok = False
            elif op == ">" and not have > want:
                ok = False
            elif op == "<" and not padded < want:
                ok = False
            elif op == "<=" and not padded <= want:
                ok = False
            elif op in ("", "=") and padded != want:
                ok = False
            elif op == "^" and not (have >= want and have[0] == want[0]):
                ok = False
            elif op == "~" and not (have >= want and have[:2] == want[:2]):
                ok = False
        if ok:
            return True
    return not requirement.strip()


def _check_version(version: str) -> None:
    if not re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", version):
        raise RuntimeInstallError(f"pi_version {version!r} must be an exact version like 1.6.0 (pinned, no ranges)")


def _stderr(message: str) -> None:
    print(f"[pi-env] {message}", file=sys.stderr, flush=True)
