"""Node's compile cache of an agent, built once at install time (`ensure_runtime(warm=...)`): one
real run of the agent at the sandbox's paths, so every sandbox gets it read-only with the install
and no rollout compiles the agent cold (a sandbox's /tmp, where a CLI's own cache would go, is
empty at every rollout). Apart from runtime.py, since it runs the agent itself (base.py's
protocol), and base.py needs runtime.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .base import FORWARDER_PATH, AgentRun
from .runtime import COMPILE_CACHE_RELPATH, SANDBOX_RUNTIME_DIR, WARM_UP_TIMEOUT_S, PiRuntime, RuntimeInstallError


def build_compile_cache(agent, runtime: PiRuntime, staging: Path) -> bool:
    """Fill staging/compile-cache with Node's compile cache of one real run of `agent` (an Agent
    on this runtime): its own files and command (minus the forwarder preload) against a scripted
    server on 127.0.0.1 that writes one file through the agent's own tool, in a mount namespace
    where the staging dir is at the sandbox's path (Node keys entries by file path and content)
    and the run's home is the sandbox's, as uid 0 (Node keys the cache's dir by uid too: uid 0 of
    the sandbox's own user namespace). Built once, here; sandboxes get it read-only with the
    install, so no rollout's agent can change what the next one loads."""
    from ..oracle import script_endpoint
    from ..sandbox import SANDBOX_HOME, SANDBOX_WORKDIR
    from ..scripted.server import ScriptedServer
    from ..task import PiTask, WriteStep

    bwrap = shutil.which("bwrap")
    if not bwrap:
        raise RuntimeInstallError("bwrap is not installed")
    task = PiTask(
        task_id="compile-cache-warm-up",
        instruction="Create hello.txt containing hello.",
        verify=["test -f hello.txt"],
        solution=[WriteStep(tool="write", path="hello.txt", content="hello\n")],
    )
    home = Path(tempfile.mkdtemp(prefix="warm-up-home-"))
    server = ScriptedServer(record_requests=0)
    try:
        server.start()
        endpoint = script_endpoint(server, task, agent.submit_command)
        run = AgentRun(agent.config, endpoint, endpoint.api_key or "", task.instruction, base_url=endpoint.base_url)
        host = _HostHome(home, SANDBOX_HOME)
        Path(host.path(SANDBOX_WORKDIR)).mkdir(parents=True)
        agent.prepare(host, runtime, run)
        argv, env, stdin_path = agent.command(runtime, run)
        if "--import" in argv and argv[argv.index("--import") + 1] == FORWARDER_PATH:
            at = argv.index("--import")  # the server is reached directly
            argv = argv[:at] + argv[at + 2 :]
        # The agent's code runs here as this user: read-only but for its cache dir, home and /tmp.
        cache = staging / COMPILE_CACHE_RELPATH
        cache.mkdir()
        namespace = [bwrap, "--unshare-all", "--share-net", "--die-with-parent"]
        if os.geteuid() != 0:
            namespace += ["--unshare-user", "--uid", "0", "--gid", "0"]
        namespace += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        namespace += ["--tmpfs", "/opt", "--ro-bind", str(staging), SANDBOX_RUNTIME_DIR]
        namespace += ["--bind", str(cache), f"{SANDBOX_RUNTIME_DIR}/{COMPILE_CACHE_RELPATH}"]
        namespace += ["--bind", str(home), SANDBOX_HOME, "--chdir", SANDBOX_WORKDIR, "--"]
        env = {
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            **env,
            "NODE_COMPILE_CACHE": f"{SANDBOX_RUNTIME_DIR}/{COMPILE_CACHE_RELPATH}",
        }
        with open(host.path(stdin_path) if stdin_path else os.devnull) as stdin:
            done = subprocess.run(
                namespace + argv, stdin=stdin, capture_output=True, env=env, timeout=WARM_UP_TIMEOUT_S
            )
        if not Path(host.path(f"{SANDBOX_WORKDIR}/hello.txt")).exists():
            tail = (done.stdout + done.stderr).decode("utf-8", "replace")[-600:]
            raise RuntimeInstallError(f"the warm-up run did not write its file (exit {done.returncode}): {tail}")
        return True
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


class _HostHome:
    """What an agent's `prepare` writes into a sandbox, into a host dir bound at the sandbox's home."""

    def __init__(self, home: Path, sandbox_home: str):
        self.home, self.sandbox_home = home, sandbox_home

    def path(self, sandbox_path: str) -> str:
        if not sandbox_path.startswith(self.sandbox_home + "/"):
            raise RuntimeInstallError(f"the warm-up run writes only under {self.sandbox_home}, not {sandbox_path}")
        return str(self.home / sandbox_path[len(self.sandbox_home) + 1 :])

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        host = Path(self.path(path))
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data if isinstance(data, bytes) else data.encode())
        host.chmod(mode)

    def remove(self, path: str) -> None:
        host = Path(self.path(path))
        if host.is_dir() and not host.is_symlink():
            shutil.rmtree(host, ignore_errors=True)
        else:
            host.unlink(missing_ok=True)
