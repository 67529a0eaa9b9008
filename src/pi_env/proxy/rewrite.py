"""Request rewriting for transparent_proxy: what the gateway changes in every chat/completions
request before it goes upstream. Each rule is a `CaptureOptions` knob."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Models that take `max_completion_tokens` and reject `max_tokens`.
_COMPLETION_TOKENS_MODELS = re.compile(r"^(gpt-5|o1|o3|o4)")
# Sampling parameters a trainer may force; the agent's own values for them are overridden.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


@dataclass(frozen=True)
class CaptureOptions:
    logprobs: bool = True
    top_logprobs: int = 5  # 0-20; the HF router caps at 5
    return_token_ids: bool = False  # decided per endpoint (catalog or probe), never guessed
    max_tokens_cap: int | None = 4096
    disable_thinking: bool = False  # chat_template_kwargs.enable_thinking = false
    model: str | None = None  # the exact upstream model id
    sampling: dict[str, Any] = field(default_factory=dict)  # forced: the agent cannot override

    def __post_init__(self):
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be within 0-20, got {self.top_logprobs}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be at least 1 (or None: no cap), got {self.max_tokens_cap}")
        unknown = set(self.sampling) - set(SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"unknown forced sampling parameters {sorted(unknown)}; allowed: {list(SAMPLING_KEYS)}")


def rewrite_request(body: dict[str, Any], options: CaptureOptions) -> dict[str, Any]:
    """A new request body with the capture parameters, caps and forced values applied."""
    body = dict(body)
    if options.model:
        body["model"] = options.model
    if options.logprobs:
        body["logprobs"] = True
        if options.top_logprobs:
            body["top_logprobs"] = options.top_logprobs
        else:
            body.pop("top_logprobs", None)
    if options.return_token_ids:
        body["return_token_ids"] = True
    model = str(body.get("model") or "")
    if _COMPLETION_TOKENS_MODELS.match(model) and "max_tokens" in body:
        body.setdefault("max_completion_tokens", body.pop("max_tokens"))
    if options.max_tokens_cap is not None:
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int):
                body[key] = min(body[key], options.max_tokens_cap)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            key = "max_completion_tokens" if _COMPLETION_TOKENS_MODELS.match(model) else "max_tokens"
            body[key] = options.max_tokens_cap
    if options.disable_thinking:
        body["chat_template_kwargs"] = {**(body.get("chat_template_kwargs") or {}), "enable_thinking": False}
    body.update(options.sampling)
    return body


def without_capture(body: dict[str, Any]) -> dict[str, Any]:
    """The request minus the capture parameters (for an upstream that rejects them)."""
    return {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs", "return_token_ids")}


def rejects_capture(status: int, error_body: str) -> bool:
    """Does an upstream error say it cannot do a capture parameter? (llama.cpp: "logprobs is
    not supported with tools + stream", a 400 (older builds: a 500); Groq
    rejects logprobs; some reject return_token_ids.) A 500 counts only when it says "not
    supported", so an engine that crashed while computing logprobs is not mistaken for one."""
    if not re.search(r"logprob|return_token_ids|token_ids", error_body, re.I):
        return False
    return status in (400, 422) or (status == 500 and bool(re.search(r"not supported|unsupported", error_body, re.I)))
