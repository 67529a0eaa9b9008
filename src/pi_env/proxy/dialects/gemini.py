"""Gemini's generateContent (`POST /v1beta/models/{model}:generateContent`, and
`:streamGenerateContent`, SSE with `?alt=sse`, else one JSON array streamed), as Gemini CLI
speaks it: see base.py.

Request -> Chat Completions:
- `systemInstruction` (text parts, joined with "\\n") -> one system message; `contents` -> chat
  messages, one `model` content = one chat assistant message: its text parts joined (with "")
  as `content`, its `thought: true` text parts as `reasoning_content`, its `functionCall` parts
  as `tool_calls` (id: the call's own, else `call_<content>_<position>`, so a history sent
  again translates to the same chat messages: token-in bridges only an unchanged history;
  arguments: the args' compact JSON, key order kept). A `user` content's `functionResponse`
  parts become `role: tool` messages (content: the response's compact JSON; tool_call_id: the
  call with the response's id, else the first unanswered call of that name in the model
  content before it), placed before the rest of its text (joined with "\\n"); `inlineData` of
  a text type becomes its text.
- `tools[].functionDeclarations` -> function tools (`parametersJsonSchema` as it is, or the
  OpenAPI-subset `parameters` made JSON Schema: "OBJECT" -> "object", `nullable`);
  `toolConfig.functionCallingConfig` (AUTO / ANY / NONE, `allowedFunctionNames`) ->
  tool_choice (ANY with some names: only those tools); `generationConfig`: temperature, topP,
  maxOutputTokens -> max_tokens, stopSequences -> stop, presence/frequencyPenalty, seed,
  responseMimeType application/json (+ responseSchema / responseJsonSchema) -> response_format.
- Accepted and noted (DialectCall.notes), never forwarded: topK, thinkingConfig,
  responseLogprobs / logprobs, mediaResolution, safetySettings, labels, serviceTier, store,
  thoughtSignature on parts, a declaration's response schema or behavior, unknown fields.
- Refused (400 INVALID_ARGUMENT): hosted tools (googleSearch, codeExecution, urlContext,
  retrieval, ...), cachedContent, candidateCount > 1, non-text output modalities, speech or
  image config, binary inlineData / fileData, executable code parts.

Answer: `GenerateContentResponse` objects as google-genai reads them (`candidates[0].content`
of role "model", `finishReason`, `usageMetadata`, `modelVersion` = the model asked for,
`responseId`): streamed, one event per write of the chat stream (its text and thought deltas,
merged), each function call once its arguments are complete (when the next one starts, or in
the last event, which carries the finish reason and the usage); arguments that are not a JSON
object reach the agent as text. A stream cut off ends with a last event all the same
(finishReason OTHER). Errors: `{"error": {"code", "message", "status"}}`.

Hot path: each event is built from bytes templates and msgspec-encoded strings, no dicts.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from typing import Any

import msgspec

from pi_env.proxy.capture import ToolCallDelta
from pi_env.proxy.dialects.base import (
    AnswerTranslator,
    ChatChunk,
    Dialect,
    DialectCall,
    DialectError,
    Route,
    encode,
)
from pi_env.proxy.policy import RESTRICTED_FIELDS

# The model is one path segment of safe characters (no "/", no "%", no ".."): it never reaches
# the upstream anyway (the session's model does), but a target that is not this is refused.
_ROUTE = re.compile(r"/v1beta/models/([A-Za-z0-9._-]{1,200}):(generateContent|streamGenerateContent)(\?alt=sse)?")

# -- request -> Chat Completions

# Top-level fields: what each becomes (anything not named here is noted and dropped).
_NOTED_TOP = ("safetySettings", "labels", "serviceTier", "store", "model")
_HOSTED_TOOLS = (
    "googleSearch",
    "googleSearchRetrieval",
    "codeExecution",
    "urlContext",
    "retrieval",
    "computerUse",
    "fileSearch",
    "googleMaps",
    "enterpriseWebSearch",
    "mcpServers",
)
_NOTED_GENERATION = (
    "topK",
    "thinkingConfig",
    "responseLogprobs",
    "logprobs",
    "mediaResolution",
    "enableEnhancedCivicAnswers",
    "routingConfig",
    "modelSelectionConfig",
    "audioTimestamp",
)
_REFUSED_GENERATION = ("speechConfig", "imageConfig")
_PART_CONTENT = ("text", "functionCall", "functionResponse", "inlineData", "fileData", "executableCode",
                 "codeExecutionResult")  # fmt: skip
_INT_SCHEMA_KEYS = frozenset(("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"))
_MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto", "MODE_UNSPECIFIED": None}


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def _fields(value: Any) -> Any:
    """A protobuf message's JSON object with its field names in lowerCamelCase: Gemini reads
    `mime_type` as `mimeType` (google-genai itself sends some nested fields so); other values as they are."""
    if not isinstance(value, dict) or all("_" not in key for key in value):
        return value
    return {_camel(key) if "_" in key else key: item for key, item in value.items()}


def _refuse(message: str) -> DialectError:
    return DialectError(400, f"pi-env gateway: {message}")


def _note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _schema(schema: Any) -> Any:
    """Gemini's OpenAPI-subset Schema as JSON Schema: types in lower case, `nullable` as a
    "null" type, int64 counts sent as strings as numbers, propertyOrdering dropped."""
    if not isinstance(schema, dict):
        return schema
    schema = _fields(schema)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            if value.upper() != "TYPE_UNSPECIFIED":
                out["type"] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _schema(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = _schema(value)
        elif key == "anyOf" and isinstance(value, list):
            out[key] = [_schema(sub) for sub in value]
        elif key in _INT_SCHEMA_KEYS and isinstance(value, str) and value.isdigit():
            out[key] = int(value)
        elif key not in ("propertyOrdering", "nullable"):
            out[key] = value
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _text_of_inline(data: Any) -> str:
    """An inlineData part of a text type as its text; anything else is refused."""
    data = _fields(data)
    if not isinstance(data, dict):
        raise _refuse("an inlineData part must be an object")
    mime = str(data.get("mimeType") or "")
    if not (mime.startswith("text/") or mime in ("application/json", "application/xml")):
        raise _refuse(
            f"inlineData of type {mime or '(none)'} cannot be sent to this model (text only); send the content as text"
        )
    try:
        return base64.b64decode(str(data.get("data") or ""), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise _refuse(f"an inlineData part of type {mime} is not base64 of UTF-8 text") from None


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, dict):
        raise _refuse(f"{where} must be a Content object ({{role, parts}})")
    parts = content.get("parts")
    if parts is None:
        return []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise _refuse(f"{where}.parts must be a list of Part objects")
    return [_fields(part) for part in parts]


def _check_part(part: dict[str, Any], where: str, notes: list[str]) -> None:
    if "thoughtSignature" in part:
        _note(notes, "thoughtSignature")
    if "fileData" in part:
        raise _refuse(f"{where}: fileData parts (files by URI) cannot be fetched for this model; send text")
    if "executableCode" in part or "codeExecutionResult" in part:
        raise _refuse(f"{where}: code execution parts are not supported (no hosted code execution)")
    if not any(key in part for key in _PART_CONTENT) and any(k not in ("thoughtSignature", "thought") for k in part):
        unknown = sorted(k for k in part if k not in ("thoughtSignature", "thought"))
        raise _refuse(f"{where}: a part with no content this gateway can map ({', '.join(unknown)})")


def _system(instruction: Any, notes: list[str]) -> str | None:
    if instruction is None:
        return None
    if isinstance(instruction, str):
        return instruction
    texts = []
    for index, part in enumerate(_parts(instruction, "systemInstruction")):
        _check_part(part, f"systemInstruction.parts[{index}]", notes)
        if "text" in part:
            texts.append(str(part["text"]))
        elif "inlineData" in part:
            texts.append(_text_of_inline(part["inlineData"]))
        else:
            raise _refuse(f"systemInstruction.parts[{index}] must be text")
    return "\n".join(texts)


def _messages(contents: Any, notes: list[str]) -> list[dict[str, Any]]:
    if not isinstance(contents, list):
        raise _refuse("`contents` must be a list of Content objects")
    messages: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []  # the last model content's calls
    answered: set[int] = set()  # positions in `calls` a response answered
    for position, content in enumerate(contents):
        where = f"contents[{position}]"
        parts = _parts(content, where)
        role = content.get("role") or "user"
        if role == "model":
            texts: list[str] = []
            thoughts: list[str] = []
            tool_calls: list[dict[str, Any]] = []
            for index, part in enumerate(parts):
                _check_part(part, f"{where}.parts[{index}]", notes)
                if "functionResponse" in part or "inlineData" in part:
                    raise _refuse(f"{where}.parts[{index}]: a model content holds text and function calls only")
                if "text" in part:
                    (thoughts if part.get("thought") is True else texts).append(str(part["text"] or ""))
                if "functionCall" in part:
                    call = _fields(part["functionCall"])
                    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                        raise _refuse(f"{where}.parts[{index}].functionCall needs a name")
                    args = call.get("args")
                    if args is None:
                        args = {}
                    if not isinstance(args, dict):
                        raise _refuse(f"{where}.parts[{index}].functionCall.args must be an object")
                    call_id = call.get("id") or f"call_{position}_{len(tool_calls)}"
                    tool_calls.append({
                        "id": str(call_id), "type": "function",
                        "function": {"name": call["name"], "arguments": encode(args).decode()},
                    })  # fmt: skip
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if tool_calls else "")}
            if thoughts:
                message["reasoning_content"] = "".join(thoughts)
            if tool_calls:
                message["tool_calls"] = tool_calls
            messages.append(message)
            calls, answered = tool_calls, set()
        elif role in ("user", "function", "tool"):
            results, texts = [], []
            for index, part in enumerate(parts):
                _check_part(part, f"{where}.parts[{index}]", notes)
                if "functionCall" in part:
                    raise _refuse(f"{where}.parts[{index}]: a functionCall belongs in a model content")
                if part.get("thought") is True:
                    _note(notes, "thought parts in a user content (dropped)")
                    continue
                if "text" in part:
                    texts.append(str(part["text"] or ""))
                if "inlineData" in part:
                    texts.append(_text_of_inline(part["inlineData"]))
                if "functionResponse" in part:
                    results.append(
                        _tool_result(part["functionResponse"], calls, answered, f"{where}.parts[{index}]", notes)
                    )
            messages.extend(results)
            if texts:
                messages.append({"role": "user", "content": "\n".join(texts)})
        else:
            raise _refuse(f"{where}.role must be 'user' or 'model', not {str(role)[:40]!r}")
    return messages


def _tool_result(
    response: Any, calls: list[dict[str, Any]], answered: set[int], where: str, notes: list[str]
) -> dict[str, Any]:
    response = _fields(response)
    if not isinstance(response, dict) or not isinstance(response.get("name"), str):
        raise _refuse(f"{where}.functionResponse needs a name")
    name, given = response["name"], response.get("id")
    match = None
    if given:
        match = next((i for i, c in enumerate(calls) if c["id"] == given and i not in answered), None)
    if match is None:
        match = next((i for i, c in enumerate(calls) if c["function"]["name"] == name and i not in answered), None)
    if match is None:
        raise _refuse(
            f"{where}: the functionResponse for {name!r} answers no functionCall of the model content before it"
        )
    answered.add(match)
    if response.get("parts"):
        raise _refuse(f"{where}.functionResponse.parts (media in a function result) cannot be sent to this model")
    for key in ("willContinue", "scheduling"):
        if key in response:
            _note(notes, f"functionResponse.{key}")
    result = response.get("response")
    return {
        "role": "tool",
        "tool_call_id": calls[match]["id"],
        "content": encode(result if result is not None else {}).decode(),
    }


def _tools(tools: Any, notes: list[str]) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _refuse("`tools` must be a list of Tool objects")
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        tool = _fields(tool)
        if not isinstance(tool, dict):
            raise _refuse(f"tools[{index}] must be a Tool object")
        hosted = [key for key in tool if key in _HOSTED_TOOLS]
        if hosted:
            raise _refuse(
                f"tools[{index}]: the hosted tool {hosted[0]} is not available with this model; "
                "only functionDeclarations are"
            )
        for key in tool:
            if key != "functionDeclarations":
                _note(notes, f"tools[].{key}")
        declarations = tool.get("functionDeclarations") or []
        if not isinstance(declarations, list):
            raise _refuse(f"tools[{index}].functionDeclarations must be a list")
        for declaration in map(_fields, declarations):
            if not isinstance(declaration, dict) or not isinstance(declaration.get("name"), str):
                raise _refuse(f"tools[{index}].functionDeclarations: each needs a name")
            if "parametersJsonSchema" in declaration:
                parameters = declaration["parametersJsonSchema"]
            elif "parameters" in declaration:
                parameters = _schema(declaration["parameters"])
            else:
                parameters = {"type": "object", "properties": {}}
            for key in ("response", "responseJsonSchema", "behavior"):
                if key in declaration:
                    _note(notes, f"functionDeclarations[].{key}")
            function: dict[str, Any] = {"name": declaration["name"]}
            if declaration.get("description") is not None:
                function["description"] = declaration["description"]
            function["parameters"] = parameters
            out.append({"type": "function", "function": function})
    return out


def _tool_choice(config: Any, tools: list[dict[str, Any]], notes: list[str]) -> tuple[Any, list[dict[str, Any]]]:
    """(tool_choice or None, the tools offered) for a toolConfig."""
    config = _fields(config)
    if not isinstance(config, dict):
        return None, tools
    for key in config:
        if key != "functionCallingConfig":
            _note(notes, f"toolConfig.{key}")
    calling = _fields(config.get("functionCallingConfig"))
    if not isinstance(calling, dict):
        return None, tools
    mode = str(calling.get("mode") or "MODE_UNSPECIFIED").upper()
    if mode not in _MODES:
        raise _refuse(f"toolConfig.functionCallingConfig.mode {mode[:40]!r} is not AUTO, ANY, NONE or VALIDATED")
    if mode == "VALIDATED":
        _note(notes, "toolConfig.functionCallingConfig.mode=VALIDATED (as AUTO)")
    if "streamFunctionCallArguments" in calling:
        _note(notes, "toolConfig.functionCallingConfig.streamFunctionCallArguments")
    choice: Any = _MODES[mode]
    allowed = calling.get("allowedFunctionNames")
    if allowed and mode == "ANY":
        names = set(map(str, allowed))
        tools = [tool for tool in tools if tool["function"]["name"] in names]
        if not tools:
            raise _refuse("toolConfig.functionCallingConfig.allowedFunctionNames names no declared function")
        if len(tools) == 1:
            choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    elif allowed:
        _note(notes, "toolConfig.functionCallingConfig.allowedFunctionNames (only with mode ANY)")
    return (choice if tools else None), tools


def _generation(config: Any, chat: dict[str, Any], notes: list[str]) -> None:
    if config is None:
        return
    config = _fields(config)
    if not isinstance(config, dict):
        raise _refuse("`generationConfig` must be an object")
    for key, value in config.items():
        if value is None:
            continue
        if key == "temperature":
            chat["temperature"] = value
        elif key == "topP":
            chat["top_p"] = value
        elif key == "maxOutputTokens":
            chat["max_tokens"] = value
        elif key == "stopSequences":
            if value:
                chat["stop"] = value
        elif key == "presencePenalty":
            chat["presence_penalty"] = value
        elif key == "frequencyPenalty":
            chat["frequency_penalty"] = value
        elif key == "seed":
            if "seed" in RESTRICTED_FIELDS:
                _note(notes, "generationConfig.seed")
            else:
                chat["seed"] = value
        elif key == "candidateCount":
            if value != 1:
                raise _refuse("generationConfig.candidateCount must be 1: this gateway makes one answer per call")
        elif key == "responseModalities":
            if any(str(m).upper() != "TEXT" for m in value or ()):
                raise _refuse("generationConfig.responseModalities: this model answers TEXT only")
        elif key in _REFUSED_GENERATION:
            raise _refuse(f"generationConfig.{key}: this model answers text only")
        elif key in ("responseMimeType", "responseSchema", "responseJsonSchema"):
            continue  # below
        else:
            _note(notes, f"generationConfig.{key}")
    mime = config.get("responseMimeType") or "text/plain"
    schema = config.get("responseJsonSchema")
    if schema is None and config.get("responseSchema") is not None:
        schema = _schema(config["responseSchema"])
    if mime == "application/json":
        if schema is None:
            chat["response_format"] = {"type": "json_object"}
        else:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    elif mime != "text/plain":
        raise _refuse(f"generationConfig.responseMimeType {str(mime)[:60]!r}: text/plain or application/json only")
    elif schema is not None:
        _note(notes, "generationConfig.responseSchema without responseMimeType application/json")


# -- Chat Completions answer -> GenerateContentResponse

_FINISH = {
    "stop": b'"STOP"',
    "tool_calls": b'"STOP"',
    "function_call": b'"STOP"',
    "length": b'"MAX_TOKENS"',
    "content_filter": b'"SAFETY"',
}
_OTHER = b'"OTHER"'
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_OPEN = b'{"candidates":[{"content":{"role":"model","parts":['
_LAST = b'{"candidates":[{'
_TEXT, _THOUGHT = b'{"text":', b',"thought":true}'
_SSE, _SSE_END = b"data: ", b"\n\n"


def _status(status: int) -> str:
    return _STATUS.get(status) or ("INTERNAL" if status >= 500 else "FAILED_PRECONDITION")


def _error(status: int, message: str, kind: str) -> bytes:
    return encode(
        {
            "error": {
                "code": status,
                "message": message,
                "status": _status(status),
                "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": kind, "domain": "pi-env"}],
            }
        }
    )


def _usage(usage: dict[str, Any]) -> bytes:
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    details = usage.get("completion_tokens_details")
    thoughts = (details.get("reasoning_tokens") or 0) if isinstance(details, dict) else 0
    out = {
        "promptTokenCount": prompt,
        "candidatesTokenCount": max(0, completion - thoughts),
        "totalTokenCount": usage.get("total_tokens") or prompt + completion,
    }
    if thoughts:
        out["thoughtsTokenCount"] = thoughts
    cached = usage.get("prompt_tokens_details")
    if isinstance(cached, dict) and cached.get("cached_tokens"):
        out["cachedContentTokenCount"] = cached["cached_tokens"]
    return encode(out)


def _call_part(call_id: str | None, name: str | None, arguments: str) -> bytes:
    """A complete tool call as a functionCall part; as a text part when its arguments are not a
    JSON object (or it has no name): the agent gets what the model wrote, never a guess."""
    raw = arguments.strip() or "{}"
    try:
        valid = isinstance(msgspec.json.decode(raw), dict)
    except msgspec.DecodeError:
        valid = False
    if not valid or not name:
        return _TEXT + encode(arguments) + b"}"
    head = b'{"functionCall":{"id":' + encode(call_id) + b',"name":' if call_id else b'{"functionCall":{"name":'
    return head + encode(name) + b',"args":' + raw.encode() + b"}}"


class GeminiTranslator(AnswerTranslator):
    def __init__(self, call: DialectCall):
        super().__init__(call)
        self.sse = call.framing == "sse"
        self.model = encode(call.model)
        self.tail: bytes | None = None  # the end of every event: modelVersion and responseId
        self.calls: dict[int, list[Any]] = {}  # index -> [id, name, [argument pieces]], not yet sent
        self.finish: bytes | None = None
        self.usage: dict[str, Any] | None = None
        self.sent = 0  # events sent
        self.ended = False  # the last event (or an error) sent
        self.event_end: bytes | None = None  # how every event with parts ends (framing included)
        self.text_head = _SSE + _OPEN + _TEXT
        self.last_call = -1  # the highest tool call index seen

    def _tail(self, response_id: str | None) -> bytes:
        if self.tail is None:
            response_id = response_id or f"pi-env-{secrets.token_hex(8)}"
            self.tail = b'"modelVersion":' + self.model + b',"responseId":' + encode(response_id) + b"}"
        return self.tail

    def _frame(self, event: bytes) -> bytes:
        self.sent += 1
        if self.sse:
            return _SSE + event + _SSE_END
        return (b"[" if self.sent == 1 else b",\r\n") + event

    def _flush_calls(self, parts: list[bytes], before: int | None = None) -> None:
        """Tool calls whose arguments are complete (those before index `before`; None: all) as parts."""
        for index in sorted(self.calls):
            if before is not None and index >= before:
                break
            call_id, name, pieces = self.calls.pop(index)
            parts.append(_call_part(call_id, name, "".join(pieces)))

    def _last(self, parts: list[bytes]) -> bytes:
        self._flush_calls(parts)
        self.ended = True
        content = b'"content":{"role":"model","parts":[' + b",".join(parts) + b"]}," if parts else b""
        usage = b'"usageMetadata":' + _usage(self.usage) + b"," if self.usage else b""
        return self._frame(
            _LAST + content + b'"finishReason":' + (self.finish or _OTHER) + b',"index":0}],' + usage + self._tail(None)
        )

    def events(self, chunks: list[ChatChunk]) -> bytes:
        if self.ended:
            return b""
        if len(chunks) == 1 and self.event_end is not None:  # the common case, a token of text: fast
            chunk = chunks[0]
            choices = chunk.choices
            if choices and len(choices) == 1 and chunk.usage is None and chunk.error is None:
                choice = choices[0]
                delta = choice.delta
                if (
                    delta is not None
                    and delta.content
                    and not (choice.index or choice.finish_reason or delta.tool_calls)
                    and not (delta.reasoning_content or delta.reasoning)
                ):
                    self.sent += 1
                    head = self.text_head if self.sse else b",\r\n" + _OPEN + _TEXT
                    return head + encode(delta.content) + b"}" + self.event_end
        parts: list[bytes] = []
        run, thought = "", False  # the run of text (or thought) deltas being merged into one part
        for chunk in chunks:
            if chunk.error is not None:
                if run:
                    parts.append(_TEXT + encode(run) + (_THOUGHT if thought else b"}"))
                return self._parts_event(parts) + self._stream_error(chunk.error)
            if self.tail is None:
                self._tail(chunk.id)
            if chunk.usage:
                self.usage = chunk.usage
            for choice in chunk.choices or ():
                if choice.index:
                    continue
                delta = choice.delta
                if delta is not None:
                    reasoning = delta.reasoning_content or delta.reasoning
                    if reasoning:
                        if run and not thought:
                            parts.append(_TEXT + encode(run) + b"}")
                            run = ""
                        thought = True
                        run += reasoning
                    content = delta.content
                    if content:
                        if thought:
                            if run:
                                parts.append(_TEXT + encode(run) + _THOUGHT)
                                run = ""
                            thought = False
                        run += content
                    if delta.tool_calls:
                        if run:
                            parts.append(_TEXT + encode(run) + (_THOUGHT if thought else b"}"))
                            run = ""
                        self._tool_calls(delta.tool_calls, parts)
                if choice.finish_reason:
                    self.finish = _FINISH.get(choice.finish_reason, _OTHER)
        if run:
            parts.append(_TEXT + encode(run) + (_THOUGHT if thought else b"}"))
        if self.finish is not None and self.usage is not None:
            return self._last(parts)
        return self._parts_event(parts) if parts else b""

    def _parts_event(self, parts: list[bytes]) -> bytes:
        if not parts:
            return b""
        if self.event_end is None:
            self.event_end = b']},"index":0}],' + self._tail(None) + (_SSE_END if self.sse else b"")
        self.sent += 1
        head = _SSE + _OPEN if self.sse else (b"[" if self.sent == 1 else b",\r\n") + _OPEN
        return head + b",".join(parts) + self.event_end

    def _tool_calls(self, deltas: list[ToolCallDelta], parts: list[bytes]) -> None:
        for tool_call in deltas:
            index = tool_call.index
            if index is None:  # a server that numbers none: a delta with an id starts a call
                index = self.last_call + 1 if tool_call.id is not None or self.last_call < 0 else self.last_call
            pending = self.calls.get(index)
            if pending is None:
                self._flush_calls(parts, before=index)  # a new call: those before it are whole
                pending = self.calls[index] = [tool_call.id, None, []]
                self.last_call = max(self.last_call, index)
            elif tool_call.id and not pending[0]:
                pending[0] = tool_call.id
            function = tool_call.function
            if function is not None:
                if function.name:
                    pending[1] = function.name
                if function.arguments:
                    pending[2].append(function.arguments)

    def _stream_error(self, error: Any) -> bytes:
        self.ended = True
        status = error.get("code") if isinstance(error, dict) else None
        status = status if isinstance(status, int) and 400 <= status < 600 else 500
        message = str(error.get("message") or error) if isinstance(error, dict) else str(error)
        kind = str(error.get("type") or "api_error") if isinstance(error, dict) else "api_error"
        return self._frame(_error(status, message, kind))

    def close(self) -> bytes:
        out = b"" if self.ended else self._last([])
        if not self.sse:
            out += b"]" if self.sent else b"[]"
        return out

    def whole(self, answer: ChatChunk) -> bytes:
        if answer.error is not None:
            message = answer.error.get("message") if isinstance(answer.error, dict) else answer.error
            return _error(502, str(message), "api_error")
        self._tail(answer.id)
        parts: list[bytes] = []
        choice = next((c for c in answer.choices or () if not c.index), None)
        message = choice.message if choice is not None else None
        if message is not None:
            reasoning = message.reasoning_content or message.reasoning
            if reasoning:
                parts.append(_TEXT + encode(reasoning) + _THOUGHT)
            if message.content:
                parts.append(_TEXT + encode(message.content) + b"}")
            for index, tool_call in enumerate(message.tool_calls or ()):
                function = tool_call.function
                self.calls[index] = [
                    tool_call.id,
                    function and function.name,
                    [(function and function.arguments) or ""],
                ]
        if choice is not None and choice.finish_reason:
            self.finish = _FINISH.get(choice.finish_reason, _OTHER)
        self.usage = answer.usage
        self._flush_calls(parts)
        content = b'{"role":"model","parts":[' + b",".join(parts) + b"]}" if parts else b'{"role":"model"}'
        usage = b'"usageMetadata":' + _usage(self.usage) + b"," if self.usage else b""
        return (
            b'{"candidates":[{"content":' + content + b',"finishReason":' + (self.finish or _OTHER)
            + b',"index":0}],' + usage + self._tail(None)
        )  # fmt: skip


class GeminiDialect(Dialect):
    name = "gemini"

    def match(self, method: str, raw_path: str) -> Route | None:
        found = _ROUTE.fullmatch(raw_path) if method == "POST" else None
        if found is None or found[1] in (".", ".."):
            return None
        streamed = found[2] == "streamGenerateContent"
        if not streamed and found[3]:
            return None
        return Route(model=found[1], streamed=streamed, framing="sse" if found[3] or not streamed else "json_array")

    def to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        try:
            return self._to_chat(request, route)
        except RecursionError:
            raise _refuse("the request nests too deep") from None
        except (TypeError, AttributeError, ValueError) as error:  # a field of the wrong JSON type
            raise _refuse(f"the request is malformed ({error})") from None

    def _to_chat(self, request: dict[str, Any], route: Route) -> DialectCall:
        notes: list[str] = []
        request = _fields(request)
        model = route.model or "gemini"
        streamed = bool(route.streamed)
        if request.get("cachedContent"):
            raise _refuse("cachedContent: this gateway keeps no cached contents; send the contents themselves")
        for key in request:
            if key in _NOTED_TOP:
                _note(notes, key)
            elif key not in (
                "contents",
                "systemInstruction",
                "tools",
                "toolConfig",
                "generationConfig",
                "cachedContent",
            ):
                _note(notes, f"{key} (unknown, ignored)")
        messages = _messages(request.get("contents"), notes)
        system = _system(request.get("systemInstruction"), notes)
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        if not messages:
            raise _refuse("`contents` must hold at least one content")
        chat: dict[str, Any] = {"model": model, "messages": messages}
        tools = _tools(request.get("tools"), notes)
        choice, tools = _tool_choice(request.get("toolConfig"), tools, notes)
        if tools:
            chat["tools"] = tools
            if choice is not None:
                chat["tool_choice"] = choice
        _generation(request.get("generationConfig"), chat, notes)
        chat["stream"] = streamed
        if streamed:
            chat["stream_options"] = {"include_usage": True}
        return DialectCall(
            dialect=self.name, chat=chat, streamed=streamed, model=model, framing=route.framing, notes=notes
        )

    def translator(self, call: DialectCall) -> AnswerTranslator:
        return GeminiTranslator(call)

    def error_body(self, status: int, message: str, kind: str) -> bytes:
        return _error(status, message, kind)
