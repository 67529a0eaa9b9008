"""`GateAPI`: the trainer's side of an interception_gate rollout, mixed into `PiSession`
(pi_env.rollout.session). The trainer is the model: it takes each model call the agent makes, held by the
gateway's `InterceptionGate` (pi_env.proxy.gate), with `next_request()` and answers it with
`deliver()`; neither waits past the agent's own time limit.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..config import InterceptionGate

if TYPE_CHECKING:
    from ..proxy.gate import GateCompletion, GateRequest
    from .context import RolloutContext


class GateAPI:
    """next_request/deliver (and their async forms) over the session's gateway session. What it
    reads of the session's context: the mode, the gateway session, the agent's process and deadline."""

    ctx: RolloutContext

    def next_request(self, timeout_s: float | None = None) -> GateRequest | None:
        """The agent's next model call, held until `deliver()`. None once the agent has exited
        (or its time is up, or the session is closed): then call wait_for_completion().
        TimeoutError when `timeout_s` passes first with the agent still working."""
        gate, wait = self._gate_wait(timeout_s)
        if gate is None:
            return None
        try:
            return gate.next_request(wait, alive=self._agent_alive)
        except TimeoutError:
            if timeout_s is not None and timeout_s <= wait:
                raise
            return None  # the agent's own time is up: wait_for_completion() kills it and says so

    async def anext_request(self, timeout_s: float | None = None) -> GateRequest | None:
        """`next_request` for async code (any event loop)."""
        gate, wait = self._gate_wait(timeout_s)
        if gate is None:
            return None
        try:
            return await gate.anext_request(wait, alive=self._agent_alive)
        except TimeoutError:
            if timeout_s is not None and timeout_s <= wait:
                raise
            return None

    def deliver(self, request: GateRequest | str, completion: GateCompletion | dict | str) -> None:
        """Answer a held call with the trainer's completion (see pi_env.proxy.gate). Raises
        RequestNotPending or CompletionInvalid; returns at once."""
        self._gate().deliver(request, completion)

    async def adeliver(self, request: GateRequest | str, completion: GateCompletion | dict | str) -> None:
        self.deliver(request, completion)

    def _gate(self):
        ctx = self.ctx
        if not isinstance(ctx.config.mode, InterceptionGate):
            raise RuntimeError(f"next_request/deliver need mode='interception_gate', not {ctx.config.mode.name!r}")
        if ctx.gateway_session is None:
            raise RuntimeError("the session failed before its gateway session opened: there is nothing to answer")
        return ctx.gateway_session.strategy

    def _gate_wait(self, timeout_s: float | None):
        """The gate (None: no agent ever ran) and how long to wait: never past the agent's deadline."""
        ctx = self.ctx
        if not isinstance(ctx.config.mode, InterceptionGate):
            self._gate()  # raises: not a gate session
        if ctx.gateway_session is None or ctx.agent is None:
            return None, 0.0
        left = max(0.0, ctx.agent_deadline - time.monotonic())
        return ctx.gateway_session.strategy, left if timeout_s is None else min(timeout_s, left)

    def _agent_alive(self) -> bool:
        return self.ctx.agent is not None and self.ctx.agent.poll() is None
