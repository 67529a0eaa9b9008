"""What a rollout asks of the rooms it composes, worked out from its config and task alone;
`PiSession` (pi_env.rollout) opens the gateway session and the sandbox with these:

- `session_endpoint`: the catalog's endpoint, the oracle's, or the trainer (interception_gate).
- `capture_options`: what the gateway asks of the upstream in transparent_proxy (whether to ask
  for `return_token_ids`: configured, or probed, and why), and the session's sampling.
- `load_token_in`: the renderer for token-in, the endpoint checked in transparent_proxy.
- `trace_path`: the session's trace file (in `trace_dir`, or scratch in a private dir).
- `open_gateway_session`: the gateway session opened with all of the above that concerns it and
  the config's budgets, limits, gate deadline and routing, reading the factory's policy version.
- `sandbox_spec`: mounts, limits (the task's may lower the config's, never raise them), the environment to build and
  whether setup and verify get root of a container (Harbor's tasks).
- `with_forced_sampling`: `PiSessionFactory(sampling=...)` over `mode.sampling`.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import uuid
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from .agent.base import FORWARDER_PATH, LAUNCHER_PATH, Agent, Installed
from .config import TRANSPARENT_PROXY, BlackBox, InterceptionGate, PiConfig, TransparentProxy
from .endpoints import OPEN_SERVER_COMPAT, ORACLE, Endpoint, resolve_endpoint, supports_return_token_ids
from .harbor.facts import is_harbor
from .harbor.rules import environment_spec
from .oracle import oracle_endpoint
from .proxy.gateway import GatewaySession, Upstream, get_gateway
from .proxy.policy import SessionLimits
from .proxy.records import PolicyVersion, Routing, TokenInSpec
from .proxy.rewrite import CaptureOptions
from .results import RolloutResult
from .sandbox import SandboxLimits, SandboxSpec
from .task import PiTask
from .task_setup import capped
from .verify import RESERVE_DIR, startup_mount


def session_endpoint(config: PiConfig, task: PiTask, submit_command: str | None = None) -> Endpoint:
    """The endpoint the agent's calls go to (through the gateway). Raises EndpointError with what
    to set. `submit_command`: the agent's (`Agent.submit_command`), for the oracle's last call."""
    if isinstance(config.mode, InterceptionGate):  # the trainer is the model: no upstream at all
        return Endpoint(
            name=config.mode.name,
            base_url="http://interception-gate.invalid/v1",
            model=config.endpoint.model or "trainer",
            compat=OPEN_SERVER_COMPAT,
            return_token_ids=False,
        )
    if config.endpoint.name == ORACLE:
        return oracle_endpoint(task, submit_command=submit_command)
    return resolve_endpoint(config)


def upstream(config: PiConfig, endpoint: Endpoint) -> Upstream:
    return Upstream(
        endpoint.base_url,
        endpoint.api_key,
        endpoint.model,
        connect_timeout_s=config.gateway.upstream_connect_timeout_s,
        read_timeout_s=config.gateway.upstream_read_timeout_s,
        base_urls=endpoint.base_urls,
    )


def capture_options(config: PiConfig, endpoint: Endpoint, result: RolloutResult) -> CaptureOptions:
    """The gateway session's capture options; in transparent_proxy the `return_token_ids`
    decision and its reason are recorded on `result`."""
    mode = config.mode
    # Only transparent_proxy rewrites requests: the other modes keep its defaults, decide nothing, probe nothing.
    proxy = mode if isinstance(mode, TransparentProxy) else TransparentProxy()
    if not isinstance(mode, TransparentProxy):
        return_token_ids = False
    else:
        if mode.return_token_ids is None:
            return_token_ids, why = supports_return_token_ids(endpoint)
        else:
            return_token_ids, why = mode.return_token_ids, "PiConfig.mode.return_token_ids"
        result.return_token_ids, result.return_token_ids_reason = return_token_ids, why
        result.proxy_log_tail = f"return_token_ids={return_token_ids} ({why})"
    disable_thinking = endpoint.disable_thinking if proxy.disable_thinking is None else proxy.disable_thinking
    top_logprobs = min(proxy.top_logprobs, endpoint.max_top_logprobs)
    return CaptureOptions(
        logprobs=proxy.logprobs,
        top_logprobs=top_logprobs,
        return_token_ids=return_token_ids,
        disable_thinking=disable_thinking,
        model=endpoint.model,
        sampling=forced_sampling(config),
    )


def forced_sampling(config: PiConfig) -> dict[str, float | int]:
    """The sampling the gateway forces on every call: the mode's; black_box forces none."""
    return {} if isinstance(config.mode, BlackBox) else dict(config.mode.sampling)


def load_token_in(config: PiConfig, endpoint: Endpoint):
    """The session's renderer, and in transparent_proxy a checked token-in endpoint; raises
    TokenInUnavailable (a ValueError) naming what is missing."""
    from .proxy.token_in import check_endpoint_sync, load_renderer

    mode = config.mode
    if isinstance(mode, BlackBox):  # PiConfig allows token_in only in the capturing modes
        raise ValueError("token-in renders at the gateway, which black_box never does")
    spec = load_renderer(mode.renderer, mode.tokenizer or endpoint.model)
    if isinstance(mode, TransparentProxy):
        check_endpoint_sync(upstream(config, endpoint), spec)
    return spec


def trace_path(config: PiConfig, task_id: str, episode_id: str) -> str | None:
    if isinstance(config.mode, BlackBox):
        return None
    # Retention: a trace_dir is kept on purpose (collect puts it in its dataset); without one
    # the trace is scratch in a private dir and deleted by close().
    directory = Path(config.mode.trace_dir) if config.mode.trace_dir else private_scratch_dir("pi-env-traces")
    safe_id, safe_episode = (re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] for name in (task_id, episode_id))
    return str(directory / f"{safe_id}-{safe_episode}-{uuid.uuid4().hex[:8]}.jsonl")


def open_gateway_session(
    config: PiConfig,
    endpoint: Endpoint,
    result: RolloutResult,
    *,
    task_id: str,
    episode_id: str,
    token_in: TokenInSpec | None,
    policy: PolicyVersion,
) -> GatewaySession:
    """The session Pi's calls go through (its own token), as the config asks; `capture_options`
    records its decisions on `result`."""
    return get_gateway().open_session(
        upstream(config, endpoint),
        mode=config.mode.name,
        max_turns=config.gateway.max_turns,
        max_total_tokens=config.gateway.max_total_tokens,
        max_tokens_cap=config.gateway.max_tokens,
        capture=capture_options(config, endpoint, result),
        trace_path=trace_path(config, task_id, episode_id),
        token_in=token_in,
        allow_fields=config.gateway.allow_fields,
        limits=SessionLimits(
            max_request_bytes=config.gateway.max_request_bytes,
            max_concurrent_calls=config.gateway.max_concurrent_calls,
        ),
        gate_timeout_s=config.mode.gate_timeout_s if isinstance(config.mode, InterceptionGate) else None,
        policy=policy,
        routing=Routing(
            session_header=config.gateway.session_header,
            cache_salt=isinstance(config.mode, TransparentProxy) and config.mode.cache_salt,
            version_header=config.gateway.policy_version_header,
        ),
    )


def sandbox_spec(
    config: PiConfig, task: PiTask, backend: str, agent: Agent, installed: Installed, gateway_socket: str
) -> SandboxSpec:
    proxy = resources.files("pi_env.proxy")
    return SandboxSpec(
        ro_mounts={
            **agent.mounts(installed),
            FORWARDER_PATH: str(proxy.joinpath("forward.mjs")),
            LAUNCHER_PATH: str(proxy.joinpath("launch.mjs")),
            **startup_mount(),
        },
        gateway_socket=gateway_socket,
        limits=SandboxLimits(
            max_processes=config.limits.max_processes,
            max_file_bytes=config.limits.max_file_bytes,
            max_memory_bytes=config.limits.max_memory_bytes,
            max_total_memory_bytes=capped(_mb(task.limits.memory_mb), config.limits.max_total_memory_bytes),
            max_disk_bytes=capped(_mb(task.limits.storage_mb), config.limits.max_disk_bytes),
        ),
        env=dict(config.sandbox.extra_env),
        agent_masked_paths=(RESERVE_DIR, *agent.masked_paths(installed)),
        archive_dir=installed.archive_dir,
        environment=environment_spec(task, backend),
        # Harbor's setup and verifier expect root of a container; the agent never gets it.
        container_root=is_harbor(task),
    )


def with_forced_sampling(config: PiConfig, sampling: Mapping[str, float | int], *, explicit_mode: bool) -> PiConfig:
    """`sampling=` (what a trainer passes, e.g. openenv's `training_sampling(...)`) over
    `mode.sampling`: forced on every model call. black_box relays the agent's sampling as sent
    and so cannot force it: a mode nobody chose becomes transparent_proxy, a chosen black_box is refused."""
    if isinstance(config.mode, BlackBox):
        if explicit_mode or "mode" in config.model_fields_set:
            raise ValueError(
                "sampling= is forced on model calls by the gateway in transparent_proxy; black_box "
                "relays the agent's sampling as sent: use mode='transparent_proxy'"
            )
        config = config.in_mode(TRANSPARENT_PROXY)
    else:
        config = config.model_copy()
    mode = config.mode
    assert not isinstance(mode, BlackBox)
    # A new mode object (the copy shares the old one), its merged sampling checked like any setting.
    config.mode = type(mode)(**{**mode.model_dump(exclude_unset=True), "sampling": {**mode.sampling, **sampling}})
    return config


def private_scratch_dir(name: str) -> Path:
    """`$TMPDIR/<name>-<uid>`, 0700 and ours (another user could have made it first in a shared /tmp)."""
    directory = Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{directory} is not a directory of this user; remove it or set trace_dir")
    if info.st_mode & 0o077:
        directory.chmod(0o700)
    return directory


def _mb(megabytes: int | None) -> int | None:
    return megabytes << 20 if megabytes else None
