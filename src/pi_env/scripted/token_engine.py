"""Engine-like token behaviour for the scripted server, over a real tokenizer (test double).

Real models often sample a non-canonical split of their own text (`</tool_call` + `>` where
the tokenizer would write `</tool_call>`), and an engine that re-renders the chat from JSON
re-tokenises it canonically, so the next prompt no longer extends the previous prompt +
completion. `TokenEngine` reproduces exactly that, deterministically:
  - a scripted turn's answer is the text the model would write in the Hermes format of
    `scripts/engines/chatml_tools.jinja` (content, then `<tool_call>` blocks), and its ids are
    that text split into other ids than the tokenizer's (`split="chars"`: one encode per
    character), then the end-of-turn id;
  - on /v1/chat/completions the prompt ids are the chat template applied to the messages (the
    canonical re-render every engine does);
  - on /v1/completions (token-in) the prompt is the ids sent, echoed back as vLLM does.
Everything it emits is synthetic, like the rest of the scripted server.
"""

from __future__ import annotations

import json
from typing import Any, Literal, overload

from pi_env.scripted.script import SYNTHETIC_CREATED, SYNTHETIC_FINGERPRINT, ScriptedTurn, synthetic_logprob

ASSISTANT_MARKER = "<|im_start|>assistant"


class TokenEngine:
    def __init__(
        self,
        tokenizer,
        *,
        split: Literal["chars", "canonical"] = "chars",
        end_token: str = "<|im_end|>",
        assistant_marker: str = ASSISTANT_MARKER,
    ):
        self.tokenizer = tokenizer
        self.split = split
        self.end_id = tokenizer.convert_tokens_to_ids(end_token)
        self.assistant_marker = assistant_marker

    @staticmethod
    def answer_text(turn: ScriptedTurn) -> str:
        """What the model writes for `turn` (Hermes tool calls, as the template renders them)."""
        text = turn.text
        for call in turn.tool_calls:
            arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            text += (
                ("\n" if text else "")
                + '<tool_call>\n{"name": "'
                + call.name
                + '", "arguments": '
                + arguments
                + "}\n</tool_call>"
            )
        return text

    def answer_ids(self, turn: ScriptedTurn) -> list[int]:
        """The answer's ids (non-canonical unless split="canonical"), ending with the end id; a
        turn's own `token_ids` as they are."""
        if turn.token_ids is not None:
            return list(turn.token_ids)
        text = self.answer_text(turn)
        if self.split == "canonical":
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = [i for char in text for i in self.tokenizer.encode(char, add_special_tokens=False)]
        return ids + [self.end_id]

    def chat_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The canonical re-render of the chat, as an engine applying its template makes it (text
        parts joined with newlines first, as vLLM does for a template that reads strings)."""
        messages = [
            {**m, "content": "\n".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))}
            if isinstance(m.get("content"), list)
            else m
            for m in body.get("messages") or []
        ]
        ids = self.tokenizer.apply_chat_template(
            messages, tools=body.get("tools") or None, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def turn_index(self, prompt_ids: list[int]) -> int:
        """Which scripted turn a token prompt asks for: assistant turns already in it."""
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        return max(0, text.count(self.assistant_marker) - 1)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprob_fields(self, ids: list[int], first_position: int, top_n: int | None) -> dict[str, Any] | None:
        """A /v1/completions `logprobs` object for `ids` (the sampled token is the top-1)."""
        if top_n is None:
            return None
        tokens = [self.token_text(i) for i in ids]
        logprobs = [synthetic_logprob(t, first_position + k) for k, t in enumerate(tokens)]
        return {
            "text_offset": [0] * len(ids),
            "token_logprobs": logprobs,
            "tokens": tokens,
            "top_logprobs": [{t: lp} if top_n else {} for t, lp in zip(tokens, logprobs)],
        }

    def chat_logprob_entries(self, ids: list[int], top_n: int) -> list[dict[str, Any]]:
        """Chat-style `logprobs.content` entries for `ids`."""
        entries = []
        for position, token_id in enumerate(ids):
            token = self.token_text(token_id)
            logprob = synthetic_logprob(token, position)
            entries.append(
                {
                    "token": token,
                    "logprob": logprob,
                    "bytes": list(token.encode()),
                    "top_logprobs": [{"token": token, "logprob": logprob}] if top_n else [],
                }
            )
        return entries


@overload
def with_engine_tokens(
    engine: TokenEngine, body: dict[str, Any], turn: ScriptedTurn, answer: dict[str, Any]
) -> dict[str, Any]: ...
@overload
def with_engine_tokens(
    engine: TokenEngine, body: dict[str, Any], turn: ScriptedTurn, answer: list[bytes]
) -> list[bytes]: ...
def with_engine_tokens(
    engine: TokenEngine, body: dict[str, Any], turn: ScriptedTurn, answer: dict[str, Any] | list[bytes]
) -> dict[str, Any] | list[bytes]:
    """A chat answer (a body, or SSE events) given the engine's token fields: the canonical
    prompt ids (on the first chunk), the answer's ids and logprobs (on the finishing chunk),
    and usage counting them."""
    prompt = engine.chat_prompt_ids(body)
    ids = engine.answer_ids(turn)
    fields: dict[str, Any] = {}
    if body.get("return_token_ids") is True:
        fields["token_ids"] = ids
    if body.get("logprobs") is True:
        fields["logprobs"] = {"content": engine.chat_logprob_entries(ids, int(body.get("top_logprobs") or 0))}
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    if isinstance(answer, dict):
        answer["choices"][0].update(fields)
        answer["usage"] = usage
        if "token_ids" in fields:
            answer["prompt_token_ids"] = prompt
        return answer
    events = []
    for position, event in enumerate(answer):
        if not event.startswith(b"data: {"):
            events.append(event)
            continue
        chunk = json.loads(event[6:])
        if position == 0 and "token_ids" in fields:
            chunk["prompt_token_ids"] = prompt
        if chunk.get("usage"):
            chunk["usage"] = usage
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                choice.update(fields)
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return events


def completion_events(engine: TokenEngine, body: dict[str, Any], turn: ScriptedTurn) -> list[bytes] | dict[str, Any]:
    """vLLM's token-in answer to `body` (a /v1/completions request with a token-id prompt):
    SSE events, one token per chunk, prompt ids echoed on the first, the finish reason on the
    last token (or a body when not streamed). `max_tokens` cuts the answer ("length")."""
    prompt = list(body["prompt"])
    ids = engine.answer_ids(turn)
    finish = "stop"
    limit = body.get("max_tokens")
    if isinstance(limit, int) and len(ids) > limit:
        ids, finish = ids[:limit], "length"
    top_n = body.get("logprobs") if isinstance(body.get("logprobs"), int) else None
    envelope = {
        "id": "cmpl-synthetic",
        "object": "text_completion",
        "created": SYNTHETIC_CREATED,
        "model": str(body.get("model") or "scripted"),
        "system_fingerprint": SYNTHETIC_FINGERPRINT,
    }
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    if not body.get("stream"):
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": engine.logprob_fields(ids, 0, top_n),
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": prompt,
            "token_ids": ids,
        }
        return {**envelope, "choices": [choice], "usage": usage}
    events = []
    for position, token_id in enumerate(ids):
        last = position == len(ids) - 1
        text = "" if token_id == engine.end_id else engine.token_text(token_id)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": engine.logprob_fields([token_id], position, top_n),
            "finish_reason": finish if last else None,
            "stop_reason": None,
            "prompt_token_ids": prompt if position == 0 else None,
            "token_ids": [token_id],
        }
        events.append(b"data: " + json.dumps({**envelope, "choices": [choice]}).encode() + b"\n\n")
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(b"data: " + json.dumps({**envelope, "choices": [], "usage": usage}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events
