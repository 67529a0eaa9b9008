"""Environment layers (local backend): a Dockerfile's steps built once into a cached, read-only
layer over the sandbox's root view.

A layer is what `RUN`/`COPY`/`ADD`/`WORKDIR` steps changed, kept as overlayfs upper dirs, one
per top-level directory (`usr`, `etc`, `var`, `opt`, the work dir, ...). The build runs each
`RUN` in a bubblewrap sandbox whose /usr, /etc and /var are kernel overlay mounts over the host's
/usr and over pruned copies of the host's /etc and /var (never the whole of them: /etc/shadow,
/var/lib/* stay out), with the host's network, `ENV`/`ARG` in its environment. Once built it is
mounted read-only, once per machine, as `<cache>/<key>/view/<top>` (overlay: the layer over the
same lowers), and every later sandbox binds those views: no per-rollout cost beyond the binds.

`FROM` cannot be honoured without images: the host's userland stands for the base image (so a
Debian/Ubuntu image with apt is approximated; another package manager or `FROM scratch` is not,
see `unsupported_base`).

The key is a hash of the steps, the content of every file they copy and the host's userland
(os-release); concurrent first uses build once (a flock per key); a failed build raises
EnvironmentBuildError with the tail of its log (the whole log stays in `<cache>/<key>.log`).

The build is as privileged as `docker build` on rootful Docker: root with Docker's default
capabilities minus CAP_MKNOD, in its own namespaces, seeing only the overlays (its writes go to
the layer, never to the host). Mounting overlays needs root, so layers need a root caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import posixpath
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pi_env.sandbox.base import EnvironmentBuildError, SandboxError

LAYER_FORMAT = 2  # part of every layer key: a change here rebuilds the layers
LOG_TAIL_CHARS = 3000
LOCK_WAIT_S = 3600.0
# Docker's default capability set (moby's oci/caps/defaults.go); the build leaves out MKNOD
# (a device node on the layer's real filesystem would reach host devices).
DOCKER_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)
BUILD_CAPS = tuple(cap for cap in DOCKER_CAPS if cap != "CAP_MKNOD")
# Top-level dirs whose build-time lower is the host's (pruned) one, and what of the host they show.
OVERLAID = ("usr", "etc", "var")
KEPT_TOPS = ("usr", "etc", "var", "opt", "srv", "home", "mnt")
# What of the host's /etc a build (and so every sandbox over its layer) sees: what package
# managers and common tools read. Never credentials: no shadow, no private keys, no apt auth,
# no pip.conf/gitconfig/wgetrc (they may hold index tokens), no machine-id.
HOST_ETC = (
    "alternatives",
    "apt",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "resolv.conf",
    "hosts",
    "nsswitch.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "mime.types",
    "gai.conf",
    "bash.bashrc",
    "profile",
    "profile.d",
    "debian_version",
    "os-release",
    "lsb-release",
    "shells",
    "login.defs",
    "adduser.conf",
    "deluser.conf",
    "skel",
    "dpkg",
    "debconf.conf",
    "ucf.conf",
    "environment",
    "default",
    "pam.d",
    "security",
    "host.conf",
    "inputrc",
    "python3",
    "python3.11",
    "perl",
    "ImageMagick-6",
    "fonts",
    "X11",
    "xdg",
    "logrotate.d",
    "cron.daily",
    "systemd",
    "init.d",
    "rc0.d",
    "rc1.d",
    "rc2.d",
    "rc3.d",
    "rc4.d",
    "rc5.d",
    "rc6.d",
    "rcS.d",
    "update-motd.d",
    "issue",
    "issue.net",
    "mailcap",
    "magic",
    "magic.mime",
)
_NEVER_COPIED = shutil.ignore_patterns("private", "*.key", "auth.conf", "auth.conf.d", "*.pem.key")
HOST_VAR = ("lib/dpkg", "cache/debconf", "lib/ucf", "lib/pam", "lib/systemd/deb-systemd-helper-enabled")
PASSWD = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"
BUILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_OTHER_PACKAGE_MANAGERS = re.compile(r"(?<![\w-])(apk|yum|dnf|microdnf|zypper|pacman|emerge|nix-env)\s")
_FOREIGN_BASES = re.compile(
    r"^(?:[\w.-]+(?::\d+)?/)*(alpine|fedora|centos|rockylinux|almalinux|amazonlinux|"
    r"archlinux|opensuse|oraclelinux|redhat|ubi\d*|busybox|distroless|wolfi)\b",
    re.I,
)


@dataclass(frozen=True)
class Step:
    kind: str  # RUN, COPY, ENV, WORKDIR, ARG, USER
    args: tuple[str, ...]
    where: str  # environment/Dockerfile:LINE


@dataclass
class DockerfilePlan:
    """What of a Dockerfile a layer build honours, and what it cannot."""

    base: str | None = None  # FROM's image (the last stage's)
    steps: list[Step] = field(default_factory=list)
    workdir: str = "/app"
    unsupported: list[str] = field(default_factory=list)  # for every backend without images
    approximated: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def needs_build(self) -> bool:
        return any(step.kind in ("RUN", "ENV", "USER") for step in self.steps) or any(
            step.kind in ("COPY", "ADD") and not _under(step.args[-1], self.workdir) for step in self.steps
        )


def instructions(text: str):
    """(line number, instruction) for each logical line (continuations joined, comments and
    blank lines dropped, also inside a continued instruction, as Docker does)."""
    parts: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        yield start, " ".join(p for p in parts if p)
        parts = []
    if parts:
        yield start, " ".join(parts)


def parse_dockerfile(text: str, default_workdir: str = "/app") -> DockerfilePlan:
    plan = DockerfilePlan(workdir=default_workdir)
    env: dict[str, str] = {}
    stages = 0
    for number, instruction in instructions(text):
        where = f"environment/Dockerfile:{number}"
        word, _, rest = instruction.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "FROM":
            stages += 1
            args = [a for a in rest.split() if not a.startswith("--")]
            plan.base = args[0] if args else ""
            if stages > 1:
                plan.unsupported.append(f"{where}: multi-stage builds (a second FROM) are not built without images")
            elif plan.base.lower() == "scratch":
                plan.unsupported.append(f"{where}: FROM scratch: an empty image cannot be approximated by the host")
            elif _FOREIGN_BASES.match(plan.base):
                plan.unsupported.append(
                    f"{where}: FROM {plan.base}: another distribution; the host's userland cannot stand in for it"
                )
            else:
                plan.approximated.append(
                    f"{where}: FROM {plan.base}: approximated by the host's userland ({host_userland()})"
                )
        elif word == "RUN":
            command = _exec_form(rest) if rest.startswith("[") else rest
            if rest.startswith("--"):
                plan.unsupported.append(f"{where}: RUN {rest[:80]}: RUN options (--mount, --network) are not built")
                continue
            if _OTHER_PACKAGE_MANAGERS.search(command):
                plan.unsupported.append(f"{where}: RUN {command[:120]}: another package manager than the host's apt")
            plan.steps.append(Step("RUN", (command,), where))
        elif word in ("ENV", "ARG"):
            for key, value in _assignments(rest, word, env):
                env[key] = value
                plan.steps.append(Step(word, (key, value), where))
        elif word == "WORKDIR":
            plan.workdir = posixpath.normpath(posixpath.join(plan.workdir, _expand(rest, env)))
            plan.steps.append(Step("WORKDIR", (plan.workdir,), where))
        elif word in ("COPY", "ADD"):
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            options = [a for a in shlex.split(rest) if a.startswith("--")]
            if any(o.startswith("--from") for o in options):
                plan.unsupported.append(f"{where}: {word} {rest[:80]}: copies from another stage or image")
                continue
            if len(args) < 2 or any(re.match(r"^[a-z]+://", a) for a in args[:-1]):
                plan.unsupported.append(f"{where}: {word} {rest[:80]}: only local sources are copied")
                continue
            dest = _expand(args[-1], env)
            dest = (
                dest
                if dest.startswith("/")
                else posixpath.join(plan.workdir, dest) + ("/" if dest.endswith("/") else "")
            )
            plan.steps.append(Step(word, (*args[:-1], dest), where))
        elif word == "USER":
            plan.steps.append(Step("USER", (rest,), where))
            plan.approximated.append(
                f"{where}: USER {rest}: setup and verify run as root, the agent as "
                "the sandbox's root without capabilities"
            )
        elif word in (
            "LABEL",
            "MAINTAINER",
            "EXPOSE",
            "CMD",
            "ENTRYPOINT",
            "SHELL",
            "STOPSIGNAL",
            "HEALTHCHECK",
            "VOLUME",
            "ONBUILD",
        ):
            plan.ignored.append(f"{where}: {word}")
        else:
            plan.unsupported.append(f"{where}: unknown instruction {instruction[:80]}")
    return plan


def host_userland() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.partition("=")[2].strip('"')
    except OSError:
        pass
    return "unknown"


def unsupported_base(plan: DockerfilePlan) -> list[str]:
    """What of `plan` a local layer cannot honour: a base or a step the host cannot stand in for,
    or no root to mount overlays."""
    why = list(plan.unsupported)
    if plan.needs_build and os.geteuid() != 0:
        why.append("environment layers need root (overlay mounts); run pi-env as root or use --backend podman")
    if (
        plan.needs_build
        and shutil.which("apt-get") is None
        and any("apt" in s.args[0] for s in plan.steps if s.kind == "RUN")
    ):
        why.append("RUN steps use apt, and this host has no apt-get to approximate the base image with")
    return why


# -- the cache ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    key: str
    path: str
    mounts: dict[str, str]  # sandbox path -> host dir, to bind read-only
    env: dict[str, str]  # the Dockerfile's ENV, for every command
    workdir: str  # the Dockerfile's last WORKDIR
    workdir_tree: str | None  # host dir holding what the build left in WORKDIR
    build_s: float  # how long the build took (when it was built)
    built_now: bool  # False: it came from the cache


def default_cache_dir() -> str:
    return os.environ.get("PI_ENV_LAYER_CACHE") or os.path.join(tempfile.gettempdir(), "pi-env-layers")


def layer_key(plan: DockerfilePlan, context: str) -> str:
    digest = hashlib.sha256()
    digest.update(
        json.dumps([LAYER_FORMAT, host_userland(), plan.workdir, [(s.kind, s.args) for s in plan.steps]]).encode()
    )
    for step in plan.steps:
        if step.kind in ("COPY", "ADD"):
            for source in step.args[:-1]:
                for path in sorted(_sources(context, source)):
                    digest.update(os.path.relpath(path, context).encode() + b"\0")
                    if os.path.isfile(path):
                        with open(path, "rb") as f:
                            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:32]


_known: dict[tuple, Layer] = {}  # (cache, context signature) -> a layer this process has ready


def ensure_layer(
    plan: DockerfilePlan, context: str, *, bwrap: str, cache_dir: str | None = None, timeout_s: float = 600.0
) -> Layer:
    """The layer for `plan` (built now under a lock, or found in the cache), mounted read-only.
    A layer this process already has is reused while its context is unchanged (a stat per file)."""
    cache = cache_dir or default_cache_dir()
    signature = (cache, repr([(s.kind, s.args) for s in plan.steps]), _context_signature(context))
    known = _known.get(signature)
    if known and all(os.path.ismount(view) for top, view in known.mounts.items() if top.strip("/") in OVERLAID):
        return dataclasses.replace(known, build_s=0.0, built_now=False)
    layer = _ensure_layer(plan, context, bwrap, cache, timeout_s)
    _known[signature] = layer
    return layer


def _context_signature(context: str) -> tuple:
    entries = []
    for root, _, files in os.walk(context):
        for name in files:
            st = os.stat(os.path.join(root, name))
            entries.append((os.path.join(root, name), st.st_size, st.st_mtime_ns))
    return tuple(sorted(entries))


def _ensure_layer(plan: DockerfilePlan, context: str, bwrap: str, cache: str, timeout_s: float) -> Layer:
    os.makedirs(cache, mode=0o711, exist_ok=True)
    os.chmod(cache, 0o711)
    key = layer_key(plan, context)
    path = os.path.join(cache, key)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _flock(fd, LOCK_WAIT_S)
        built_now = False
        if not os.path.exists(os.path.join(path, "layer.json")):
            _build(plan, context, path, bwrap, timeout_s)
            built_now = True
        meta = json.loads(Path(path, "layer.json").read_text())
        mounts = _mount_views(path, meta["tops"])
    finally:
        os.close(fd)
    tree = os.path.join(path, "up", "workdir")
    return Layer(
        key=key,
        path=path,
        mounts=mounts,
        env=meta["env"],
        workdir=meta["workdir"],
        workdir_tree=tree if os.path.isdir(tree) else None,
        build_s=meta["build_s"] if built_now else 0.0,
        built_now=built_now,
    )


def _flock(fd: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise SandboxError(f"waited {wait_s:g} s for another process building the same layer") from None
            time.sleep(0.2)


def _mount_views(path: str, tops: list[str]) -> dict[str, str]:
    """Sandbox path -> the read-only view to bind: an overlay of the layer over its build-time
    lower for /usr, /etc, /var (mounted once, kept for later processes), the layer dir itself
    for the rest."""
    mounts = {}
    for top in tops:
        upper = os.path.join(path, "up", top)
        if top in OVERLAID:
            view = os.path.join(path, "view", top)
            os.makedirs(view, mode=0o755, exist_ok=True)
            if not os.path.ismount(view):
                lower = "/usr" if top == "usr" else os.path.join(path, "base", top)
                _run(
                    ["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={upper}:{lower}", view],
                    "mounting a layer view",
                )
            mounts[f"/{top}"] = view
        elif top != "workdir":
            mounts[f"/{top}"] = upper
    return mounts


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, env={"PATH": BUILD_PATH})
    if done.returncode:
        raise SandboxError(f"{what} failed: `{' '.join(argv)}`: {done.stderr.strip()[-500:]}")


# -- the build ------------------------------------------------------------------------------
def _build(plan: DockerfilePlan, context: str, path: str, bwrap: str, timeout_s: float) -> None:
    if os.geteuid() != 0:
        raise SandboxError("environment layers need root (overlay mounts)")
    work = f"{path}.build-{secrets.token_hex(4)}"
    log_path = f"{path}.log"
    started = time.monotonic()
    tops = _tops(plan)
    try:
        os.makedirs(work, mode=0o755)
        _prepare_base(work)
        for top in tops:
            os.makedirs(os.path.join(work, "up", top), mode=0o755, exist_ok=True)
            if top in OVERLAID:
                os.makedirs(os.path.join(work, "ovl-work", top), mode=0o700, exist_ok=True)
        # pip in an image installs system-wide; Debian's refuses without this (PEP 668)
        env: dict[str, str] = {
            "PATH": BUILD_PATH,
            "HOME": "/root",
            "DEBIAN_FRONTEND": "noninteractive",
            "LANG": "C.UTF-8",
            "PIP_BREAK_SYSTEM_PACKAGES": "1",
            "PIP_ROOT_USER_ACTION": "ignore",
        }
        args: dict[str, str] = {}
        image_env = {"PIP_BREAK_SYSTEM_PACKAGES": "1"}  # what later commands see: the Dockerfile's ENV
        workdir = plan.workdir
        deadline = started + timeout_s
        with open(log_path, "w") as log:
            for step in plan.steps:
                log.write(f"--- {step.where}: {step.kind} {' '.join(step.args)}\n")
                log.flush()
                if step.kind == "ENV":
                    env[step.args[0]] = image_env[step.args[0]] = step.args[1]
                elif step.kind == "ARG":
                    args[step.args[0]] = step.args[1]
                elif step.kind == "WORKDIR":
                    workdir = step.args[0]
                    os.makedirs(_host_path(work, workdir, plan.workdir), exist_ok=True)
                elif step.kind in ("COPY", "ADD"):
                    _copy(context, step, work, plan.workdir)
                elif step.kind == "RUN":
                    argv = _build_argv(work, tops, plan.workdir, workdir, {**args, **env}, step.args[0], bwrap)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise EnvironmentBuildError(f"the build ran past its {timeout_s:g} s limit before {step.where}")
                    log.flush()
                    try:
                        done = subprocess.run(
                            argv,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            timeout=remaining,
                            env={"PATH": BUILD_PATH},
                            cwd="/",
                            start_new_session=True,
                        )
                        status = done.returncode
                    except subprocess.TimeoutExpired:
                        status = None
                    if status != 0:
                        log.flush()
                        why = "timed out" if status is None else f"exited {status}"
                        raise EnvironmentBuildError(
                            f"building the environment failed: {step.where}: RUN {step.args[0][:200]} "
                            f"{why}; log tail ({log_path}):\n{_tail(log_path)}"
                        )
        meta = {
            "format": LAYER_FORMAT,
            "tops": tops,
            "env": image_env,
            "workdir": workdir,
            "build_s": round(time.monotonic() - started, 3),
        }
        shutil.rmtree(os.path.join(work, "ovl-work"), ignore_errors=True)
        _make_readable(work)
        Path(work, "layer.json").write_text(json.dumps(meta))
        if os.path.exists(path):  # a half-built leftover of a crashed build
            shutil.rmtree(path, ignore_errors=True)
        os.rename(work, path)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _tops(plan: DockerfilePlan) -> list[str]:
    """Top-level dirs the build keeps: the usual ones plus those a WORKDIR or COPY names (the
    work dir itself is kept as `workdir`)."""
    tops = list(KEPT_TOPS)
    for step in plan.steps:
        if step.kind in ("WORKDIR", "COPY", "ADD"):
            target = step.args[-1]
            if _under(target, plan.workdir):
                continue
            top = target.strip("/").split("/")[0]
            if top and top not in tops and top not in ("root", "tmp", "proc", "dev", "run", "sys"):
                tops.append(top)
    return [*tops, "workdir"]


def _prepare_base(work: str) -> None:
    """The lowers of /etc and /var: pruned copies of the host's (never the whole)."""
    etc = os.path.join(work, "base", "etc")
    os.makedirs(etc, mode=0o755)
    for entry in HOST_ETC:
        source = os.path.join("/etc", entry)
        target = os.path.join(etc, entry)
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True, ignore=_NEVER_COPIED)
        elif os.path.isfile(source):
            shutil.copy2(source, target)
    # The host's system accounts (dpkg checks them), never its people (ids 1000-65533).
    for name in ("passwd", "group"):
        with open(os.path.join("/etc", name)) as f:
            system = [line for line in f if _system_account(line)]
        Path(etc, name).write_text("".join(system) or (PASSWD if name == "passwd" else GROUP))
    Path(etc, "hostname").write_text("pi-env\n")
    var = os.path.join(work, "base", "var")
    for sub in (
        "tmp",
        "log/apt",
        "lib/apt/lists/partial",
        "cache/apt/archives/partial",
        "lib/misc",
        "local",
        "mail",
        "spool",
        "backups",
        "opt",
    ):
        os.makedirs(os.path.join(var, sub), mode=0o755, exist_ok=True)
    os.chmod(os.path.join(var, "tmp"), 0o1777)
    for sub in HOST_VAR:
        source = os.path.join("/var", sub)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(var, sub), symlinks=True, dirs_exist_ok=True)
    os.symlink("/run", os.path.join(var, "run"))
    os.symlink("/run/lock", os.path.join(var, "lock"))


def _system_account(line: str) -> bool:
    fields = line.split(":")
    return len(fields) > 2 and fields[2].isdigit() and (int(fields[2]) < 1000 or int(fields[2]) >= 65534)


def _host_path(work: str, sandbox_path: str, workdir: str) -> str:
    if _under(sandbox_path, workdir):
        rel = posixpath.relpath(posixpath.normpath(sandbox_path), workdir)
        return os.path.normpath(os.path.join(work, "up", "workdir", rel))
    return os.path.normpath(os.path.join(work, "up", sandbox_path.lstrip("/")))


def _under(path: str, directory: str) -> bool:
    path = posixpath.normpath(path)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _build_argv(
    work: str, tops: list[str], plan_workdir: str, cwd: str, env: dict[str, str], command: str, bwrap: str
) -> list[str]:
    """unshare (a private mount namespace for the overlays) + bwrap, as root with the build caps."""
    mounts = []
    binds: list[str] = []
    for top in tops:
        upper = os.path.join(work, "up", top)
        if top in OVERLAID:
            lower = "/usr" if top == "usr" else os.path.join(work, "base", top)
            merged = os.path.join(work, "merged", top)
            os.makedirs(merged, exist_ok=True)
            mounts.append(
                f"mount -t overlay overlay -o lowerdir={lower},upperdir={upper},"
                f"workdir={os.path.join(work, 'ovl-work', top)} {merged}"
            )
            binds += ["--bind", merged, f"/{top}"]
        elif top == "workdir":
            binds += ["--bind", upper, plan_workdir]
        else:
            binds += ["--bind", upper, f"/{top}"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            binds += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            binds += ["--bind", top, top]  # not merged /usr: kept as the host's (rare)
    caps = [arg for cap in BUILD_CAPS for arg in ("--cap-add", cap)]
    inner = [
        bwrap,
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",  # no user ns: real root, as docker build
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--cap-drop",
        "ALL",
        *caps,
        "--hostname",
        "pi-env",
        *binds,
        "--proc",
        "/proc",
        "--ro-bind",
        "/proc/sys",
        "/proc/sys",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/root",
        "--tmpfs",
        "/run",
        "--dir",
        "/run/lock",
        "--chdir",
        cwd,
        "--clearenv",
    ]
    for key, value in env.items():
        inner += ["--setenv", key, value]
    inner += ["--", "/bin/sh", "-c", "trap : EXIT\n" + command]
    script = " && ".join(mounts + ["exec " + shlex.join(inner)])
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script]


def _copy(context: str, step: Step, work: str, workdir: str) -> None:
    *sources, dest = step.args
    matched = [path for source in sources for path in _sources(context, source, top_only=True)]
    if not matched:
        raise EnvironmentBuildError(f"{step.where}: {step.kind} {' '.join(sources)}: no such file in environment/")
    target = _host_path(work, dest, workdir)
    into_dir = dest.endswith("/") or len(matched) > 1 or any(os.path.isdir(m) for m in matched)
    for source in matched:
        if os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            os.makedirs(target if into_dir else os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, os.path.join(target, os.path.basename(source)) if into_dir else target)


def _sources(context: str, source: str, top_only: bool = False) -> list[str]:
    """Host paths a COPY source names (globs expanded; never outside the context)."""
    root = os.path.realpath(context)
    import glob

    found = []
    for path in sorted(glob.glob(os.path.join(root, source.lstrip("/")))):
        real = os.path.realpath(path)
        if real != root and not real.startswith(root + "/"):
            raise SandboxError(f"COPY {source}: leaves the build context {context}")
        found.append(real)
        if not top_only and os.path.isdir(real):
            found += [str(p) for p in sorted(Path(real).rglob("*"))]
    return found


def _make_readable(work: str) -> None:
    """The layer is root's and read-only for everyone else: sandbox uids read it as `other`."""
    for top in os.listdir(os.path.join(work, "up")):
        subprocess.run(["chmod", "-R", "go+rX,go-w", os.path.join(work, "up", top)], check=False)
    for base in ("base",):
        subprocess.run(["chmod", "-R", "go+rX,go-w", os.path.join(work, base)], check=False)


def _assignments(rest: str, word: str, env: dict[str, str]) -> list[tuple[str, str]]:
    parts = shlex.split(rest)
    if word == "ENV" and len(parts) >= 2 and "=" not in parts[0]:
        return [(parts[0], _expand(" ".join(parts[1:]), env))]  # legacy `ENV KEY value`
    pairs = []
    for part in parts:
        key, sep, value = part.partition("=")
        if word == "ARG" and not sep:
            continue  # `ARG NAME` with no default: nothing to set
        pairs.append((key, _expand(value, env)))
    return pairs


def _expand(value: str, env: dict[str, str]) -> str:
    """Docker's $VAR / ${VAR} / ${VAR:-default} substitution from earlier ENV/ARG values."""

    def one(match: re.Match) -> str:
        name, default = match.group(1) or match.group(2), match.group(3)
        found = env.get(name, BUILD_PATH if name == "PATH" else "")
        return found if found or default is None else default

    return re.sub(r"\$(?:(\w+)|\{(\w+)(?::-([^}]*))?\})", one, value)


def _exec_form(rest: str) -> str:
    try:
        args = json.loads(rest)
    except ValueError:
        return rest
    return shlex.join(str(a) for a in args) if isinstance(args, list) else rest


def _tail(path: str) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return ""
