"""A plain-Python RL loop over pi_env.workspace: the trainer owns the conversation.

For each generated task: the env's prompt and tool schemas go to an OpenAI-compatible chat
endpoint (non-streaming), every tool call is answered with `env.call(...)`, and at the end
`env.reward(messages)` gives the shaped reward and its metrics. This is where a trainer would
sample with its own policy instead of calling an endpoint.

    .venv/bin/python examples/workspace_loop.py                       # oracle: synthetic answers
    .venv/bin/python examples/workspace_loop.py --endpoint vllm --model Qwen/Qwen3-4B-Instruct-2507
    .venv/bin/python examples/workspace_loop.py --endpoint http://127.0.0.1:8000/v1 --model m

`--endpoint oracle` (the default) plays the reference solution of each task (write the program,
run it, state the answer): synthetic, for checking the loop, never a model's score. Prints one
line per episode, then ONE JSON line (mean reward, per-episode rewards).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # pi-env from the checkout

from pi_env.arguments import config_from_args, endpoint_arguments  # noqa: E402
from pi_env.endpoints import ORACLE, resolve_endpoint  # noqa: E402
from pi_env.workspace import WorkspaceEnv, generate_tasks  # noqa: E402
from pi_env.workspace.oracle import oracle_turns  # noqa: E402


def endpoint_policy(endpoint, max_tokens: int):
    """next assistant message <- one chat/completions call with the env's tools."""
    def next_message(messages: list[dict], tools: list[dict]) -> dict:
        body = {"model": endpoint.model, "messages": messages, "tools": tools, "max_tokens": max_tokens}
        headers = {"Content-Type": "application/json"}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        request = urllib.request.Request(endpoint.base_url + "/chat/completions", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=300) as response:
            message = json.load(response)["choices"][0]["message"]
        return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls") and v is not None}
    return next_message


def oracle_policy(task):
    turns = oracle_turns(task)

    def next_message(messages: list[dict], tools: list[dict]) -> dict:
        done = sum(1 for m in messages if m["role"] == "assistant")
        return turns[done] if done < len(turns) else {"role": "assistant", "content": "(oracle finished)"}
    return next_message


def run_episode(env: WorkspaceEnv, next_message, max_turns: int):
    messages = env.initial_messages()
    for _ in range(max_turns):
        message = next_message(messages, env.tools())
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            break
        for call in calls:
            result = env.call(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return messages, env.reward(messages)


def main() -> int:
    parser = argparse.ArgumentParser(description="A plain-Python loop over pi_env.workspace")
    endpoint_arguments(parser)
    parser.add_argument("--n", type=int, default=4, help="tasks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="train")
    parser.add_argument("--mode", choices=("train", "eval"), default="train")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2048)
    args = parser.parse_args()
    args.backend = None
    endpoint = None if args.endpoint == ORACLE else resolve_endpoint(config_from_args(args))
    rewards = []
    for task in generate_tasks(args.n, split=args.split, seed=args.seed):
        policy = oracle_policy(task) if endpoint is None else endpoint_policy(endpoint, args.max_tokens)
        with WorkspaceEnv(task, mode=args.mode) as env:
            messages, score = run_episode(env, policy, args.max_turns)
        rewards.append(score.reward)
        hits = " ".join(name for name, value in score.metrics.items() if value)
        shown = "unscored" if score.reward is None else f"{score.reward:+.2f}"
        print(f"{task.task_id:<40} reward {shown}  {hits}")
    scored = [r for r in rewards if r is not None]
    print(json.dumps({"endpoint": args.endpoint, "synthetic": endpoint is None, "episodes": len(rewards),
                      "mean_reward": sum(scored) / len(scored) if scored else None, "rewards": rewards}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
