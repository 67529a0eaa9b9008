"""Request rewriting for transparent_proxy: what the gateway changes in every chat/completions
request before it goes upstream. Each rule is a `CaptureOptions` knob."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Models that take `max_completion_tokens` and reject `max_tokens`.
_COMPLETION_TOKENS_MODELS = re.compile(r"^(gpt-5|o1|o3|o4)")
# Sampling parameters a trainer may force; the agent's own values for them are overridden.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INTEGER_SAMPLING = ("top_k", "seed")
# What an OpenAI-compatible engine accepts (vLLM's SamplingParams; top_k -1 or 0: no limit).
_SAMPLING_RANGES = {
    "temperature": (0, None, "at least 0"),
    "top_p": (0, 1, "in (0, 1]"),
    "min_p": (0, 1, "in [0, 1]"),
    "top_k": (-1, None, "-1, 0 (no limit) or more"),
    "repetition_penalty": (0, None, "above 0"),
    "presence_penalty": (-2, 2, "in [-2, 2]"),
    "frequency_penalty": (-2, 2, "in [-2, 2]"),
}


def check_sampling(sampling: dict[str, Any], where: str = "proxy_sampling") -> dict[str, float | int]:
    """Forced sampling parameters, checked: known names, numbers (integers for top_k and seed)
    within what engines accept. A ValueError names the field and what to fix."""
    checked: dict[str, float | int] = {}
    for name, value in sampling.items():
        if name not in SAMPLING_KEYS:
            raise ValueError(f"{where}: unknown sampling parameter {name!r}; allowed: {', '.join(SAMPLING_KEYS)}")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (name in _INTEGER_SAMPLING and not float(value).is_integer())
        ):
            kind = "an integer" if name in _INTEGER_SAMPLING else "a number"
            raise ValueError(f"{where}: {name} must be {kind}, not {value!r}")
        low, high, what = _SAMPLING_RANGES.get(name, (None, None, ""))
        if (
            value != value
            or (low is not None and value < low)
            or (high is not None and value > high)
            or (name == "top_p" and value == 0)
            or (name == "repetition_penalty" and value == 0)
        ):
            raise ValueError(f"{where}: {name} must be {what}, not {value!r}")
        checked[name] = int(value) if name in _INTEGER_SAMPLING else value
    return checked


def parse_sampling(text: str, where: str = "--sampling") -> dict[str, float | int]:
    """`temperature=0,top_p=1,seed=7` -> {"temperature": 0.0, "top_p": 1.0, "seed": 7}, checked."""
    sampling: dict[str, Any] = {}  # may hold a bad value for check_sampling to name
    for item in (part.strip() for part in text.split(",")):
        name, equals, value = (piece.strip() for piece in item.partition("="))
        if not equals or not name or not value:
            raise ValueError(f"{where}: {item!r} is not NAME=VALUE (e.g. temperature=0,top_p=1,seed=7)")
        if name in sampling:
            raise ValueError(f"{where}: {name} is given twice")
        try:
            sampling[name] = int(value) if name in _INTEGER_SAMPLING else float(value)
        except ValueError:
            kind = "an integer" if name in _INTEGER_SAMPLING else "a number"
            sampling[name] = value  # check_sampling names the parameter (or says it is unknown)
            if name in SAMPLING_KEYS:
                raise ValueError(f"{where}: {name} must be {kind}, not {value!r}") from None
    return check_sampling(sampling, where)


@dataclass(frozen=True)
class CaptureOptions:
    logprobs: bool = True
    top_logprobs: int = 5  # 0-20; the HF router caps at 5
    return_token_ids: bool = False  # decided per endpoint (catalog or probe), never guessed
    disable_thinking: bool = False  # chat_template_kwargs.enable_thinking = false
    model: str | None = None  # the exact upstream model id
    sampling: dict[str, Any] = field(default_factory=dict)  # forced: the agent cannot override

    def __post_init__(self):
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be within 0-20, got {self.top_logprobs}")
        check_sampling(self.sampling, "sampling")


def rewrite_request(body: dict[str, Any], options: CaptureOptions) -> dict[str, Any]:
    """A new request body with the capture parameters and forced values applied. The token
    limit is the session's, put on every call by the gateway's policy before this
    (pi_env.proxy.policy: one cap in every mode); here it only moves to `max_completion_tokens`
    for the models that refuse `max_tokens`."""
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
