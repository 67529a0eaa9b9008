"""Node's compile cache for Qwen Code (docs/agents/qwen-code.md, start cost): built once at install
time by a real run at the sandbox's paths, part of the immutable install, mounted read-only with it,
NODE_COMPILE_CACHE in the agent's environment pointing at it. Node reads it there (every module
the warm-up loaded is a hit) and no rollout's agent can write into it. Pi has none: it measured no
gain (docs/agents/pi.md). Real Qwen Code in the real bubblewrap sandbox, a few seconds a rollout."""

import hashlib
import os
import stat
from pathlib import Path

import pytest
from helpers import scripted_config

from pi_env import PiConfig, PiSessionFactory, PiTask
from pi_env.agent import get_agent, qwen_code
from pi_env.agent.base import AGENT_ROOT, FORWARDER_PATH, AgentRun
from pi_env.agent.runtime import COMPILE_CACHE_RELPATH, PiRuntime, ensure_runtime
from pi_env.endpoints import Endpoint
from pi_env.sandbox import SANDBOX_WORKDIR
from pi_env.scripted import ScriptedToolCall, ScriptedTurn

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

QWEN = "qwen-code"
SANDBOX_CACHE = f"{AGENT_ROOT}/{COMPILE_CACHE_RELPATH}"


@pytest.fixture(scope="module")
def installed() -> PiRuntime:
    return get_agent(PiConfig(agent=QWEN)).install(None)


def snapshot(root: str) -> dict[str, str]:
    """Every file under the host's cache dir with its content's hash."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(root).rglob("*"))
        if path.is_file()
    }


def shell(command: str) -> ScriptedTurn:
    return ScriptedTurn(tool_calls=[ScriptedToolCall(name="run_shell_command", arguments={"command": command})])


def write_file(path: str, content: str) -> ScriptedTurn:
    arguments = {"file_path": f"{SANDBOX_WORKDIR}/{path}", "content": content}
    return ScriptedTurn(tool_calls=[ScriptedToolCall(name="write_file", arguments=arguments)])


def rollout(task, config):
    with PiSessionFactory(config).create(task) as session:
        return session.wait_for_completion()


def test_the_cache_is_in_the_install_readable_by_sandboxes_and_the_agent_env_points_at_it(installed):
    assert installed.compile_cache and installed.root.endswith("+cc1")  # a key of its own
    host_cache = Path(installed.root) / COMPILE_CACHE_RELPATH
    entries = [path for path in host_cache.rglob("*") if path.is_file()]
    assert len(entries) > 100  # the modules a real run loads, not only the entry point
    for path in [host_cache, *host_cache.rglob("*")]:
        mode = path.stat().st_mode
        assert mode & stat.S_IROTH and not mode & (stat.S_IWGRP | stat.S_IWOTH), path  # sandbox uids read
    # Node's cache dir is keyed by the uid that runs it: uid 0 of the sandbox's user namespace.
    assert all(directory.name.endswith("-0") for directory in host_cache.iterdir())
    agent = get_agent(PiConfig(agent=QWEN))
    assert agent.mounts(installed) == {AGENT_ROOT: installed.root}  # mounted read-only with the install
    endpoint = Endpoint(name="t", base_url="http://127.0.0.1:9/v1", api_key="k", model="m")
    _, env, _ = agent.command(installed, AgentRun(agent.config, endpoint, "token", "hi"))
    assert env["NODE_COMPILE_CACHE"] == SANDBOX_CACHE


def test_an_install_without_the_cache_runs_without_it(installed, tmp_path):
    """An old install (no compile_cache in its record) or one whose warm-up failed: no variable."""
    old = PiRuntime(**{**installed.__dict__, "compile_cache": False})
    agent = get_agent(PiConfig(agent=QWEN))
    endpoint = Endpoint(name="t", base_url="http://127.0.0.1:9/v1", api_key="k", model="m")
    _, env, _ = agent.command(old, AgentRun(agent.config, endpoint, "token", "hi"))
    assert "NODE_COMPILE_CACHE" not in env
    record = {key: value for key, value in installed.__dict__.items() if key != "compile_cache"}
    assert PiRuntime(**record).compile_cache is False  # a record written before the field loads


def test_a_failed_warm_up_leaves_a_working_install_without_a_cache(installed, tmp_path):
    """The install is cached in its own dir here (npm: the package is in npm's cache already)."""

    def failing(runtime, staging):
        (staging / COMPILE_CACHE_RELPATH / "half").mkdir(parents=True)
        raise RuntimeError("no bwrap")

    runtime = ensure_runtime(
        "@qwen-code/qwen-code", installed.version, "22.23.5", tmp_path, lambda _: None, bin_name="qwen", warm=failing
    )
    assert not runtime.compile_cache and not (Path(runtime.root) / COMPILE_CACHE_RELPATH).exists()
    assert runtime.sandbox_compile_cache is None


def test_a_rollout_reads_the_cache_in_the_sandbox_and_scores_one(installed, server, monkeypatch):
    command = qwen_code.QwenCodeAgent.command

    def logged(self, installed, run):  # Node says what it read from the cache and what it wrote
        argv, env, stdin = command(self, installed, run)
        script = f'"$@" 2>{SANDBOX_WORKDIR}/node-debug.log'
        return ["/bin/sh", "-c", script, "sh", *argv], {**env, "NODE_DEBUG_NATIVE": "COMPILE_CACHE"}, stdin

    monkeypatch.setattr(qwen_code.QwenCodeAgent, "command", logged)
    before = snapshot(f"{installed.root}/{COMPILE_CACHE_RELPATH}")
    key = server.add_script([write_file("hello.txt", "hi\n"), ScriptedTurn(text="Done.")])
    task = PiTask(task_id="cc-hello", instruction="Write hi into hello.txt.", verify=["grep -qx hi hello.txt"])
    result = rollout(task, scripted_config(server, key, agent=QWEN))
    assert result.error_kind is None and result.reward == 1.0, (result.error, result.agent_log_tail)
    log = result.files["node-debug.log"]
    reads = [line for line in log.splitlines() if f"reading cache from {SANDBOX_CACHE}/" in line]
    hits = [line for line in reads if "... success, size=" in line]
    misses = [line for line in reads if line.endswith("no such file or directory")]
    # Every entry the warm-up wrote is accepted here (none rejected for another path or content):
    # Node keys entries by path and content, so this is the sandbox's install at the warm-up's paths.
    assert len(hits) > 100 and len(hits) + len(misses) == len(reads), [r for r in reads if r not in hits + misses]
    assert len(misses) < len(hits) // 4, misses  # the warm-up loaded most of what a rollout loads
    assert snapshot(f"{installed.root}/{COMPILE_CACHE_RELPATH}") == before
    # A module the warm-up did not load is missed: always the forwarder (a sandbox's own preload),
    # and, as timers fired in the warm-up, some lazily loaded chunks. Node's attempt to add one
    # fails on the read-only mount, quietly (its debug log only).
    assert any(f"for ESM file://{FORWARDER_PATH}..." in line for line in misses), misses
    assert "read-only file system" in log


def test_the_agent_cannot_write_into_the_cache(installed, server):
    host_cache = f"{installed.root}/{COMPILE_CACHE_RELPATH}"
    before = snapshot(host_cache)
    attempt = (
        f"cd {SANDBOX_CACHE}; echo planted > planted; "
        'for f in */*; do echo poisoned > "$f"; done 2>/dev/null; rm -f */* 2>/dev/null; '
        f"chmod -R u+w . ; echo planted > */planted; mv * moved 2>/dev/null; ls {SANDBOX_CACHE} | head -3"
    )
    key = server.add_script([shell(attempt), ScriptedTurn(text="Done.")])
    task = PiTask(
        task_id="cc-poison",
        instruction="Poison the compile cache.",
        verify=[f"test ! -e {SANDBOX_CACHE}/planted", f'test -z "$(find {SANDBOX_CACHE} -name planted)"'],
    )
    result = rollout(task, scripted_config(server, key, agent=QWEN))
    assert result.error_kind is None and result.reward == 1.0, (
        result.error,
        result.verify_results,
        result.agent_log_tail,
    )
    assert snapshot(host_cache) == before  # not one entry planted, changed, removed or moved
    assert not os.path.exists(f"{host_cache}/planted")
