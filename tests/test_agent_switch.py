"""One argument switches the coding agent, wherever a rollout is started: the command line
(`run`, `collect`, `doctor`), Python (`PiConfig.agent`, `PiSessionFactory(agent=)`), the server's
`run_rollout` and its default. The agents themselves are tested in tests/test_agent_*.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pi_env import PiConfig, PiSessionFactory
from pi_env.agent import agent_names, get_agent
from pi_env.collect import CollectRunner
from pi_env.collect.store import read_records
from pi_env.server.rollouts import BadArguments, build_rollout

ROOT = Path(__file__).parent.parent
OTHER = "qwen-code"  # an agent other than Pi, for the end-to-end cases (each agent's own suite runs all)
TASK = {"task_id": "hello", "instruction": "Create hello.txt containing hello.", "verify": ["grep -qx hello hello.txt"],
        "solution": [{"tool": "write", "path": "hello.txt", "content": "hello\n"}]}


def pi_env(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pi_env.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_the_registry_names_every_agent_and_refuses_others():
    assert agent_names() == ["claude-code", "codex", "gemini-cli", "mini-swe-agent", "opencode", "pi", "qwen-code"]
    for name in agent_names():
        agent = get_agent(PiConfig(agent=name))
        assert agent.name == name and agent.version  # pinned
    with pytest.raises(ValueError, match="unknown agent 'nope'; known: claude-code, codex, gemini-cli, mini-swe-agent, opencode, pi, qwen-code"):
        PiSessionFactory(agent="nope")
    with pytest.raises(ValueError, match="not an agent name"):
        PiConfig(agent="../evil")


def test_one_argument_in_python_and_in_a_saved_config():
    assert PiSessionFactory(agent=OTHER).config.agent.name == OTHER
    assert PiSessionFactory(PiConfig(agent=OTHER)).agent.name == OTHER
    config = PiConfig(agent={"name": "mini-swe-agent", "version": "2.4.6", "options": {"step_limit": 7}})
    again = PiConfig.model_validate_json(config.model_dump_json())
    assert again.agent == config.agent and PiConfig().agent.name == "pi"


def test_the_server_takes_an_agent_argument_and_a_default():
    task, config = build_rollout({"task": TASK, "agent": OTHER})
    assert config.agent.name == OTHER
    assert build_rollout({"task": TASK})[1].agent.name == "pi"
    assert build_rollout({"task": TASK}, agent="opencode")[1].agent.name == "opencode"  # serve --agent
    assert build_rollout({"task": TASK, "agent": "pi"}, agent="opencode")[1].agent.name == "pi"  # a call wins
    pinned = build_rollout({"task": TASK}, agent="opencode", agent_version="1.2.3")[1]
    assert (pinned.agent.name, pinned.agent.version) == ("opencode", "1.2.3")
    with pytest.raises(BadArguments, match="agent: 'nope' is not one of"):
        build_rollout({"task": TASK, "agent": "nope"})


def test_an_unknown_agent_on_the_command_line_is_bad_input():
    done = pi_env("run", "examples/fizzbuzz.json", "--agent", "nope")
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_run_and_collect_switch_agents_with_one_flag(tmp_path):
    task = tmp_path / "hello.json"
    task.write_text(json.dumps(TASK))
    done = pi_env("run", str(task), "--agent", OTHER, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["agent"], result["reward"], result["pi_version"]) == (OTHER, 1.0, "")
    assert result["agent_version"] == get_agent(PiConfig(agent=OTHER)).version
    assert len(result["proxy_turns"]) >= 2 and result["messages"]  # every call recorded at the gateway

    summary = CollectRunner([TASK], tmp_path / "out", PiConfig(agent=OTHER)).run()
    (record,) = read_records(tmp_path / "out")
    assert summary.counts["scored"] == 1 and (record["agent"], record["reward"]) == (OTHER, 1.0)


def test_an_agent_refuses_options_it_does_not_take():
    with pytest.raises(ValueError, match=r"agent 'qwen-code' has no options \['step_limit'\]; its options: exclude_tools"):
        PiSessionFactory(PiConfig(agent={"name": "qwen-code", "options": {"step_limit": 3}}))
    with pytest.raises(ValueError, match="agent 'pi' has no options"):
        PiSessionFactory(PiConfig(agent={"name": "pi", "options": {"x": 1}}))
    assert PiSessionFactory(PiConfig(agent={"name": "mini-swe-agent", "options": {"step_limit": 3}})).agent


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_qwen_code_options_shrink_its_requests(tmp_path):
    """`exclude_tools` and `system_prompt` reach Qwen Code (a small model's context: the engine tier)."""
    from pi_env import run_rollout

    options = {"exclude_tools": QWEN_EXTRA_TOOLS, "system_prompt": "You are a terse coding agent."}
    result = run_rollout(TASK, PiConfig(agent={"name": "qwen-code", "options": options}))
    assert result.reward == 1.0, result.error
    assert sorted(tool["function"]["name"] for tool in result.tools) == ["edit", "read_file", "run_shell_command",
                                                                          "write_file"]
    assert result.messages[0] == {"role": "system", "content": "You are a terse coding agent."}


# Qwen Code 0.24.4's tools beyond reading, writing, editing and its shell (deferred ones included).
QWEN_EXTRA_TOOLS = ["agent", "get_goal", "glob", "grep_search", "list_agents", "notebook_edit", "skill", "tool_call",
                    "tool_search", "update_goal", "cron_create", "cron_delete", "cron_list", "enter_worktree",
                    "exit_worktree", "loop_wakeup", "monitor", "read_mcp_resource", "record_artifact",
                    "report_findings", "send_message", "task_stop", "web_fetch", "zoom_image", "ask_user_question",
                    "todo_write", "save_memory", "lsp", "exit_plan_mode"]


@pytest.mark.needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("agent", ["opencode", "qwen-code", "mini-swe-agent", "codex", "claude-code", "gemini-cli"])
def test_harbor_tasks_run_with_any_agent(tmp_path, agent):
    """A Harbor task directory on the oracle: solve.sh runs through the agent's own shell tool,
    and the task's tests (staged only after the agent) score it."""
    from pi_env import load_tasks

    tasks = [t for t in load_tasks(ROOT / "examples" / "harbor") if t.task_id in ("csv-total", "fix-palindrome")]
    summary = CollectRunner(tasks, tmp_path, PiConfig(agent=agent), concurrency=2).run()
    records = {r["task_id"]: r for r in read_records(tmp_path)}
    assert summary.counts["scored"] == 2, {k: (r["error_kind"], r["error"]) for k, r in records.items()}
    assert {k: (r["agent"], r["reward"]) for k, r in records.items()} == {
        "csv-total": (agent, 1.0), "fix-palindrome": (agent, 1.0)}


@pytest.mark.needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("agent", ["pi", "opencode", "qwen-code", "mini-swe-agent", "codex", "claude-code", "gemini-cli"])
def test_interception_gate_hands_every_agents_calls_to_the_trainer(agent):
    """interception_gate with each agent: the trainer (here: the oracle's answers for the tools
    each held request offers) generates every turn; the rollout is verified and scored, every
    call recorded, an extra call (OpenCode's title) handed over and marked too."""
    from pi_env.oracle import TITLE_MESSAGE, adapted_turns
    from pi_env.task import PiTask

    task = PiTask.coerce(TASK)
    factory = PiSessionFactory(PiConfig(mode="interception_gate"), agent=agent)
    handed = []
    with factory.create(task) as session:
        while (request := session.next_request(timeout_s=120)) is not None:
            handed.append(request)
            if not request.tools:
                session.deliver(request, {"message": {"content": TITLE_MESSAGE}})
                continue
            index = sum(1 for m in request.messages if m.get("role") == "assistant")
            turns = adapted_turns(task, request.tools, factory.agent.submit_command)
            turn = turns[min(index, len(turns) - 1)]
            calls = [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls]
            session.deliver(request, {"message": {"content": turn.text or None, "tool_calls": calls}})
        result = session.wait_for_completion()
    assert (result.agent, result.reward, result.error_kind) == (agent, 1.0, None), result.error
    assert len(result.proxy_turns) == len(handed) >= 2
    extra = [t.turn for t in result.proxy_turns if t.extra_call]
    assert extra == [r.turn for r in handed if not r.tools]  # OpenCode's title: handed over, marked
    assert bool(extra) == (agent == "opencode")


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["opencode", "qwen-code", "mini-swe-agent", "codex", "claude-code", "gemini-cli"])
def test_every_agent_runs_in_an_image_without_node(agent):
    """The podman image has no Node of its own: an agent started by the launcher brings the
    launcher's (mounted with it), a Node agent its install's, mini-swe-agent the image's python3."""
    from sandbox_backends import registered

    from pi_env import run_rollout

    backend = registered("podman")()  # skips where podman cannot run (CI requires it)
    with backend.create(__import__("pi_env.sandbox", fromlist=["SandboxSpec"]).SandboxSpec()) as sandbox:
        assert sandbox.exec("command -v node || echo none", timeout_s=60).stdout.strip() == "none"
    result = run_rollout(TASK, PiConfig(agent=agent), backend)
    assert (result.agent, result.reward, result.error_kind) == (agent, 1.0, None), (result.error,
                                                                                    result.agent_log_tail[-1500:])
