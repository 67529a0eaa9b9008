"""`chatml-hermes`: a `renderers` renderer for the engine tier's template,
`scripts/engines/chatml_tools.jinja` (SmolLM2's ChatML plus Hermes-style tools).

The package has no renderer for SmolLM2 (auto-resolution would fall back to its
`DefaultRenderer`, whose bridge always returns None), so this one plugs in through the
package's custom-renderer mechanism (`CustomRendererConfig(import_path=...)`).

How it stays exact:
  - a full render builds the very string the template builds and tokenises it in one pass,
    as `apply_chat_template` does, so the ids are the template's token for token;
  - the bridge keeps the previous prompt + completion ids as they are (trimmed at the last
    sampled `<|im_end|>`, which it synthesises when the turn was cut short) and tokenises only
    what follows; `<|im_end|>` is a special token, so nothing before it can merge with it;
  - SmolLM2 has no special ids for `<tool_call>`, so completions are parsed from their text:
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks are calls, every
    other character stays content, and a block that is not a valid call is reported with its
    status and raw text, never repaired.

Linear on any output, never raising: blocks are found with `str.find` (pi_env.proxy.tool_json),
a block over the size or nesting limit is reported as malformed, and `stream_parser()` finds
complete calls in a streamed answer chunk by chunk without re-reading what came before.
"""

from __future__ import annotations

import bisect
import json
from typing import Any, Literal

from renderers.base import (
    Message,
    ParsedResponse,
    ParsedToolCall,
    RenderedTokens,
    ToolCallParseStatus,
    ToolSpec,
    extract_message_tool_names,
    reject_assistant_in_extension,
    trim_to_turn_close,
)
from renderers.configs import BaseRendererConfig

from pi_env.proxy.tool_json import CALL_CLOSE, CALL_OPEN, MAX_TOOL_CALL_CHARS, hermes_blocks, load_call_json

# sha256 of the template this renderer mirrors (scripts/engines/chatml_tools.jinja). A tokenizer
# whose chat_template has this hash resolves to this renderer under `auto`; a test checks the
# file still has it, so an edited template cannot silently drift from this code.
TEMPLATE_SHA256 = "98a2464688c20b2329538a776a37275033efe058705c627948657b5104549fb4"

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class ChatMLHermesConfig(BaseRendererConfig):
    """The `chatml-hermes` renderer's config (no template knobs)."""

    name: Literal["chatml-hermes"] = "chatml-hermes"


def tojson(value: Any) -> str:
    """transformers' chat-template `tojson` filter (json.dumps, ensure_ascii off, keys unsorted)."""
    return json.dumps(value, ensure_ascii=False)


def content_text(content: Any) -> str:
    """A message's content as the template sees it: a string; text parts joined with newlines
    (what vLLM hands a string-content template); None as empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"] if isinstance(part, dict) else str(part)
            for part in content
            if isinstance(part, str) or (isinstance(part, dict) and isinstance(part.get("text"), str))
        )
    return ""


def tool_call_text(call: dict[str, Any]) -> str:
    function = call.get("function")
    function = function if isinstance(function, dict) else call
    arguments = function.get("arguments", {})
    arguments = arguments if isinstance(arguments, str) else tojson(arguments)
    return (
        '\n<tool_call>\n{"name": "' + str(function.get("name", "")) + '", "arguments": ' + arguments + "}\n</tool_call>"
    )


class _Text:
    """The rendered string, with each span's owner (message index, -1 for scaffolding) and
    whether the model samples it (assistant bodies and their <|im_end|>)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.spans: list[tuple[int, int, int, bool]] = []  # start, end, message index, sampled
        self.length = 0

    def add(self, text: str, owner: int = -1, sampled: bool = False) -> None:
        if text:
            self.parts.append(text)
            self.spans.append((self.length, self.length + len(text), owner, sampled))
            self.length += len(text)

    def text(self) -> str:
        return "".join(self.parts)


class ChatMLHermesRenderer:
    """Renders, parses and bridges `chatml_tools.jinja` conversations (see module docstring)."""

    config_class = ChatMLHermesConfig

    def __init__(self, tokenizer, config: ChatMLHermesConfig | None = None):
        self._tokenizer = tokenizer
        self.config = config or ChatMLHermesConfig()
        self._im_start = self._special_id(IM_START)
        self._im_end = self._special_id(IM_END)
        eos = getattr(tokenizer, "eos_token_id", None)
        self._stop_ids = [self._im_end] + ([eos] if isinstance(eos, int) and eos != self._im_end else [])

    def _special_id(self, token: str) -> int:
        token_id = self._tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == getattr(self._tokenizer, "unk_token_id", None):
            raise ValueError(
                f"chatml-hermes needs {token!r} in the tokenizer's vocabulary "
                f"({getattr(self._tokenizer, 'name_or_path', '?')} has no such token)"
            )
        return token_id

    @property
    def is_prefix_stable(self) -> bool:
        # Appending messages never changes what the template rendered before them.
        return True

    # -- rendering

    def render(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, add_generation_prompt: bool = False
    ) -> RenderedTokens:
        out = _Text()
        if messages and messages[0].get("role") == "system":
            system_text, rest, offset = content_text(messages[0].get("content")), messages[1:], 1
            system_owner = 0
        else:
            system_text, rest, offset, system_owner = DEFAULT_SYSTEM, messages, 0, -1
        out.add(IM_START + "system\n", system_owner)
        out.add(system_text, system_owner)
        if tools:
            out.add(TOOLS_HEADER + "".join(self._tool_text(tool) for tool in tools) + TOOLS_FOOTER, system_owner)
        out.add(IM_END + "\n", system_owner)
        self._render_messages(out, rest, offset, previous_role=None)
        if add_generation_prompt:
            out.add(IM_START + "assistant\n")
        return self._encode(out, messages)

    @staticmethod
    def _tool_text(tool: dict[str, Any]) -> str:
        function = tool.get("function")
        function = function if isinstance(function, dict) else tool
        text = '\n{"type": "function", "function": {"name": ' + tojson(function.get("name"))
        if function.get("description"):
            text += ', "description": ' + tojson(function["description"])
        if function.get("parameters"):
            text += ', "parameters": ' + tojson(function["parameters"])
        return text + "}}"

    def _render_messages(self, out: _Text, messages: list[Message], offset: int, previous_role: str | None) -> None:
        for i, message in enumerate(messages):
            owner, role = offset + i, message.get("role")
            following = messages[i + 1].get("role") if i + 1 < len(messages) else None
            if role == "assistant":
                out.add(IM_START + "assistant", owner)
                body = content_text(message.get("content"))
                body = ("\n" + body if body else "") + "".join(
                    tool_call_text(call) for call in message.get("tool_calls") or []
                )
                if body:
                    out.add("\n", owner)  # the generation prompt's newline: not sampled
                    out.add(body[1:], owner, sampled=True)
                out.add(IM_END, owner, sampled=True)
                out.add("\n", owner)
            elif role == "tool":
                if previous_role != "tool":
                    out.add(IM_START + "user", owner)
                out.add("\n<tool_response>\n" + content_text(message.get("content")) + "\n</tool_response>", owner)
                if following != "tool":
                    out.add(IM_END + "\n", owner)
            else:
                out.add(IM_START + str(role) + "\n" + content_text(message.get("content")) + IM_END + "\n", owner)
            previous_role = role

    def _encode(self, out: _Text, messages: list[Message], base: list[int] | None = None) -> RenderedTokens:
        """Tokenise the whole string in one pass (as apply_chat_template does) and attribute each
        token by its first character; without character offsets only the ids are given."""
        ids, offsets = self._tokenize(out.text())
        base = base or []
        rendered = RenderedTokens(
            token_ids=base + ids,
            message_roles=[m.get("role") or "" for m in messages],
            message_tool_names=extract_message_tool_names(messages),
        )
        if offsets is not None:
            starts = [span[0] for span in out.spans]
            owners, sampled = [], []
            for start, _ in offsets:
                _, _, owner, is_sampled = out.spans[max(0, bisect.bisect_right(starts, start) - 1)]
                owners.append(owner)
                sampled.append(is_sampled)
            rendered.message_indices = [-1] * len(base) + owners
            rendered.sampled_mask = [False] * len(base) + sampled
        return rendered

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """Ids and character offsets; straight from the Rust tokenizer of a fast tokenizer (the
        same ids as the tokenizer's own call, without its per-call Python wrapping)."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None:
            encoding = backend.encode(text, add_special_tokens=False)
            return list(encoding.ids), list(encoding.offsets)
        try:
            encoding = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(encoding["input_ids"]), list(encoding["offset_mapping"])
        except (TypeError, KeyError, NotImplementedError, ValueError):
            return self._tokenizer.encode(text, add_special_tokens=False), None

    def render_ids(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, add_generation_prompt: bool = False
    ) -> list[int]:
        return self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt).token_ids

    def get_stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    # -- parsing

    def parse_response(
        self, token_ids: list[int], *, tools: list[ToolSpec] | None = None, prompt_ids: list[int] | None = None
    ) -> ParsedResponse:
        ids = list(token_ids)
        while ids and ids[-1] in self._stop_ids:
            ids.pop()
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        return parse_hermes_text(text)

    def stream_parser(self) -> HermesCallStream | None:
        """Finds the complete tool calls of an answer as its text streams in (HermesCallStream);
        None for a subclass with a parse_response of its own, which this finder would not mirror."""
        if type(self).parse_response is not ChatMLHermesRenderer.parse_response:
            return None
        return HermesCallStream()

    # -- bridging

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[ToolSpec] | None = None,
    ) -> RenderedTokens | None:
        if not previous_prompt_ids or not new_messages or reject_assistant_in_extension(new_messages):
            return None
        previous = trim_to_turn_close(
            previous_prompt_ids, previous_completion_ids, {self._im_end}, synthesize_close=self._im_end
        )
        if previous is None:
            return None
        out = _Text()
        out.add("\n")  # the template's newline after the assistant's <|im_end|> (never sampled)
        self._render_messages(out, new_messages, 0, previous_role="assistant")
        out.add(IM_START + "assistant\n")
        rendered = self._encode(out, new_messages, base=previous)
        rendered.sampled_mask = [False] * len(rendered.token_ids) if rendered.sampled_mask else []
        return rendered


def parse_hermes_text(text: str) -> ParsedResponse:
    """A completion's text as content + tool calls. Content is every character outside the
    `<tool_call>` blocks, minus the one newline the template puts before each block; a block
    that is not `{"name": str, "arguments": object}` JSON (or is over the limits of
    pi_env.proxy.tool_json), or is cut off, is a tool call with a non-OK status and its raw text.
    Linear in the text."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    position = 0
    for start, end in hermes_blocks(text):
        kept.append(_before_block(text[position:start]))
        if end < 0:  # cut off (max_tokens) inside a call
            calls.append(ParsedToolCall(raw=text[start:], status=ToolCallParseStatus.UNCLOSED_BLOCK))
            position = len(text)
            break
        calls.append(_parse_block(text[start:end]))
        position = end
    kept.append(text[position:])
    return ParsedResponse(content="".join(kept), reasoning_content=None, tool_calls=calls, reasoning_complete=True)


def _before_block(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text


def _parse_block(raw: str) -> ParsedToolCall:
    inner = raw[len(CALL_OPEN) : -len(CALL_CLOSE)]
    body = inner[1:] if inner.startswith("\n") else inner
    body = body[:-1] if body.endswith("\n") else body
    call, refused = load_call_json(body)
    if refused == "not JSON":
        return ParsedToolCall(raw=raw, status=ToolCallParseStatus.INVALID_JSON)
    if refused is not None:  # over the size or nesting limit: the text stays text
        return ParsedToolCall(raw=raw, status=ToolCallParseStatus.MALFORMED_STRUCTURE)
    if not isinstance(call, dict):
        return ParsedToolCall(raw=raw, status=ToolCallParseStatus.MALFORMED_STRUCTURE)
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ParsedToolCall(raw=raw, arguments=arguments, status=ToolCallParseStatus.MISSING_NAME)
    if not isinstance(arguments, dict):
        return ParsedToolCall(raw=raw, name=name, arguments=arguments, status=ToolCallParseStatus.MALFORMED_STRUCTURE)
    return ParsedToolCall(raw=raw, name=name, arguments=arguments)


class HermesCallStream:
    """The leading run of valid tool calls of an answer whose text arrives in pieces: `feed`
    returns the calls each piece completes. Blocks pair up exactly as in parse_hermes_text, so
    these are the first calls of the final parse. Linear in the text: each piece is searched
    once (with the few characters before it where a tag may have started), and only the block
    being written is kept. After a block that is not a valid call (or one past the size limit)
    no later call is returned: the answer's end decides."""

    _BLOCK_LIMIT = MAX_TOOL_CALL_CHARS + len(CALL_OPEN) + len(CALL_CLOSE) + 2

    def __init__(self) -> None:
        self._carry = ""  # the last characters seen, where the next tag may have begun
        self._block: list[str] | None = None  # the open block's text so far
        self._block_chars = 0
        self.done = False

    def feed(self, text: str) -> list[ParsedToolCall]:
        if self.done or not text:
            return []
        window = self._carry + text
        calls: list[ParsedToolCall] = []
        position = 0
        # In a block already: the carry is its end (a close may straddle it), its new text follows.
        block_start, block_from, search_from = 0, len(self._carry), 0
        while True:
            if self._block is None:
                start = window.find(CALL_OPEN, position)
                if start < 0:
                    self._carry = window[max(position, len(window) - len(CALL_OPEN) + 1) :]
                    return calls
                self._block, self._block_chars = [], 0
                block_start = block_from = start
                search_from = start + len(CALL_OPEN)
            close = window.find(CALL_CLOSE, search_from)
            if close < 0:
                self._block.append(window[block_from:])
                self._block_chars += len(window) - block_from
                if self._block_chars > self._BLOCK_LIMIT:  # never a call: stop holding it
                    self._block, self.done = None, True
                self._carry = window[max(block_start, len(window) - len(CALL_CLOSE) + 1) :]
                return calls
            position = close + len(CALL_CLOSE)
            self._block.append(window[block_from:position])
            raw, self._block = "".join(self._block), None
            call = _parse_block(raw)
            if call.status != ToolCallParseStatus.OK:
                self.done = True
                return calls
            calls.append(call)
