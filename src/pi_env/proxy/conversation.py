"""The rollout's conversation and outcome as the gateway saw them, never as the agent reports them.

The agent is root of its sandbox: Pi's session file, and Pi itself, are its to rewrite or kill,
and it holds its session token, so it can send the gateway any history it likes. What it cannot
forge is what the model answered. So the conversation is rebuilt from the recorded calls:
- every assistant message is an answer the gateway relayed (choice 0), in call order;
- from each request, only what it adds after its last assistant message (tool results, a user
  message), which is what the model was shown on top of its own answers; the first request
  gives the system prompt, the instruction and the tools.
A request whose history does not continue the recorded one (its assistant messages are not the
answers relayed so far) is listed in `rewritten_turns`: its client rewrote the past.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The model's finish_reason -> the stop reason a rollout reports (Pi's own names).
STOP_REASONS = {"stop": "stop", "tool_calls": "toolUse", "function_call": "toolUse", "length": "length"}


@dataclass
class GatewayConversation:
    messages: list[dict[str, Any]] = field(default_factory=list)  # OpenAI chat messages
    tools: list[dict[str, Any]] = field(default_factory=list)  # the first request's tool schemas
    rewritten_turns: list[int] = field(default_factory=list)
    stop_reason: str | None = None  # of the last answered call; "error" when it failed


def gateway_conversation(records) -> GatewayConversation:
    """From a session's TurnRecords (each with its capture: request and assembled answer)."""
    conversation = GatewayConversation()
    answers: list[dict[str, Any]] = []
    for record in records:
        capture = record.capture
        request = capture.request if capture is not None and isinstance(capture.request, dict) else {}
        sent = [m for m in request.get("messages") or [] if isinstance(m, dict)]
        answered = (
            capture is not None
            and capture.choices
            and not capture.synthetic_answer
            and (record.upstream_status or 0) < 400
            and record.upstream_error is None
        )
        if not answered:
            if record.upstream_status is not None or record.upstream_error:
                conversation.stop_reason = "error"
            continue
        if not answers:
            conversation.messages = list(sent)
            tools = request.get("tools")
            conversation.tools = [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
        else:
            last = max((i for i, m in enumerate(sent) if m.get("role") == "assistant"), default=-1)
            if not _continues(sent[: last + 1], answers):
                conversation.rewritten_turns.append(record.turn)
            conversation.messages += sent[last + 1 :]
        answer = capture.choices[0].message()
        answers.append(answer)
        conversation.messages.append(answer)
        conversation.stop_reason = STOP_REASONS.get(capture.finish_reason or "", capture.finish_reason or "stop")
    return conversation


def _continues(history: list[dict[str, Any]], answers: list[dict[str, Any]]) -> bool:
    """Whether the assistant messages of `history` are exactly the answers relayed so far."""
    sent = [m for m in history if m.get("role") == "assistant"]
    return len(sent) == len(answers) and all(_same(a, b) for a, b in zip(sent, answers))


def _same(sent: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Same text and same tool calls (name, arguments as JSON), whatever the client's encoding
    (content parts or a string, null or "", re-serialised arguments)."""
    return _text(sent.get("content")) == _text(answer.get("content")) and _calls(sent.get("tool_calls")) == _calls(
        answer.get("tool_calls")
    )


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def _calls(calls: Any) -> list[tuple[str | None, Any]]:
    out = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                pass
            out.append((function.get("name"), arguments))
    return out
