"""What pi-env's commands share: exit codes, the endpoint and backend arguments, and the config
they make. `cli` (run, doctor) and the rooms' own commands (`collect`, `export`, `serve`) import it
from here, so no room reaches back into the command line that dispatches to it."""

from __future__ import annotations

import argparse

from pydantic import BaseModel

from .agent import agent_names
from .config import BLACK_BOX, DEFAULT_MAX_TOKENS, MODES, TRANSPARENT_PROXY, BlackBox, PiConfig
from .errors import EXIT_BAD_INPUT, EXIT_INFRA  # noqa: F401 - their home is pi_env.errors; imported from here too
from .sandbox import backend_names


def endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        default="oracle",
        help="vllm, openai, hf_router, oracle (replays the task's solution), an http(s) URL, or several "
        "replicas' URLs, comma-separated (each rollout sticks to one; a replica that fails before "
        "answering is retried on another)",
    )
    for name in ("base_url", "model", "api_key"):
        parser.add_argument("--" + name.replace("_", "-"), default=None, help=field_help(f"endpoint.{name}"))


def field_help(name: str) -> str:
    """A PiConfig field's docstring (`endpoint.base_url`: a section's field), as a flag's help."""
    *sections, field = name.split(".")
    model: type[BaseModel] = PiConfig
    for section in sections:
        model = _section_model(model, section)
    description = model.model_fields[field].description
    assert description is not None, f"PiConfig.{name} has no docstring (its description)"
    return " ".join(description.split()).replace("%", "%%")


def _section_model(model: type[BaseModel], section: str) -> type[BaseModel]:
    annotation = model.model_fields[section].annotation
    assert isinstance(annotation, type) and issubclass(annotation, BaseModel), f"{section} is not a section"
    return annotation


def backend_argument(parser: argparse.ArgumentParser, default: str | None = "local") -> None:
    """`--backend`, naming every backend in the sandbox registry."""
    shown = "" if default is None else f"; default {default}"
    parser.add_argument(
        "--backend",
        default=default,
        choices=backend_names(),
        metavar="BACKEND",
        help=f"sandbox backend: {', '.join(backend_names())}{shown} (local is bubblewrap; see docs/backends.md)",
    )


def agent_argument(parser: argparse.ArgumentParser, default: str | None = "pi") -> None:
    """`--agent`, naming every agent in the registry, and `--agent-version`."""
    shown = "" if default is None else f"; default {default}"
    parser.add_argument(
        "--agent",
        default=default,
        choices=agent_names(),
        metavar="AGENT",
        help=f"the coding agent: {', '.join(agent_names())}{shown} (docs/agents.md)",
    )
    parser.add_argument(
        "--agent-version", default=None, metavar="VERSION", help="the agent's version (default: pi-env's pin)"
    )


def generation_arguments(parser: argparse.ArgumentParser) -> None:
    """--agent, --max-tokens and --sampling, for every command that runs rollouts."""
    agent_argument(parser)
    parser.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"max_tokens of every model call: what Pi asks for, and the gateway's cap (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--sampling",
        default=None,
        metavar="NAME=VALUE,...",
        help="sampling forced on every model call at the gateway (mode.sampling), e.g. "
        "temperature=0,top_p=1,seed=7; needs transparent_proxy. Without it Pi sends no "
        "temperature, so the engine's default applies (vLLM: 1.0)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def config_from_args(args, *, mode: str | None = None, mode_settings: dict | None = None, **sections) -> PiConfig:
    """The PiConfig of a command's flags. `mode` None: the command's default, which is
    transparent_proxy when --sampling is given (only it can force sampling). `sections`: each
    section's settings from the command's own flags (`gateway={"max_turns": 3}`); `mode_settings`:
    its mode flags (--trace-dir, --token-in, ...), each ignored by a mode that has no use for it,
    as it always was, but for --token-in, which black_box cannot honour."""
    fields: dict = {name: {k: v for k, v in values.items() if v is not None} for name, values in sections.items()}
    fields.setdefault("endpoint", {}).update(
        {"name": args.endpoint, "base_url": args.base_url, "model": args.model, "api_key": args.api_key}
    )
    if getattr(args, "backend", None) is not None:  # None: the config's default backend
        fields.setdefault("sandbox", {})["backend"] = args.backend
    if getattr(args, "agent", None) is not None:
        fields["agent"] = {"name": args.agent, "version": getattr(args, "agent_version", None)}
    if getattr(args, "max_tokens", None) is not None:
        fields.setdefault("gateway", {})["max_tokens"] = args.max_tokens
    settings = {k: v for k, v in (mode_settings or {}).items() if v is not None}
    if getattr(args, "sampling", None) is not None:
        from .proxy.rewrite import parse_sampling

        settings["sampling"] = parse_sampling(args.sampling)
        if mode == BLACK_BOX:
            raise ValueError(
                "--sampling is forced on model calls by the gateway in transparent_proxy; --mode "
                "black_box relays the agent's sampling as sent: drop --mode or use --mode "
                "transparent_proxy"
            )
        mode = mode or TRANSPARENT_PROXY
    chosen = MODES[mode or BLACK_BOX]
    if settings.get("token_in") and "token_in" not in chosen.model_fields:
        raise ValueError(
            f"--token-in renders at the gateway, which {chosen().name} never does: use --mode transparent_proxy"
        )
    fields["mode"] = {"name": chosen().name, **{k: v for k, v in settings.items() if k in chosen.model_fields}}
    fields["endpoint"] = {k: v for k, v in fields["endpoint"].items() if v is not None}
    return PiConfig(**{k: v for k, v in fields.items() if v is not None})


def describe_sampling(config: PiConfig) -> str:
    """Which sampling the model calls get, in words (printed by run and collect)."""
    if not isinstance(config.mode, BlackBox) and config.mode.sampling:
        forced = ", ".join(f"{k}={v}" for k, v in config.mode.sampling.items())
        return f"sampling forced at the gateway: {forced}; max_tokens {config.gateway.max_tokens}"
    if config.agent.name != "pi":
        return f"no sampling forced: {config.agent.name}'s own sampling goes as sent; max_tokens {config.gateway.max_tokens}"
    return (
        f"no sampling forced: Pi sends no temperature, so the engine's default applies (vLLM: 1.0); "
        f"max_tokens {config.gateway.max_tokens}"
    )
