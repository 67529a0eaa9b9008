"""Token-in for every agent on the real engine (vLLM CPU, SmolLM2-135M-Instruct): each agent's
rollout, whatever its wire format (the gateway's dialects), is one exact training sequence, every prompt the engine's echo and every completion id
and logprob what it streamed; an agent's extra calls (OpenCode's title) are recorded and left out.

As in test_token_in_engine.py (whose relay this reuses), SmolLM2 never calls a tool on its own,
so the first FORCED_CALLS answers of each rollout are forced into a Hermes call of the agent's
own shell tool; the third answer is free (and capped). Qwen Code's 71 KB requests exceed the
model's 8192-token context, so it runs with its own options for a small context (its extra
tools left out, a short system prompt), as a user training a small model would.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine import NOTES
from test_token_in_engine import COMMANDS, FORCED_CALLS, Relay

from pi_env import PiConfig, PiSessionFactory, PiTask
from pi_env._aio import run_sync

pytest.importorskip("renderers", reason="token-in needs pi-env[token-in]")

ROLLOUTS = int(os.environ.get("AGENT_TOKEN_IN_ROLLOUTS", "2"))
QWEN_EXTRA_TOOLS = ["agent", "get_goal", "glob", "grep_search", "list_agents", "notebook_edit", "skill", "tool_call",
                    "tool_search", "update_goal", "cron_create", "cron_delete", "cron_list", "enter_worktree",
                    "exit_worktree", "loop_wakeup", "monitor", "read_mcp_resource", "record_artifact",
                    "report_findings", "send_message", "task_stop", "web_fetch", "zoom_image", "ask_user_question",
                    "todo_write", "save_memory", "lsp", "exit_plan_mode"]
GEMINI_EXTRA_TOOLS = ["update_topic", "list_directory", "grep_search", "glob", "web_fetch", "google_web_search",
                      "list_background_processes", "read_background_output", "enter_plan_mode", "invoke_agent",
                      "activate_skill"]
SHORT_PROMPT = "You are a coding agent. Use the tools."
# agent -> (its shell tool's name, that tool's command argument, its options for a small model's
# context). Codex, Claude Code and Gemini CLI speak Responses, Messages and generateContent: the
# gateway's dialects translate, and the sequence must stay one all the same.
AGENTS = {
    "opencode": ("bash", "command", {}),
    "qwen-code": ("run_shell_command", "command", {"exclude_tools": QWEN_EXTRA_TOOLS, "system_prompt": SHORT_PROMPT}),
    "mini-swe-agent": ("bash", "command", {}),
    "codex": ("exec_command", "cmd", {"system_prompt": SHORT_PROMPT}),
    "claude-code": ("Bash", "command", {"tools": ["Bash"], "system_prompt": SHORT_PROMPT}),
    "gemini-cli": ("run_shell_command", "command", {"exclude_tools": GEMINI_EXTRA_TOOLS, "system_prompt": SHORT_PROMPT}),
}


def forced_call(tool: str, argument: str = "command") -> str:
    return ('<tool_call>\\n\\{"name": "' + tool + '", "arguments": \\{"' + argument + '": "('
            + "|".join(c.replace(".", "\\.") for c in COMMANDS) + ')"\\}\\}\\n</tool_call>')


@pytest.fixture(scope="module")
def tokenizer(vllm_engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vllm_engine.model_dir))


@pytest.mark.timeout(3 * 3600)
@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_each_agents_token_in_rollout_is_one_exact_sequence(agent, vllm_engine, tokenizer, tmp_path):
    tool, argument, options = AGENTS[agent]
    relay = Relay(vllm_engine.base_url, tokenizer.encode("<|im_start|>assistant", add_special_tokens=False),
                  regex=forced_call(tool, argument))
    run_sync(relay.start(), timeout=30)
    try:
        config = PiConfig(
            agent={"name": agent, "options": options, "context_window": 8192},
            endpoint={"name": relay.base_url, "model": vllm_engine.model},
            mode={"name": "transparent_proxy", "return_token_ids": True, "token_in": True, "renderer": "auto",
                  "tokenizer": str(vllm_engine.model_dir), "top_logprobs": 1, "trace_dir": str(tmp_path)},
            gateway={"max_turns": FORCED_CALLS + 1, "max_tokens": 96},
        )
        factory = PiSessionFactory(config)

        def rollout(index: int):
            task = PiTask(task_id=f"{agent}-{index}", instruction=f"Task {index}: look around with the shell, then "
                          "say what notes.txt is about.", files={"notes.txt": f"note {index}\n"}, verify=["true"],
                          timeouts={"agent_s": 1800})
            config.proxy_sampling = {"temperature": 0.0, "seed": 2000 + index}
            with factory.create(task) as session:
                return session.wait_for_completion()

        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(rollout, range(ROLLOUTS)))
    finally:
        run_sync(relay.runner.cleanup(), timeout=30)

    turns_checked, extra = 0, 0
    for result in results:
        assert result.error_kind is None, (result.error, result.agent_log_tail[-2000:])
        assert result.agent == agent
        own = [t for t in result.proxy_turns if t.extra_call is None]
        extra += len(result.proxy_turns) - len(own)
        calls = [t for t in own if t.message and t.message.get("tool_calls")]
        assert len(calls) >= FORCED_CALLS, json.dumps([t.message for t in own])[:3000]
        assert result.training.append_only and len(result.training.segments) == 1, result.training.turns
        assert all(t.extends_previous for t in result.training.turns if t.extra_call is None and t.turn != own[0].turn)
        assert result.training.segments[0].turns == [t.turn for t in own]
        for turn in own:
            engine = relay.seen[("completions", tuple(turn.prompt_token_ids))]
            assert turn.token_in["engine_prompt_token_ids_match"] is True
            assert turn.prompt_token_ids == engine["prompt"]
            assert turn.completion_token_ids == engine["ids"] and turn.per_token_logps == engine["logprobs"]
            turns_checked += 1
    lengths = [len(r.training.segments[0].token_ids) for r in results]
    NOTES.append(f"token-in, {agent}: {len(results)} rollouts, {turns_checked} turns, one exact sequence each "
                 f"({min(lengths)}-{max(lengths)} tokens), prompt ids == engine's echo and completion ids/logprobs == "
                 f"engine's on every turn; {extra} extra calls recorded and left out")
