"""An agent's runtime, installed once per machine into a cache directory and mounted read-only
into every sandbox (no per-rollout install): `cached_install` (the lock, the staging dir, the
record written last) for any agent, and `ensure_runtime` for an npm agent package (Pi's by
default) plus a Node that satisfies it.

Layout of one runtime (cache/runtimes/<key>/):
    pi/     npm prefix holding the Pi package
    node/   npm prefix holding node-linux-<arch> (only when the system node is too old)
    compile-cache/  Node's compile cache, built once by a warm-up run at the sandbox's paths
            (only for agents that ask for it: `ensure_runtime(warm=...)`, `build_compile_cache`)
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import InfraError

SANDBOX_RUNTIME_DIR = "/opt/pi-env/runtime"  # where a runtime appears inside every sandbox
NPM_INSTALL_TIMEOUT_S = 900
COMPILE_CACHE_RELPATH = "compile-cache"
COMPILE_CACHE_KEY_SUFFIX = "+cc1"  # an install with a compile cache: its own key (layout and record)
WARM_UP_TIMEOUT_S = 180


class RuntimeInstallError(InfraError, RuntimeError):
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
    compile_cache: bool = False  # root/compile-cache holds Node's compile cache (build_compile_cache)

    @property
    def archive_dir(self) -> str:
        return archive_dir_of(self.root)

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

    @property
    def version(self) -> str:
        return self.pi_version

    @property
    def sandbox_compile_cache(self) -> str | None:
        """NODE_COMPILE_CACHE for the agent in a sandbox (read-only with the install), or None."""
        return f"{SANDBOX_RUNTIME_DIR}/{COMPILE_CACHE_RELPATH}" if self.compile_cache else None

    def supports(self, flag: str) -> bool:
        return flag in self.flags


def archive_dir_of(root: str) -> str:
    """Where sandbox backends that upload an install (`root`, in cache/runtimes/) keep its archive:
    beside the runtimes, the same for every agent's install."""
    return str(Path(root).parent.parent / "archives")


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
    *,
    bin_name: str = "pi",
    probe: Callable[[str, str, Path], tuple[str, ...]] | None = None,
    warm: Callable[[PiRuntime, Path], bool] | None = None,
) -> PiRuntime:
    """Return the installed runtime of an npm agent package (Pi by default), installing it first if
    needed. Safe when many processes call it at once: one installs under a lock, the others wait
    and reuse its result. `bin_name` is the package's CLI; `probe(node, cli, scratch_home)` lists
    the CLI's flags (Pi's `--help`; other agents: None, no flags). `warm(runtime, staging)` fills
    staging/compile-cache (`build_compile_cache`) and says whether it did; such an install has a
    key of its own, so an install made without one is never taken for one with it."""
    _check_version(pi_version)
    key = f"{pi_package.replace('/', '+').lstrip('@')}-{pi_version}"
    if warm is not None:
        key += COMPILE_CACHE_KEY_SUFFIX
    if probe is None and bin_name == "pi":
        probe = _help_flags

    def build(staging: Path, target: Path) -> dict:
        say = progress or progress_to_stderr
        runtime = _install(pi_package, pi_version, node_version, staging, target, say, bin_name, probe)
        if warm is not None:
            runtime = replace(runtime, compile_cache=_warm(warm, runtime, staging, say))
        return asdict(runtime)

    record = cached_install(key, build, cache_dir, progress or progress_to_stderr, what=f"{pi_package}@{pi_version}")
    record["flags"] = tuple(record["flags"])
    return PiRuntime(**record)


def ensure_launcher_node(
    node_version: str, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None
) -> Path:
    """The Node that runs `launch.mjs` (the gateway forwarder in front of an agent that cannot
    preload it), from npm's node-linux-<arch>, once per machine: a sandbox's image need not have
    a Node of its own (the podman image has none). Returns the dir holding bin/node."""
    _check_version(node_version)
    package = f"node-linux-{_node_arch()}"

    def build(staging: Path, target: Path) -> dict:
        npm = shutil.which("npm")
        if not npm:
            raise RuntimeInstallError(
                "npm is not installed; install Node.js and npm (Debian: apt-get install nodejs npm)"
            )
        npm_install(npm, staging / "node", f"{package}@{node_version}")
        return {"root": str(target), "version": node_version, "node_dir": f"node/node_modules/{package}"}

    record = cached_install(f"{package}-{node_version}", build, cache_dir, progress, what=f"{package}@{node_version}")
    return Path(record["root"]) / record["node_dir"]


def cached_install(
    key: str,
    build: Callable[[Path, Path], dict],
    cache_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    what: str = "",
) -> dict:
    """The record of the install called `key` (cache/runtimes/<key>/runtime.json), made first by
    `build(staging, target)` when missing: once per machine, under a lock, into a staging dir
    renamed into place only when complete (the record is written last, so its presence means
    "complete"). `build` fills `staging` and returns the record, whose "root" is `target`."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache / "runtimes" / key
    record = _load(target)
    if record is not None:
        return record
    _mkdir(cache / "locks")
    with open(cache / "locks" / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing: wait for it
        record = _load(target)
        if record is not None:
            return record
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=".installing-", dir=_mkdir(cache / "runtimes")))
        try:
            record = build(staging, target)
            record["install_s"] = round(time.monotonic() - started, 2)
            (staging / "runtime.json").write_text(json.dumps(record, indent=2))
            os.chmod(staging, 0o755)  # sandboxes run as other uids and must read it
            if target.exists():
                shutil.rmtree(target)  # a broken leftover (no runtime.json)
            os.rename(staging, target)
            if progress is not None:
                progress(f"{what or key} ready in {record['install_s']:.0f} s.")
            return record
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _load(target: Path) -> dict | None:
    try:
        record = json.loads((target / "runtime.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("root") == str(target) else None


def _install(
    package: str,
    version: str,
    node_version: str,
    staging: Path,
    target: Path,
    progress: Callable[[str], None],
    bin_name: str,
    probe: Callable[[str, str, Path], tuple[str, ...]] | None,
) -> PiRuntime:
    npm = shutil.which("npm")
    if not npm:
        raise RuntimeInstallError("npm is not installed; install Node.js and npm (Debian: apt-get install nodejs npm)")
    progress(f"Installing {package}@{version} into {target} (once per machine)...")
    npm_install(npm, staging / "pi", f"{package}@{version}")
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
        npm_install(npm, staging / "node", f"node-linux-{_node_arch()}@{node_version}")
        node_used = node_version
        if not _satisfies(node_version, required):
            raise RuntimeInstallError(
                f"node {node_version} does not satisfy {package}@{version}'s "
                f"engines.node {required!r}; set PiConfig.agent.node_version"
            )
    bins = manifest.get("bin")
    bin_entry = bins.get(bin_name) or next(iter(bins.values())) if isinstance(bins, dict) else bins
    cli_relpath = str(Path("pi/node_modules") / package / bin_entry)
    node = (staging / f"node/node_modules/node-linux-{_node_arch()}/bin/node") if node_in_runtime else "node"
    flags = probe(str(node), str(staging / cli_relpath), staging) if probe else ()
    return PiRuntime(
        root=str(target),
        pi_package=package,
        pi_version=version,
        node_version=node_used,
        node_in_runtime=node_in_runtime,
        pi_cli_relpath=cli_relpath,
        flags=flags,
    )


def _warm(warm: Callable[[PiRuntime, Path], bool], runtime: PiRuntime, staging: Path, progress) -> bool:
    """The compile cache is optional: an install whose warm-up failed runs without it."""
    cache = staging / COMPILE_CACHE_RELPATH
    try:
        built = warm(runtime, staging) and any(cache.glob("*/*"))
    except Exception as error:  # noqa: BLE001 - any failure only costs the cache
        progress(f"No Node compile cache for {runtime.pi_package} (its warm-up run failed: {error}).")
        built = False
    if not built:
        shutil.rmtree(cache, ignore_errors=True)
        return False
    for path in (cache, *cache.rglob("*")):  # Node writes 0600 files; sandboxes read as other uids
        path.chmod(0o755 if path.is_dir() else 0o644)
    return True


def _mkdir(path: Path) -> Path:
    """Create `path` traversable by every uid: sandboxes mount the runtime as other uids."""
    path.mkdir(parents=True, exist_ok=True)
    for directory in (path, path.parent):
        if directory.stat().st_uid == os.geteuid():
            directory.chmod(directory.stat().st_mode | 0o755)
    return path


def npm_install(npm: str, prefix: Path, spec: str) -> None:
    """`npm install spec` into `prefix`, pinned, its install scripts not run."""
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


def progress_to_stderr(message: str) -> None:
    """The default progress report of an install: a line on stderr."""
    print(f"[pi-env] {message}", file=sys.stderr, flush=True)


def tree_size(root: Path) -> int:
    """Bytes of the files under `root` (an install's size; links not followed)."""
    return sum(entry.stat().st_size for entry in root.rglob("*") if entry.is_file() and not entry.is_symlink())
