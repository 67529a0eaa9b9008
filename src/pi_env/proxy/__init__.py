"""The model gateway between sandboxed agents and real model endpoints (see gateway.py)."""

from pi_env.proxy.gateway import Gateway, GatewaySession, get_gateway
from pi_env.proxy.records import PolicyVersion, Routing, TurnRecord, Upstream

__all__ = ["Gateway", "GatewaySession", "PolicyVersion", "Routing", "TurnRecord", "Upstream", "get_gateway"]
