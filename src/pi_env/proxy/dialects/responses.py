"""OpenAI's Responses API (`POST /v1/responses`), as Codex speaks it: see base.py.

The request becomes one Chat Completions call:
- `instructions` and the developer/system messages before the first other item become ONE
  system message (their text parts in order: many open models' templates refuse a system
  message after the first); a later developer/system message stays where it is, as `system`;
- `input` items become chat messages; consecutive assistant-side items (reasoning, assistant
  message, function_call, custom_tool_call: what one answer gave the agent) become ONE assistant
  message, text joined as the answer streamed it, reasoning in `reasoning_content`, calls in
  order, so a history is exactly the request before + the answer the gateway gave (token-in);
- function tools become chat function tools; a `custom` (freeform) tool becomes a function
  with one string parameter `input`, mapped back to a custom_tool_call in the answer; hosted
  tools (web_search, file_search, computer use, ...) cannot run on an open engine: refused;
- `store`, `include`, `reasoning`, `prompt_cache_key`, `metadata`, `client_metadata`, ... are
  accepted and noted (DialectCall.notes), never sent on; state the gateway does not keep
  (`previous_response_id`, `conversation`, stored prompts, item references, `background`) is
  refused with a 400 that says so.

The answer: the event stream the openai SDK's `ResponseStreamEvent` union parses (created,
in_progress, each output item added / its parts / deltas / done, completed or incomplete with
usage; an error inside the stream ends it with `error` + `response.failed`, a cut-off stream
with `response.failed`), or the whole `Response` object. Reasoning is a `reasoning` item with
`reasoning_text` content (what open models give: their raw reasoning, not a summary). A tool
call's `call_id` is the chat tool call's id; its item id is derived from it (`fc_<call_id>`).

Hot path: a text, reasoning or arguments delta is one pre-encoded byte template per output item
+ the delta's JSON string (msgspec) + the sequence number; the rest is built once per item.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

from pi_env.proxy.capture import ToolCallDelta
from pi_env.proxy.dialects.base import AnswerTranslator, ChatChunk, Dialect, DialectCall, DialectError, Route, encode

# Hosted tools run on OpenAI's side; an open engine has none of them.
HOSTED_TOOLS = frozenset(
    {
        "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
        "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter",
        "image_generation", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
    }
)  # fmt: skip
# Accepted, not sent on: what they ask for has no meaning for an open engine (or for a gateway
# that keeps nothing); each present one is noted on the turn's record.
NOTED_FIELDS = (
    "store", "include", "reasoning", "prompt_cache_key", "prompt_cache_retention", "metadata",
    "client_metadata", "service_tier", "user", "safety_identifier", "truncation", "top_logprobs",
    "max_tool_calls", "stream_options",
)  # fmt: skip
REFUSED_FIELDS = {
    "previous_response_id": "the pi-env gateway keeps no responses: send the whole conversation in "
    "`input` (store=false style) instead of `previous_response_id`",
    "conversation": "the pi-env gateway keeps no conversations: send the whole conversation in `input`",
    "background": "the pi-env gateway answers in the foreground only (`background` responses are "
    "stored and polled, and it stores nothing)",
    "prompt": "the pi-env gateway has no stored prompts: send the prompt's text in `instructions`/`input`",
}
KNOWN_FIELDS = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
     "max_output_tokens", "stream", "text", *NOTED_FIELDS, *REFUSED_FIELDS}
)  # fmt: skip
ASSISTANT_ITEMS = frozenset({"reasoning", "function_call", "custom_tool_call"})
CUSTOM_INPUT = "input"  # the one parameter of a custom tool's function


def _refuse(message: str) -> DialectError:
    return DialectError(400, f"pi-env gateway (Responses): {message}")


def _text_parts(content: Any, where: str, *, images: bool) -> list[dict[str, Any]]:
    """A Responses content (a string or parts) as chat content parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _refuse(f"{where}: `content` must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise _refuse(f"{where}: a `{kind}` part without a text string")
            parts.append({"type": "text", "text": text})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal") or "")})
        elif kind == "input_image" and images and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            what = "an image by file id" if kind == "input_image" and images else f"a `{kind}` part"
            if kind == "input_image" and not images:
                what = "an image in a tool's output (Chat Completions tool results are text)"
            raise _refuse(f"{where}: {what} cannot be sent to the engine")
    return parts


def _chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part as a string (as most agents send it); several, or images, as parts (the
    engine joins text parts as its template expects)."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _joined(parts: list[dict[str, Any]]) -> str:
    return "".join(part["text"] for part in parts)


class _Assistant:
    """The assistant message being built from consecutive assistant-side items."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def message(self) -> dict[str, Any]:
        text = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.calls:
            message["tool_calls"] = self.calls
        reasoning = "".join(self.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        return message


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _refuse(f"{where}: `call_id` must be a non-empty string")
    return call_id


def _messages(request: dict[str, Any], notes: list[str]) -> list[dict[str, Any]]:
    system: list[dict[str, Any]] = []  # the one leading system message's parts
    instructions = request.get("instructions")
    if isinstance(instructions, str):
        if instructions:
            system.append({"type": "text", "text": instructions})
    elif instructions is not None:
        raise _refuse("`instructions` must be a string")
    items = request.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    elif items is None:
        items = []
    elif not isinstance(items, list):
        raise _refuse("`input` must be a string or a list of items")
    messages: list[dict[str, Any]] = []
    assistant: _Assistant | None = None
    leading = True
    encrypted = False
    for position, item in enumerate(items):
        where = f"input[{position}]"
        if not isinstance(item, dict):
            raise _refuse(f"{where} is not an object")
        kind = item.get("type", "message" if "role" in item else None)
        role = item.get("role")
        if kind in ASSISTANT_ITEMS or (kind == "message" and role == "assistant"):
            leading = False
            if assistant is None:
                assistant = _Assistant()
            if kind == "message":
                assistant.text.append(_joined(_text_parts(item.get("content"), where, images=False)))
            elif kind == "reasoning":
                content = item.get("content")
                texts = _text_parts(content, where, images=False) if content else []
                if not texts:  # only a summary came back: it is what the model's reasoning was
                    summary = item.get("summary") or []
                    texts = _text_parts(summary, where, images=False) if summary else []
                    if len(texts) > 1:
                        texts = [{"type": "text", "text": "\n\n".join(t["text"] for t in texts)}]
                assistant.reasoning.append(_joined(texts))
                encrypted = encrypted or bool(item.get("encrypted_content"))
            elif kind == "function_call":
                name, arguments = item.get("name"), item.get("arguments")
                if not isinstance(name, str) or not isinstance(arguments, str):
                    raise _refuse(f"{where}: a function_call needs `name` and `arguments` strings")
                function = {"name": name, "arguments": arguments}
                assistant.calls.append({"id": _call_id(item, where), "type": "function", "function": function})
            else:  # custom_tool_call
                name, given = item.get("name"), item.get("input")
                if not isinstance(name, str) or not isinstance(given, str):
                    raise _refuse(f"{where}: a custom_tool_call needs `name` and `input` strings")
                function = {"name": name, "arguments": encode({CUSTOM_INPUT: given}).decode()}
                assistant.calls.append({"id": _call_id(item, where), "type": "function", "function": function})
            continue
        if assistant is not None:
            messages.append(assistant.message())
            assistant = None
        if kind == "message":
            if role in ("system", "developer"):
                parts = _text_parts(item.get("content"), where, images=False)
                if leading:
                    system.extend(parts)
                else:
                    messages.append({"role": "system", "content": _chat_content(parts)})
            elif role == "user":
                leading = False
                messages.append(
                    {"role": "user", "content": _chat_content(_text_parts(item.get("content"), where, images=True))}
                )
            else:
                raise _refuse(f"{where}: a message's role must be user, assistant, system or developer, not {role!r}")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            leading = False
            output = item.get("output")
            if output is None:
                raise _refuse(f"{where}: a {kind} needs an `output`")
            parts = _text_parts(output, where, images=False)
            messages.append({"role": "tool", "tool_call_id": _call_id(item, where), "content": _chat_content(parts)})
        elif kind == "item_reference":
            raise _refuse(f"{where}: an item_reference names a stored item, and the gateway keeps none")
        else:
            raise _refuse(f"{where}: an item of type {kind!r} cannot be sent to an open engine")
    if assistant is not None:
        messages.append(assistant.message())
    if encrypted:
        notes.append("input reasoning.encrypted_content (not forwarded)")
    if system:
        messages.insert(0, {"role": "system", "content": _chat_content(system)})
    if not messages:
        raise _refuse("the request has no `input` (nor `instructions`)")
    return messages


def _tools(request: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list[str]]:
    tools = request.get("tools")
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise _refuse("`tools` must be a list")
    chat: list[dict[str, Any]] = []
    custom: list[str] = []
    for position, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        name = tool.get("name") if isinstance(tool, dict) else None
        if kind == "function":
            if not isinstance(name, str) or not name:
                raise _refuse(f"tools[{position}]: a function tool needs a `name`")
            function: dict[str, Any] = {"name": name}
            for key in ("description", "parameters", "strict"):
                if tool.get(key) is not None:
                    function[key] = tool[key]
            chat.append({"type": "function", "function": function})
        elif kind == "custom":
            if not isinstance(name, str) or not name:
                raise _refuse(f"tools[{position}]: a custom tool needs a `name`")
            described = "The tool's input, as free text."
            fmt = tool.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
                described = f"The tool's input, in this {fmt.get('syntax', 'grammar')} grammar:\n{fmt['definition']}"
            parameters = {
                "type": "object",
                "properties": {CUSTOM_INPUT: {"type": "string", "description": described}},
                "required": [CUSTOM_INPUT],
                "additionalProperties": False,
            }
            function = {"name": name, "parameters": parameters}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            chat.append({"type": "function", "function": function})
            custom.append(name)
        elif kind in HOSTED_TOOLS:
            raise _refuse(
                f"the hosted tool `{kind}` runs on OpenAI's side; an open engine has none (send function tools)"
            )
        else:
            raise _refuse(f"tools[{position}]: a tool of type {kind!r} cannot be sent to an open engine")
    return chat, custom


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") in ("function", "custom")
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refuse(f"`tool_choice` {encode(choice).decode()[:200]} cannot be honoured by an open engine")


def _response_format(text: Any, notes: list[str]) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _refuse("`text` must be an object")
    if text.get("verbosity") is not None:
        notes.append(f"text.verbosity: {text['verbosity']}")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": schema}
    raise _refuse("`text.format` must be text, json_object or json_schema (with a `schema`)")


def _note(name: str, value: Any) -> str:
    if name == "reasoning" and isinstance(value, dict):
        return "reasoning " + ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
    if name == "include" and isinstance(value, list):
        return "include " + ", ".join(str(v) for v in value)
    if name in ("store", "service_tier", "truncation", "top_logprobs", "max_tool_calls"):
        return f"{name}={value if isinstance(value, str) else encode(value).decode()}"[:120]
    return name  # identifiers and metadata: that they came, not what they hold


class ResponsesDialect(Dialect):
    name = "responses"

    def match(self, method: str, raw_path: str) -> Route | None:
        return Route() if method == "POST" and raw_path == "/v1/responses" else None

    def to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        for name, why in REFUSED_FIELDS.items():
            if request.get(name) not in (None, False):
                raise _refuse(why)
        notes: list[str] = []
        stream = request.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise _refuse(f"`stream` must be a JSON boolean (true or false), not {encode(stream).decode()[:100]}")
        model = request.get("model")
        chat: dict[str, Any] = {"model": model if isinstance(model, str) else "", "messages": _messages(request, notes)}
        tools, custom = _tools(request)
        if tools:
            chat["tools"] = tools
        tool_choice = _tool_choice(request.get("tool_choice"))
        if tool_choice is not None and tools:
            chat["tool_choice"] = tool_choice
        if isinstance(request.get("parallel_tool_calls"), bool) and tools:
            chat["parallel_tool_calls"] = request["parallel_tool_calls"]
        for key in ("temperature", "top_p"):
            if request.get(key) is not None:
                chat[key] = request[key]
        if request.get("max_output_tokens") is not None:
            chat["max_tokens"] = request["max_output_tokens"]
        response_format = _response_format(request.get("text"), notes)
        if response_format is not None:
            chat["response_format"] = response_format
        if stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        for name in NOTED_FIELDS:
            if request.get(name) is not None:
                notes.append(_note(name, request[name]))
        notes.extend(f"ignored: {name}" for name in request if name not in KNOWN_FIELDS)
        echo = {
            "tool_choice": request.get("tool_choice") or "auto",
            "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
            "temperature": request.get("temperature"),
            "top_p": request.get("top_p"),
            "max_output_tokens": request.get("max_output_tokens"),
        }
        return DialectCall(
            dialect=self.name,
            chat=chat,
            streamed=bool(stream),
            model=chat["model"],
            notes=notes,
            state={"custom": frozenset(custom), "echo": echo},
        )

    def translator(self, call: DialectCall) -> AnswerTranslator:
        return ResponsesTranslator(call)

    def error_body(self, status: int, message: str, kind: str) -> bytes:
        return encode({"error": {"message": message, "type": kind, "param": None, "code": None}})


# -------------------------------------------------------------------------------- the answer


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": prompt_details.get("cached_tokens") or 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": completion_details.get("reasoning_tokens") or 0},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


def _custom_input(arguments: str) -> str:
    """A custom tool's input from its function's arguments ({"input": "..."}); arguments that
    are not that object are the input as the model wrote them."""
    try:
        decoded = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    if isinstance(decoded, dict) and isinstance(decoded.get(CUSTOM_INPUT), str):
        return decoded[CUSTOM_INPUT]
    return arguments


INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


class _Item:
    """One output item of a streamed answer: what its deltas need, pre-encoded."""

    __slots__ = ("kind", "index", "id", "pieces", "delta_head", "name", "call_id", "custom")

    def __init__(self, kind: str, index: int, item_id: str, delta_type: bytes, delta_fields: bytes):
        self.kind, self.index, self.id = kind, index, item_id
        self.pieces: list[str] = []
        self.name = self.call_id = ""
        self.custom = False
        # everything of a delta event before its `delta` value and sequence number
        self.delta_head = (
            b"event: " + delta_type + b'\ndata: {"type":"' + delta_type + b'","item_id":"' + item_id.encode()
            + b'","output_index":' + str(index).encode() + delta_fields + b',"delta":'
        )  # fmt: skip


class ResponsesTranslator(AnswerTranslator):
    def __init__(self, call: DialectCall):
        super().__init__(call)
        self.id = "resp_" + secrets.token_hex(16)
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: dict[int, dict[str, Any]] = {}  # the finished items by output index
        self.open: _Item | None = None  # the reasoning or message item receiving deltas
        self.calls: dict[int, _Item] = {}  # open function/custom tool call items by chat index
        self.count = 0  # output items started
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.ended = False
        self.custom: frozenset[str] = call.state.get("custom", frozenset())

    # -- framing

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        payload["type"] = kind
        payload["sequence_number"] = self.sequence
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode(payload) + b"\n\n"

    def _delta(self, item: _Item, delta: str) -> bytes:
        item.pieces.append(delta)
        sequence = self.sequence
        self.sequence += 1
        return item.delta_head + encode(delta) + b',"sequence_number":' + str(sequence).encode() + b"}\n\n"

    def _response(
        self, status: str, output: list[dict[str, Any]], error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        echo = self.call.state.get("echo", {})
        response: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.call.model,
            "output": output,
            "error": error,
            "incomplete_details": None,
            "instructions": None,
            "tools": [],
            "tool_choice": echo.get("tool_choice", "auto"),
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "temperature": echo.get("temperature"),
            "top_p": echo.get("top_p"),
            "max_output_tokens": echo.get("max_output_tokens"),
            "usage": None,
        }
        if status == "incomplete":
            response["incomplete_details"] = {"reason": INCOMPLETE.get(self.finish or "", "max_output_tokens")}
        if status in ("completed", "incomplete", "failed"):
            response["completed_at"] = int(time.time()) if status != "failed" else None
            response["usage"] = _usage(self.usage)
        return response

    def _finished(self) -> list[dict[str, Any]]:
        return [self.output[index] for index in sorted(self.output)]

    def _status(self) -> str:
        return "incomplete" if self.finish in INCOMPLETE else "completed"

    # -- output items

    def _start(self, kind: str) -> bytes:
        index = self.count
        self.count += 1
        out = []
        if kind == "message":
            item = _Item(
                kind,
                index,
                f"msg_{self.id[5:]}_{index}",
                b"response.output_text.delta",
                b',"content_index":0,"logprobs":[]',
            )
            added = {"id": item.id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = _Item(
                kind, index, f"rs_{self.id[5:]}_{index}", b"response.reasoning_text.delta", b',"content_index":0'
            )
            added = {"id": item.id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        out.append(self._event("response.output_item.added", {"output_index": index, "item": added}))
        out.append(
            self._event(
                "response.content_part.added",
                {"item_id": item.id, "output_index": index, "content_index": 0, "part": part},
            )
        )
        self.open = item
        return b"".join(out)

    def _close_open(self, status: str = "completed") -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        text = "".join(item.pieces)
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "message":
            part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done: dict[str, Any] = {
                "id": item.id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [part],
            }
            out = self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
        else:
            part = {"type": "reasoning_text", "text": text}
            done = {"id": item.id, "type": "reasoning", "status": status, "summary": [], "content": [part]}
            out = self._event("response.reasoning_text.done", {**where, "text": text})
        out += self._event("response.content_part.done", {**where, "part": part})
        out += self._event("response.output_item.done", {"output_index": item.index, "item": done})
        self.output[item.index] = done
        return out

    def _start_call(self, delta: ToolCallDelta, position: int) -> bytes:
        index = self.count
        self.count += 1
        function = delta.function
        name = (function.name if function else None) or ""
        call_id = delta.id or f"call_{self.id[5:]}_{position}"
        custom = name in self.custom
        item_id = ("ctc_" if custom else "fc_") + call_id
        delta_type = b"response.custom_tool_call_input.delta" if custom else b"response.function_call_arguments.delta"
        item = _Item("call", index, item_id, delta_type, b"")
        item.name, item.call_id, item.custom = name, call_id, custom
        self.calls[position] = item
        if custom:
            added: dict[str, Any] = {
                "id": item_id,
                "type": "custom_tool_call",
                "call_id": call_id,
                "name": name,
                "input": "",
            }
        else:
            added = {
                "id": item_id,
                "type": "function_call",
                "status": "in_progress",
                "call_id": call_id,
                "name": name,
                "arguments": "",
            }
        return self._event("response.output_item.added", {"output_index": index, "item": added})

    def _close_call(self, item: _Item, status: str = "completed") -> bytes:
        arguments = "".join(item.pieces)
        where = {"item_id": item.id, "output_index": item.index}
        if item.custom:
            given = _custom_input(arguments)
            done: dict[str, Any] = {
                "id": item.id,
                "type": "custom_tool_call",
                "call_id": item.call_id,
                "name": item.name,
                "input": given,
            }
            out = self._event(
                "response.custom_tool_call_input.delta", {**where, "delta": given}
            )  # held back: the JSON had to end
            out += self._event("response.custom_tool_call_input.done", {**where, "input": given})
        else:
            done = {
                "id": item.id,
                "type": "function_call",
                "status": status,
                "call_id": item.call_id,
                "name": item.name,
                "arguments": arguments,
            }
            out = self._event(
                "response.function_call_arguments.done", {**where, "name": item.name, "arguments": arguments}
            )
        out += self._event("response.output_item.done", {"output_index": item.index, "item": done})
        self.output[item.index] = done
        return out

    def _close_all(self, status: str) -> bytes:
        out = self._close_open(status)
        for item in self.calls.values():
            out += self._close_call(item, status)
        self.calls = {}
        return out

    # -- the stream

    def events(self, chunks: list[ChatChunk]) -> bytes:
        out: list[bytes] = []
        if self.sequence == 0:
            out.append(self._event("response.created", {"response": self._response("in_progress", [])}))
            out.append(self._event("response.in_progress", {"response": self._response("in_progress", [])}))
        if self.ended:
            return b"".join(out)
        for chunk in chunks:
            if chunk.error is not None:
                out.append(self._fail(chunk.error))
                break
            if chunk.usage:
                self.usage = chunk.usage
            for choice in chunk.choices or ():
                if choice.index:
                    continue  # n is 1 (the gateway's policy): no other choice exists
                delta = choice.delta
                if delta is not None:
                    reasoning = delta.reasoning_content or delta.reasoning
                    if reasoning:
                        open_item = self.open
                        if open_item is None or open_item.kind != "reasoning":
                            out.append(self._close_open())
                            out.append(self._start("reasoning"))
                            open_item = self.open
                        assert open_item is not None
                        out.append(self._delta(open_item, reasoning))
                    if delta.content:
                        open_item = self.open
                        if open_item is None or open_item.kind != "message":
                            out.append(self._close_open())
                            out.append(self._start("message"))
                            open_item = self.open
                        assert open_item is not None
                        out.append(self._delta(open_item, delta.content))
                    if delta.tool_calls:
                        out.append(self._close_open())
                        for position, call in enumerate(delta.tool_calls):
                            index = call.index if call.index is not None else position
                            item = self.calls.get(index)
                            if item is None:
                                for other in list(self.calls):  # the previous call is complete
                                    out.append(self._close_call(self.calls.pop(other)))
                                out.append(self._start_call(call, index))
                                item = self.calls[index]
                            function = call.function
                            if function is not None:
                                if function.name and not item.name:
                                    item.name = function.name
                                if function.arguments:
                                    if item.custom:
                                        item.pieces.append(function.arguments)
                                    else:
                                        out.append(self._delta(item, function.arguments))
                if choice.finish_reason:
                    self.finish = choice.finish_reason
        return b"".join(out)

    def close(self) -> bytes:
        if self.ended:
            return b""
        if self.finish is None:  # the chat stream ended without a finish reason: cut off
            return self._fail({"message": "pi-env gateway: the model's answer was cut off before its end"})
        self.ended = True
        status = self._status()
        out = self._close_all("incomplete" if status == "incomplete" else "completed")
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": self._response(status, self._finished())})

    def _fail(self, error: Any) -> bytes:
        self.ended = True
        if isinstance(error, dict):
            message = str(error.get("message") or error)
        else:
            message = str(error)
        out = self._close_all("incomplete")
        out += self._event("error", {"code": "server_error", "message": message, "param": None})
        failed = self._response("failed", self._finished(), {"code": "server_error", "message": message})
        return out + self._event("response.failed", {"response": failed})

    # -- a whole answer

    def whole(self, answer: ChatChunk) -> bytes:
        choice = next((c for c in answer.choices or () if c.index == 0), None)
        message = choice.message if choice is not None else None
        self.finish = (choice.finish_reason if choice is not None else None) or "stop"
        if answer.usage:
            self.usage = answer.usage
        status = self._status()
        item_status = "incomplete" if status == "incomplete" else "completed"
        output: list[dict[str, Any]] = []
        if message is not None:
            reasoning = message.reasoning_content or message.reasoning
            if reasoning:
                output.append({"id": f"rs_{self.id[5:]}_{len(output)}", "type": "reasoning", "status": item_status,
                               "summary": [], "content": [{"type": "reasoning_text", "text": reasoning}]})  # fmt: skip
            if message.content:
                part = {"type": "output_text", "text": message.content, "annotations": [], "logprobs": []}
                output.append({"id": f"msg_{self.id[5:]}_{len(output)}", "type": "message", "status": item_status,
                               "role": "assistant", "content": [part]})  # fmt: skip
            for position, call in enumerate(message.tool_calls or ()):
                function = call.function
                name = (function.name if function else None) or ""
                arguments = (function.arguments if function else None) or ""
                call_id = call.id or f"call_{self.id[5:]}_{position}"
                if name in self.custom:
                    output.append({"id": "ctc_" + call_id, "type": "custom_tool_call", "call_id": call_id,
                                   "name": name, "input": _custom_input(arguments)})  # fmt: skip
                else:
                    output.append({"id": "fc_" + call_id, "type": "function_call", "status": item_status,
                                   "call_id": call_id, "name": name, "arguments": arguments})  # fmt: skip
        return encode(self._response(status, output))
