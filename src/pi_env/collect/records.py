"""One line of `results.jsonl`: a `RolloutResult` as a dataset record.

The conversation is in the shape TRL's SFTTrainer takes for tool calling: `messages` with
`system`, `user`, `assistant` (`content`, optional `tool_calls` of OpenAI's
`{id, type, function: {name, arguments}}` and `reasoning_content`) and `tool` results
(`tool_call_id`, `name`, `content`), plus `tools`, the JSON schemas Pi offered, as a JSON
string (TRL parses a string `tools` column). Tool-call arguments stay the JSON string the model
wrote: a dict column would be widened by Arrow into one struct with every tool's keys.
Every value keeps one type across records, so `datasets.load_dataset("json", ...)` reads it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..results import RolloutResult

RECORD_VERSION = 1
VERIFY_OUTPUT_CHARS = 2000


def record_id(task_id: str, group_index: int) -> str:
    return f"{task_id}#{group_index}"


def to_record(
    result: RolloutResult,
    *,
    task,
    group_index: int,
    attempt: int,
    failed_attempts: list[dict] | None = None,
    worker: str = "",
) -> dict[str, Any]:
    messages, tools = sft_messages(result.messages, result.tools)  # the gateway's record, never Pi's file
    return {
        "id": record_id(task.task_id, group_index),
        "task_id": task.task_id,
        "group_id": task.task_id,  # every sample of a task is one GRPO group
        "group_index": group_index,
        "attempt": attempt,
        "failed_attempts": failed_attempts or [],  # infra failures retried before this attempt
        "reward": result.reward,
        "reward_source": result.reward_source,
        "scored": result.reward is not None,
        "error_kind": result.error_kind,
        "error": result.error,
        "stop_reason": result.stop_reason,
        "instruction": task.instruction,
        "messages": messages,
        "tools": json.dumps(tools),
        "turns": [_turn(turn) for turn in result.proxy_turns],
        "training": result.training.model_dump() if result.training is not None else None,
        "verify": [
            {
                "cmd": r.cmd[:500],
                "exit_code": r.exit_code,
                "duration_s": r.duration_s,
                "timed_out": r.timed_out,
                "output_tail": (r.stdout + r.stderr)[-VERIFY_OUTPUT_CHARS:],
            }
            for r in result.verify_results
        ],
        "verify_notes": result.verify_notes,  # files set aside for verify, a reward file ignored or rejected
        "timings": result.timings,
        "wall_s": result.wall_s,
        "endpoint": result.endpoint,
        "model": result.model,
        "mode": result.mode,
        "sampling": json.dumps(result.sampling),  # forced at the gateway; "{}": the engine's defaults
        "agent": result.agent,  # the coding agent that ran, and its version
        "agent_version": result.agent_version,
        "pi_version": result.pi_version,
        "synthetic": result.synthetic,
        "sandbox_id": result.sandbox_id,
        "session_id": result.session_id,  # sent upstream in PiConfig.gateway_session_header
        "worker": worker,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "record_version": RECORD_VERSION,
    }


def _turn(turn) -> dict[str, Any]:
    # Prompt ids grow with every turn (quadratic in the rollout's length); the training view
    # holds each sequence once, so a turn keeps only what it generated.
    return {
        "turn": turn.turn,
        "extra_call": turn.extra_call,  # an agent's own call outside the task's conversation (left out of training)
        "finish_reason": turn.finish_reason,
        "completion_tokens": turn.completion_tokens,
        "prompt_length": len(turn.prompt_token_ids),
        "completion_token_ids": turn.completion_token_ids,
        "logprobs": turn.per_token_logps,
        "token_ids_source": turn.token_ids_source,
        "token_ids_missing_reason": turn.token_ids_missing_reason,
        "upstream_status": turn.upstream_status,
        "policy_version": turn.policy_version,  # the weights that generated it (docs/async-rl.md)
        "policy_version_source": turn.policy_version_source,
        "replica": turn.replica,  # host:port that answered (several replicas: docs/async-rl.md)
        "failed_over": turn.failed_over,
        "latency_s": turn.latency_s,
        "timestamp": turn.timestamp,
    }


def sft_messages(messages: list[dict], tools: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """The gateway's conversation (OpenAI chat messages, RolloutResult.messages) and tool schemas
    -> TRL's shape: text content, tool calls with string arguments, tool results named."""
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_call_id -> the tool's name
    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _text(message.get("content"))})
        elif role == "user":
            out.append({"role": "user", "content": _text(message.get("content"))})
        elif role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": _text(message.get("content"))}
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                entry["reasoning_content"] = reasoning
            calls: list[dict[str, Any]] = []
            for call in [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]:
                function = call.get("function")
                if not isinstance(function, dict):
                    function = {}
                call_id, name = call.get("id") or "", function.get("name") or ""
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": _arguments(function.get("arguments"))},
                    }
                )
                names[call_id] = name
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif role == "tool":
            call_id = message.get("tool_call_id") or ""
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": message.get("name") or names.get(call_id, ""),
                    "content": _text(message.get("content")),
                }
            )
    schemas = []
    for tool in [t for t in tools or [] if isinstance(t, dict)]:
        function = tool.get("function")
        if not isinstance(function, dict):
            function = tool
        schemas.append(
            {
                "type": "function",
                "function": {
                    "name": function.get("name"),
                    "description": function.get("description", ""),
                    "parameters": function.get("parameters", {}),
                },
            }
        )
    return out, schemas


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content if isinstance(content, list) else [content]:
        if isinstance(block, dict):
            if block.get("type") == "text":
                parts.append(block.get("text", ""))
            elif block.get("type") in ("image", "image_url"):
                parts.append("[image]")
        elif isinstance(block, str):
            parts.append(block)
    return "".join(parts)


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
