"""Anthropic's Messages API (`POST /v1/messages`, `?beta=true` too), as Claude Code speaks it: see base.py.

Request -> Chat Completions:
- `system` (a string or text blocks) -> one system message; `messages` -> chat messages, one
  Anthropic assistant message = one chat assistant message: its `text` blocks joined (with
  "\\n") as `content`, its `thinking` as `reasoning_content`, its `tool_use` blocks as
  `tool_calls` (arguments: the input's compact JSON, key order kept); a user message's
  `tool_result` blocks become `role: tool` messages placed before the rest of its text. Text
  blocks are always joined the same way, so a history sent again translates to the same chat
  messages (token-in bridges a conversation only when its history is unchanged). A
  mid-conversation `role: system` turn (Claude Code sends its environment so) stays a system
  message there. Claude Code's first system block, `x-anthropic-billing-header: ...`, is billing
  metadata, not an instruction: dropped, noted. Tools with `defer_loading` are left out, as
  Anthropic leaves them out of the prompt until a tool search loads them.
- `tools` -> function tools, `tool_choice` (auto / any / tool / none, disable_parallel_tool_use)
  -> tool_choice and parallel_tool_calls, `max_tokens` (required, as by Anthropic), `temperature`,
  `top_p`, `stop_sequences` -> stop, `stream` (with usage).
- Accepted and noted (DialectCall.notes), never forwarded: `thinking` (its budget), `top_k`,
  `metadata`, `context_management`, `output_config`, `service_tier`, `container`,
  `cache_control` anywhere, `redacted_thinking` blocks (dropped), a tool result's `is_error`,
  unknown top-level fields, and the `anthropic-beta` / `anthropic-version` headers.
- Refused (400 in Anthropic's shape): server tools (web search, code execution, Anthropic's
  typed bash / text editor / computer tools ...), `mcp_servers`, `thread` and `compaction`
  (state or work on Anthropic's side), images and documents, block types an open engine has no
  counterpart for.

Answer: Anthropic's SSE events as the SDK parses them (message_start, ping, per block
content_block_start / _delta / _stop, message_delta with the stop reason and usage,
message_stop; `error` for an error inside the stream), or a whole Message. Stop reasons: stop
-> end_turn (tool_use when the answer calls tools; stop_sequence when vLLM's `stop_reason`
names one of the request's), length -> max_tokens, tool_calls -> tool_use, none (a cut-off
stream) -> end_turn / tool_use. Usage: the engine's prompt and completion tokens as
input_tokens / output_tokens (in message_delta when streamed), cache fields 0. Reasoning becomes
a `thinking` block closed by a `signature_delta` carrying SYNTHETIC_SIGNATURE: an open engine
signs nothing, and the signature Claude Code sends back is ignored.

Hot path: each event is built from bytes templates and msgspec-encoded strings, no dicts.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import msgspec

from pi_env.proxy.dialects.base import (
    AnswerTranslator,
    ChatChunk,
    Dialect,
    DialectCall,
    DialectError,
    Route,
    encode,
)

ROUTES = frozenset({"/v1/messages", "/v1/messages?beta=true"})

# What a thinking block's signature_delta carries: an open engine signs nothing; Claude Code
# sends the block back with it, and the gateway ignores it.
SYNTHETIC_SIGNATURE = "pi-env-unsigned"

# Top-level fields accepted, noted and not forwarded (what each would mean has no counterpart
# in an open engine's Chat Completions call).
NOTED_FIELDS = (
    "thinking",
    "top_k",
    "metadata",
    "context_management",
    "output_config",
    "service_tier",
    "container",
    "inference_geo",
    "speed",
    "diagnostics",
    "cache_control",  # top-level: caching of the last cacheable block
    "fallbacks",  # other models to retry a refusal on
    "fallback_credit_token",
    "billing_policy",
    "user_profile_id",
    "workspace_id",
)
# Fields whose meaning is state or work on Anthropic's side: refused when set.
REFUSED_FIELDS = {
    "mcp_servers": "MCP servers Anthropic connects to",
    "thread": "conversation state held by Anthropic's servers",
    "compaction": "a summary made by Anthropic's servers",
}
# Fields translated (or checked) by to_chat.
KNOWN_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stream",
        "tools",
        "tool_choice",
        "temperature",
        "top_p",
        "stop_sequences",
        *REFUSED_FIELDS,
        *NOTED_FIELDS,
    }
)
NOTED_HEADERS = ("anthropic-version", "anthropic-beta")
# Claude Code's first system block: billing metadata for Anthropic's servers, not instructions
# for a model ("x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;"): dropped, noted.
BILLING_HEADER = "x-anthropic-billing-header:"

# Chat finish reason -> Anthropic stop reason.
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

# HTTP status -> Anthropic error type (what the SDKs raise is chosen by the status).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_ERROR_TYPES = frozenset(ERROR_TYPES.values()) | {"api_error"}


def error_type(status: int, kind: str | None = None) -> str:
    if kind is not None and kind in ANTHROPIC_ERROR_TYPES:
        return kind
    if kind in ("overloaded", "server_overloaded"):
        return "overloaded_error"
    return ERROR_TYPES.get(status, "api_error" if status >= 500 or status == 0 else "invalid_request_error")


def _refuse(message: str) -> DialectError:
    return DialectError(400, f"pi-env gateway (Anthropic Messages): {message}", "invalid_request_error")


class _Notes:
    """The call's notes, each once, in the order met."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, note: str) -> None:
        if note not in self.items:
            self.items.append(note)


def _text_of(content: Any, where: str, notes: _Notes) -> str:
    """A string, or text blocks joined with "\\n" (a tool result's content, the system prompt)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where} must be a string or a list of content blocks")
    texts = []
    for block in content:
        if not isinstance(block, dict):
            raise _refuse(f"{where} holds a content block that is not an object")
        if "cache_control" in block:
            notes.add("cache_control")
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block.get("text"), f"{where}: a text block's `text`"))
        else:
            raise _refuse(f"{where}: content blocks of type {kind!r} are not supported (text only)")
    return "\n".join(texts)


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _refuse(f"{what} must be a string")
    return value


def _tool(tool: Any, notes: _Notes) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise _refuse("every entry of `tools` must be an object")
    kind = tool.get("type")
    name = tool.get("name")
    if kind not in (None, "custom") or "input_schema" not in tool:
        # web_search_*, web_fetch_*, code_execution_*, bash_*, text_editor_*, computer_*, memory_*,
        # tool_search_* ...: run by Anthropic's servers or typed for its own models.
        raise _refuse(
            f"tool {name!r} of type {kind!r} is a server or Anthropic-defined tool, which an open "
            "engine cannot run; declare it as a custom tool (name, description, input_schema)"
        )
    if not isinstance(name, str) or not name:
        raise _refuse("every tool needs a `name`")
    schema = tool["input_schema"]
    if not isinstance(schema, dict):
        raise _refuse(f"tool {name!r}: `input_schema` must be an object")
    function: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        function["description"] = _string(tool["description"], f"tool {name!r}: `description`")
    function["parameters"] = schema
    for key in tool:
        if key == "cache_control":
            notes.add("cache_control")
        elif key not in ("type", "name", "description", "input_schema", "defer_loading"):
            notes.add(f"tools[].{key}")  # strict, defer_loading, input_examples, ...
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if not isinstance(choice, dict):
        raise _refuse("`tool_choice` must be an object")
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        name = _string(choice.get("name"), "`tool_choice.name`")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise _refuse(f"`tool_choice.type` {kind!r} is not one of auto, any, tool, none")
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        chat["parallel_tool_calls"] = False


def _user_message(content: Any, index: int, out: list[dict[str, Any]], notes: _Notes) -> None:
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    if not isinstance(content, list):
        raise _refuse(f"messages[{index}].content must be a string or a list of content blocks")
    texts = []
    for block in content:
        if not isinstance(block, dict):
            raise _refuse(f"messages[{index}] holds a content block that is not an object")
        if "cache_control" in block:
            notes.add("cache_control")
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block.get("text"), f"messages[{index}]: a text block's `text`"))
        elif kind == "tool_result":
            tool_use_id = _string(block.get("tool_use_id"), f"messages[{index}]: a tool_result's `tool_use_id`")
            result = _text_of(block.get("content"), f"messages[{index}]: tool result {tool_use_id!r}", notes)
            if block.get("is_error"):
                notes.add("tool_result.is_error")
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
        elif kind in ("image", "document"):
            raise _refuse(f"messages[{index}]: {kind} blocks are not supported (the gateway sends text only)")
        else:
            raise _refuse(f"messages[{index}]: content blocks of type {kind!r} are not supported in a user message")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})


def _assistant_message(content: Any, index: int, notes: _Notes) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _refuse(f"messages[{index}].content must be a string or a list of content blocks")
    texts, thoughts, calls = [], [], []
    for block in content:
        if not isinstance(block, dict):
            raise _refuse(f"messages[{index}] holds a content block that is not an object")
        if "cache_control" in block:
            notes.add("cache_control")
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block.get("text"), f"messages[{index}]: a text block's `text`"))
        elif kind == "thinking":
            thoughts.append(_string(block.get("thinking"), f"messages[{index}]: a thinking block's `thinking`"))
        elif kind == "redacted_thinking":
            notes.add("redacted_thinking (dropped)")
        elif kind == "tool_use":
            call_id = _string(block.get("id"), f"messages[{index}]: a tool_use block's `id`")
            name = _string(block.get("name"), f"messages[{index}]: a tool_use block's `name`")
            arguments = encode(block.get("input") or {}).decode()
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        else:
            raise _refuse(
                f"messages[{index}]: content blocks of type {kind!r} are not supported in an assistant message"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else (None if calls else "")}
    thinking = "\n".join(t for t in thoughts if t)
    if thinking:
        message["reasoning_content"] = thinking
    if calls:
        message["tool_calls"] = calls
    return message


class MessagesDialect(Dialect):
    name = "messages"

    def match(self, method: str, raw_path: str) -> Route | None:
        return Route() if method == "POST" and raw_path in ROUTES else None

    def header_notes(self, headers: Mapping[str, str]) -> list[str]:
        return [f"{name}: {headers[name]}" for name in NOTED_HEADERS if name in headers]

    def to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        notes = _Notes()
        model = request.get("model")
        if not isinstance(model, str) or not model:
            raise _refuse("`model` is required (a string)")
        max_tokens = request.get("max_tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise _refuse("`max_tokens` is required (a positive integer)")
        streamed = request.get("stream", False)
        if not isinstance(streamed, bool):
            raise _refuse("`stream` must be a boolean")
        for key, meaning in REFUSED_FIELDS.items():
            if request.get(key):
                raise _refuse(f"`{key}` ({meaning}) cannot be honoured by an open engine")

        messages: list[dict[str, Any]] = []
        system = request.get("system")
        if isinstance(system, list) and system and isinstance(system[0], dict):
            first = system[0].get("text")
            if isinstance(first, str) and first.startswith(BILLING_HEADER):
                notes.add("system: x-anthropic-billing-header (dropped)")
                system = system[1:]
        if system is not None:
            text = _text_of(system, "`system`", notes)
            if text or not isinstance(system, list):
                messages.append({"role": "system", "content": text})
        turns = request.get("messages")
        if not isinstance(turns, list) or not turns:
            raise _refuse("`messages` is required (a non-empty list)")
        for index, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise _refuse(f"messages[{index}] must be an object")
            role = turn.get("role")
            if role == "user":
                _user_message(turn.get("content"), index, messages, notes)
            elif role == "assistant":
                messages.append(_assistant_message(turn.get("content"), index, notes))
            elif role == "system":  # Claude Code's mid-conversation system turn (its environment)
                messages.append(
                    {"role": "system", "content": _text_of(turn.get("content"), f"messages[{index}]", notes)}
                )
            else:
                raise _refuse(f"messages[{index}].role must be user, assistant or system, not {role!r}")

        chat: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
        tools = request.get("tools")
        if tools:
            if not isinstance(tools, list):
                raise _refuse("`tools` must be a list")
            loaded = [tool for tool in tools if not (isinstance(tool, dict) and tool.get("defer_loading") is True)]
            if len(loaded) < len(tools):  # Anthropic keeps them out of the prompt until a tool search loads them
                notes.add(f"tools[].defer_loading ({len(tools) - len(loaded)} deferred tools left out)")
            chat["tools"] = [_tool(tool, notes) for tool in loaded]
            if request.get("tool_choice") is not None:
                _tool_choice(request["tool_choice"], chat)
        elif request.get("tool_choice") is not None:
            notes.add("tool_choice (no tools)")
        for key in ("temperature", "top_p"):
            if request.get(key) is not None:
                chat[key] = request[key]
        stop = request.get("stop_sequences")
        if stop:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise _refuse("`stop_sequences` must be a list of strings")
            chat["stop"] = stop
        chat["stream"] = streamed
        if streamed:
            chat["stream_options"] = {"include_usage": True}

        for key in NOTED_FIELDS:
            value = request.get(key)
            if value is None:
                continue
            if key == "thinking" and isinstance(value, dict):
                budget = value.get("budget_tokens")
                notes.add(f"thinking: {value.get('type')}" + (f" (budget_tokens {budget})" if budget else ""))
            elif key == "top_k":
                notes.add(f"top_k: {value} (not a Chat Completions field)")
            else:
                notes.add(key)
        for key in request:
            if key not in KNOWN_FIELDS:
                notes.add(f"{key} (unknown field, not forwarded)")
        state = {"stop": stop or ()}
        return DialectCall("messages", chat, streamed, model, notes=notes.items, state=state)

    def translator(self, call: DialectCall) -> AnswerTranslator:
        return MessagesTranslator(call)

    def error_body(self, status: int, message: str, kind: str) -> bytes:
        return encode({"type": "error", "error": {"type": error_type(status, kind), "message": message}})


# -- the answer


def _event(name: str, data: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


_PING = _event("ping", b'{"type":"ping"}')
_MESSAGE_STOP = _event("message_stop", b'{"type":"message_stop"}')
_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_START = b'event: content_block_start\ndata: {"type":"content_block_start","index":'
_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":'
_TEXT_DELTA = b',"delta":{"type":"text_delta","text":'
_THINKING_DELTA = b',"delta":{"type":"thinking_delta","thinking":'
_JSON_DELTA = b',"delta":{"type":"input_json_delta","partial_json":'
_SIGNATURE = b',"delta":{"type":"signature_delta","signature":' + encode(SYNTHETIC_SIGNATURE) + b"}}\n\n"
_END = b"}}\n\n"
_TEXT_BLOCK = b',"content_block":{"type":"text","text":""}}\n\n'
_THINKING_BLOCK = b',"content_block":{"type":"thinking","thinking":"","signature":""}}\n\n'


def _usage_numbers(usage: dict[str, Any] | None) -> tuple[int, int]:
    if not usage:
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if type(prompt) is int else 0), (completion if type(completion) is int else 0)


def _message_id(chat_id: str | None) -> str:
    # Never the engine's id: Claude Code merges consecutive assistant messages that share an id,
    # and an engine that repeats its ids (a stub, some local servers) would fold two turns into
    # one. The engine's id stays in the turn's capture.
    return "msg_" + secrets.token_hex(12)


class MessagesTranslator(AnswerTranslator):
    def __init__(self, call: DialectCall):
        super().__init__(call)
        self.started = False
        self.failed = False  # an error event was sent: the stream ends there
        self.blocks = 0  # content blocks opened so far
        self.kind: str | None = None  # the open block's kind: "text", "thinking", "tool_use"; None: none open
        self.index = b""  # the open block's index, as bytes
        self.prefix = b""  # the open block's content_block_delta event up to its delta's value
        self.tools: dict[int, bytes] = {}  # a chat tool call's index -> its block's delta prefix
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None

    # -- streamed

    def _start_message(self, chat_id: str | None) -> bytes:
        self.started = True
        message: dict[str, Any] = {
            "id": _message_id(chat_id),
            "type": "message",
            "role": "assistant",
            "model": self.call.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 0,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return _event("message_start", encode({"type": "message_start", "message": message})) + _PING

    def _open(self, kind: str, block: bytes, delta: bytes = b"") -> bytes:
        """Close the open block, open a new one of `kind` (`block`: its content_block start;
        `delta`: what its deltas carry after the index, kept as the block's delta prefix)."""
        out = self._close_block()
        self.kind, self.index = kind, str(self.blocks).encode()
        self.prefix = _DELTA + self.index + delta
        self.blocks += 1
        return out + _START + self.index + block

    def _close_block(self) -> bytes:
        if self.kind is None:
            return b""
        out = _DELTA + self.index + _SIGNATURE if self.kind == "thinking" else b""
        self.kind = None
        return out + _STOP + self.index + b"}\n\n"

    def events(self, chunks: list[ChatChunk]) -> bytes:
        if self.failed:
            return b""
        out = []
        if not self.started:
            out.append(self._start_message(chunks[0].id if chunks else None))
        for chunk in chunks:
            if chunk.error is not None:
                out.append(self._error(chunk.error))
                break
            if chunk.usage:
                self.usage = chunk.usage
            for choice in chunk.choices or ():
                if choice.finish_reason is not None:
                    self.finish = choice.finish_reason
                    self.stop_reason = choice.stop_reason
                delta = choice.delta
                if delta is None:
                    continue
                if (
                    delta.content
                    and delta.reasoning_content is None
                    and delta.reasoning is None
                    and not delta.tool_calls
                ):
                    if self.kind != "text":  # the common case first: one piece of text
                        out.append(self._open("text", _TEXT_BLOCK, _TEXT_DELTA))
                    out.append(self.prefix + encode(delta.content) + _END)
                    continue
                thought = delta.reasoning_content if delta.reasoning_content is not None else delta.reasoning
                if thought:
                    if self.kind != "thinking":
                        out.append(self._open("thinking", _THINKING_BLOCK, _THINKING_DELTA))
                    out.append(self.prefix + encode(thought) + _END)
                if delta.content:
                    if self.kind != "text":
                        out.append(self._open("text", _TEXT_BLOCK, _TEXT_DELTA))
                    out.append(self.prefix + encode(delta.content) + _END)
                if delta.tool_calls:
                    for tool_call in delta.tool_calls:
                        out.append(self._tool_delta(tool_call))
        return b"".join(out)

    def _tool_delta(self, tool_call: Any) -> bytes:
        position = tool_call.index if tool_call.index is not None else len(self.tools)
        function = tool_call.function
        out = b""
        prefix = self.tools.get(position)
        if prefix is None:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": tool_call.id or "toolu_" + secrets.token_hex(12),
                "name": (function.name if function is not None else None) or "",
                "input": {},
            }
            out = self._open("tool_use", b',"content_block":' + encode(block) + b"}\n\n", _JSON_DELTA)
            prefix = self.tools[position] = self.prefix
        arguments = function.arguments if function is not None else None
        if arguments:
            out += prefix + encode(arguments) + _END
        return out

    def _error(self, error: Any) -> bytes:
        self.failed = True
        if isinstance(error, dict):
            message = str(error.get("message") or error)
            kind = error_type(0, str(error.get("type") or error.get("code") or ""))
        else:
            message, kind = str(error), "api_error"
        body = {"type": "error", "error": {"type": kind, "message": message}}
        return _event("error", encode(body))

    def _stop_reason(self, has_tools: bool) -> tuple[str, str | None]:
        stop_reason = STOP_REASONS.get(self.finish or "", "end_turn")
        if stop_reason == "end_turn" and has_tools:
            return "tool_use", None
        stops = self.call.state.get("stop") or ()
        if stop_reason == "end_turn" and isinstance(self.stop_reason, str) and self.stop_reason in stops:
            return "stop_sequence", self.stop_reason
        return stop_reason, None

    def close(self) -> bytes:
        if self.failed:
            return b""
        out = b"" if self.started else self._start_message(None)
        out += self._close_block()
        stop_reason, stop_sequence = self._stop_reason(bool(self.tools))
        prompt, completion = _usage_numbers(self.usage)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {
                "input_tokens": prompt,
                "output_tokens": completion,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        self.failed = True  # ended: nothing more
        return out + _event("message_delta", encode(delta)) + _MESSAGE_STOP

    # -- whole

    def whole(self, answer: ChatChunk) -> bytes:
        content: list[dict[str, Any]] = []
        choice = answer.choices[0] if answer.choices else None
        message = choice.message if choice is not None else None
        if choice is not None:
            self.finish = choice.finish_reason
            self.stop_reason = choice.stop_reason
        if message is not None:
            thought = message.reasoning_content if message.reasoning_content is not None else message.reasoning
            if thought:
                content.append({"type": "thinking", "thinking": thought, "signature": SYNTHETIC_SIGNATURE})
            if message.content:
                content.append({"type": "text", "text": message.content})
            for tool_call in message.tool_calls or ():
                function = tool_call.function
                arguments = (function.arguments if function is not None else None) or "{}"
                try:
                    tool_input = msgspec.json.decode(arguments)
                except msgspec.DecodeError:
                    tool_input = None
                if not isinstance(tool_input, dict):  # not a JSON object: the model's text, as text
                    content.append({"type": "text", "text": arguments})
                    continue
                content.append(
                    {
                        "type": "tool_use",
                        "id": tool_call.id or "toolu_" + secrets.token_hex(12),
                        "name": (function.name if function is not None else None) or "",
                        "input": tool_input,
                    }
                )
        stop_reason, stop_sequence = self._stop_reason(any(block["type"] == "tool_use" for block in content))
        prompt, completion = _usage_numbers(answer.usage)
        return encode(
            {
                "id": _message_id(answer.id),
                "type": "message",
                "role": "assistant",
                "model": self.call.model,
                "content": content,
                "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {
                    "input_tokens": prompt,
                    "output_tokens": completion,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                },
            }
        )
