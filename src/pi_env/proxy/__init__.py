"""The model gateway between sandboxed agents and real model endpoints."""

from pi_env.proxy.gateway import (
    Gateway,
    GatewaySession,
    TurnRecord,
    Upstream,
    get_gateway,
)

__all__ = ["Gateway", "GatewaySession", "TurnRecord", "Upstream", "get_gateway"]
