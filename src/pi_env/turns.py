"""The gateway's records as a rollout's turns: what the result and the trainer get of each model
call, and the views built from them.

The gateway (pi_env.proxy.gateway) keeps one `TurnRecord` per model call, with what it captured
of the answer; a rollout hands them back as `RolloutTurn`s (results.py), the shape its users
read: live to `on_event` as each call is recorded, on the result when the rollout is collected,
and any time through `PiSession.fetch_proxy_trace`/`fetch_training_trace`. Here is the one
conversion (`rollout_turn`), the trace of a whole gateway session (`proxy_trace`) and the lines
the turns add to the result's proxy log (`turn_log`); pi_env.training builds the training view
from these turns. Nothing here runs a call or judges it.
"""

from __future__ import annotations

from .proxy.gateway import GatewaySession, TurnRecord
from .results import RolloutTurn


def rollout_turn(record: TurnRecord) -> RolloutTurn:
    """One model call as the result holds it: status and timing, and what was captured of the
    answer (ids, logprobs, the message) when the mode captures it; its policy version."""
    turn = RolloutTurn(
        turn=record.turn,
        latency_s=record.latency_s,
        ttfb_s=record.ttfb_s,
        timestamp=record.started_at,
        upstream_status=record.upstream_status,
        upstream_error=record.upstream_error,
    )
    capture = record.capture
    if capture is not None:
        first = capture.choices[0] if capture.choices else None
        turn.finish_reason = capture.finish_reason
        turn.completion_tokens = capture.completion_tokens
        turn.prompt_token_ids = capture.prompt_token_ids
        turn.completion_token_ids = capture.completion_token_ids
        turn.per_token_logps = capture.per_token_logps
        turn.top_logprobs = first.decoded_top_logprobs() if first else []
        turn.token_ids_source = capture.token_ids_source
        turn.token_ids_missing_reason = capture.token_ids_missing_reason
        turn.capture_fallback = capture.fallback
        turn.capture_worker_error = capture.worker_error
        turn.message = first.message() if first else None
        turn.token_in = capture.token_in
    turn.policy_version, turn.policy_version_source = record.policy_version, record.policy_version_source
    turn.replica, turn.failed_over = record.replica, record.failed_over
    return turn


def proxy_trace(gateway_session: GatewaySession | None) -> list[RolloutTurn]:
    """Every model call of the session so far, once the gateway has finished recording them."""
    if gateway_session is None:
        return []
    gateway_session.wait_idle()
    return [rollout_turn(record) for record in list(gateway_session.turns)]


def turn_log(log_tail: str, turns: list[RolloutTurn]) -> str:
    """The result's proxy log: `log_tail` (what the session said of itself) and a line per turn."""
    return "\n".join(
        [log_tail]
        + [
            f"turn {t.turn}: status {t.upstream_status} in {t.latency_s or 0:.3f} s"
            + (f" error {t.upstream_error[:200]}" if t.upstream_error else "")
            for t in turns
        ]
    ).strip()
