"""Tool calls in model output, read in linear time and within limits: token-in's `chatml-hermes`
parser (pi_env.proxy.chatml_hermes) and interception_gate's text parser (pi_env.proxy.gate)
share these, so a hostile answer (a `<tool_call>` loop, JSON nested a thousand deep, megabytes
of arguments) is plain text for the agent, never an exception or a stalled event loop.

Limits (docs/token-in.md, docs/gate.md): a `<tool_call>` block whose JSON is larger than
MAX_TOOL_CALL_CHARS characters, or nests objects/arrays deeper than MAX_TOOL_CALL_DEPTH levels
(the `{"name": ..., "arguments": ...}` object itself is level 1), is not a tool call: it stays
the assistant's text. Both are far above any real call (tool schemas nest a handful of levels;
an answer capped at the gateway's default 4,096 tokens is ~16k characters), and the depth limit
is far below Python's recursion limit (1,000), where json.loads, json.dumps and msgspec fail.

Standard library only: the gate imports this without the token-in extra.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import Any

MAX_TOOL_CALL_DEPTH = 64
MAX_TOOL_CALL_CHARS = 1 << 20  # 1,048,576

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# A JSON string, or an unterminated one up to the end: always matches from a `"` without
# backtracking, so stripping every string is one linear pass whatever the text.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_too_deep(text: str, limit: int = MAX_TOOL_CALL_DEPTH) -> bool:
    """Does the JSON text nest objects/arrays deeper than `limit` (brackets inside strings do
    not count)? Linear; exact for valid JSON, and for invalid JSON exact up to where a parser
    would stop, so `json.loads` never recurses deeper than `limit` when this says False."""
    if text.count("[") + text.count("{") <= limit:  # the common case: no scan at all
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def nests_deeper(value: Any, limit: int = MAX_TOOL_CALL_DEPTH) -> bool:
    """Does a Python value nest dicts/lists/tuples deeper than `limit`? Iterative (a value
    nested 100,000 deep, or one that contains itself, is answered, not a RecursionError)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def load_call_json(body: str) -> tuple[Any, str | None]:
    """(the value, None), or (None, why it is not read): the body is larger or nests deeper than
    the limits, or is not JSON. Never raises."""
    if len(body) > MAX_TOOL_CALL_CHARS:
        return None, f"larger than {MAX_TOOL_CALL_CHARS:,} characters"
    if json_too_deep(body):
        return None, f"nested deeper than {MAX_TOOL_CALL_DEPTH} levels"
    try:
        return json.loads(body), None
    except (ValueError, RecursionError):
        return None, "not JSON"


def hermes_blocks(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each `<tool_call>...</tool_call>` block, in order (the first close after
    each open, as a lazy regex would pair them), then (start, -1) for a block left open at the
    end. Linear: each character is looked at once, however many opens go unclosed (the regex
    `<tool_call>(.*?)</tool_call>` rescans the rest of the text from every one of them)."""
    position = 0
    while True:
        start = text.find(CALL_OPEN, position)
        if start < 0:
            return
        close = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if close < 0:
            yield start, -1
            return
        position = close + len(CALL_CLOSE)
        yield start, position
