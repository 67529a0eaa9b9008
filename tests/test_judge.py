"""The outcome rules without a sandbox (pi_env.judge): what ended the agent, every branch of
`judge_agent` in its order, and `score_reward`. The end-to-end tests (test_rollout.py,
test_gateway_record.py, test_gate.py) check the same rules through real Pi and bubblewrap."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pi_env.judge import ENDPOINT_FAULT_STATUSES, AgentEnd, LastCall, Verdict, judge_agent, score_reward
from pi_env.results import CommandResult, RolloutResult

ANSWERED = LastCall(upstream_status=200)
# A call still in flight when the time limit killed Pi: no answer from the endpoint at all.
IN_FLIGHT = LastCall(upstream_status=None, upstream_error="the agent hung up before the answer")
DONE = AgentEnd(exit_code=0, answered=True, last=ANSWERED, limit_s=30)


def test_an_agent_that_ended_on_its_own_is_scored():
    verdict = judge_agent(DONE)
    assert verdict == Verdict() and verdict.scored and verdict.stop_reason is None and not verdict.truncated


def test_a_session_closed_under_the_agent_is_infra_before_any_other_rule():
    verdict = judge_agent(replace(DONE, closed=True, timed_out=True, gate_stop="gate_timeout", budget_exhausted="max_turns"))
    assert (verdict.error_kind, verdict.error) == ("infra", "the session was closed while the agent ran")
    assert verdict.stop_reason is None and not verdict.truncated  # the conversation's stays


@pytest.mark.parametrize("end", [
    replace(DONE, timed_out=True),  # a hung tool, a stopped Pi: its own time
    replace(DONE, timed_out=True, last=IN_FLIGHT),  # a call in flight, the endpoint's first byte not yet in
    replace(DONE, timed_out=True, answered=False, last=IN_FLIGHT),  # Pi's first call, never begun
    replace(DONE, timed_out=True, answered=False, last=ANSWERED),  # its first answer, cut off
    replace(DONE, timed_out=True, last=LastCall(upstream_status=500, upstream_error="x")),  # after a failed call
    replace(DONE, timed_out=True, gate_stop="gate_timeout", budget_exhausted="max_turns"),  # the limit first
], ids=["own-time", "call-in-flight", "first-call-in-flight", "first-answer-cut", "after-failed-call", "limit-first"])
def test_an_agent_whose_time_runs_out_is_scored_on_what_it_left_whatever_was_in_flight(end):
    """A zero stays a zero, by ownership: a call of the agent's own, started (or stalled) just
    before its time is up, must not turn its 0 into an unscored result (it used to be
    agent_timeout whenever the endpoint had not begun answering a streamed call)."""
    verdict = judge_agent(end)
    assert verdict == Verdict(stop_reason="timeout", truncated=True) and verdict.scored


def test_a_time_limit_before_pi_ever_called_the_model_is_the_one_unscored_time_out():
    # No call in the whole rollout: no answer of the model's ever existed, nothing is the agent's.
    verdict = judge_agent(replace(DONE, timed_out=True, answered=False, last=None))
    assert verdict == Verdict(
        "agent_timeout", "the agent's 30 s limit passed before Pi called the model", stop_reason="timeout", truncated=True
    )


def test_a_trainer_that_never_answered_is_gate_timeout():
    end = replace(DONE, gate_stop="gate_timeout", gate_message="no completion in 5 s", budget_exhausted="max_turns")
    assert judge_agent(end) == Verdict("gate_timeout", "no completion in 5 s", stop_reason="gate_timeout")


def test_a_budget_is_scored_and_said_so_even_after_a_failed_call():
    end = replace(DONE, budget_exhausted="max_total_tokens", last=LastCall(upstream_status=500, upstream_error="x"))
    assert judge_agent(end) == Verdict(stop_reason="budget", budget_exhausted="max_total_tokens", truncated=True)


@pytest.mark.parametrize("status", [None, 500, 502, *sorted(ENDPOINT_FAULT_STATUSES)])
def test_a_failing_endpoint_is_endpoint_error(status):
    verdict = judge_agent(replace(DONE, last=LastCall(upstream_status=status, upstream_error="E" * 600 + "tail")))
    assert verdict.error_kind == "endpoint_error" and verdict.stop_reason is None
    assert verdict.error.startswith(f"model endpoint failed ({status or 'unreachable'}): ")
    assert verdict.error.endswith("tail") and len(verdict.error.split(": ", 1)[1]) == 500  # the error's tail


def test_an_error_on_an_answered_call_is_the_agents_outcome_and_no_answer_at_all_the_endpoints():
    verdict = judge_agent(replace(DONE, last=LastCall(upstream_status=200, upstream_error="agent hung up")))
    assert verdict == Verdict()  # neither a 5xx nor a fault status, after the agent's first turn: scored
    verdict = judge_agent(replace(DONE, last=LastCall(upstream_status=None, upstream_error="connection refused")))
    assert verdict == Verdict("endpoint_error", "model endpoint failed (unreachable): connection refused")


def test_an_answer_the_endpoint_broke_mid_stream_is_unscored_not_a_zero():
    # A replica that dies while streaming: Pi got half an answer, which is no outcome of the agent's.
    broke = LastCall(upstream_status=200, upstream_error="upstream stream broken: reset", upstream_broke=True)
    for answered in (True, False):
        verdict = judge_agent(replace(DONE, answered=answered, last=broke))
        assert verdict == Verdict("endpoint_error", "model endpoint broke its answer mid-stream: upstream stream broken: reset")


def test_a_refused_first_call_is_agent_error_and_a_later_one_the_agents_outcome():
    refused = LastCall(upstream_status=400, upstream_error="bad request")
    verdict = judge_agent(replace(DONE, answered=False, last=refused))
    assert verdict == Verdict("agent_error", "the model endpoint refused the first call (400): bad request")
    assert judge_agent(replace(DONE, answered=True, last=refused)) == Verdict()


def test_a_pi_that_never_called_the_model_is_agent_error():
    never = replace(DONE, answered=False, last=None, exit_code=1)
    assert judge_agent(replace(never, stderr="x" * 600 + "SyntaxError")).error.endswith("SyntaxError")
    assert len(judge_agent(replace(never, stderr="x" * 600)).error) == 500
    assert judge_agent(never) == Verdict("agent_error", "Pi exited 1 without calling the model")


def test_last_call_reads_a_gateway_record():
    record = SimpleNamespace(upstream_status=429, upstream_error="slow down", client_disconnected=True, ttfb_s=None,
                             streamed=True, turn=3, upstream_broke=True)
    assert LastCall.of(record) == LastCall(429, "slow down", upstream_broke=True)


def test_truncated_travels_with_the_result_like_stop_reason():
    """The flag a trainer reads to tell a stopped agent from one that ended on its own: in the
    result's dict and JSON (what `pi-env run`, the server and collect's workers pass on)."""
    stopped = RolloutResult(task_id="t", reward=0.0, stop_reason="timeout", truncated=True)
    assert stopped.model_dump(mode="json")["truncated"] is True
    assert RolloutResult.model_validate_json(stopped.model_dump_json()) == stopped
    assert RolloutResult.model_validate(RolloutResult(task_id="t").model_dump()).truncated is False


def result(exit_code: int) -> CommandResult:
    return CommandResult(cmd="check", exit_code=exit_code, stdout="", stderr="", duration_s=0.0)


def test_the_reward_file_wins_over_the_pass_rate_even_at_zero():
    score = score_reward(0.0, [result(0), result(0)])
    assert (score.reward, score.source, score.error_kind) == (0.0, "reward_file", None)


def test_without_a_reward_file_the_reward_is_the_pass_rate():
    score = score_reward(None, [result(0), result(1), result(0), result(2)])
    assert (score.reward, score.source, score.error_kind) == (0.5, "pass_rate", None)


def test_no_verify_command_and_no_reward_file_is_unscored():
    score = score_reward(None, [])
    assert (score.reward, score.source, score.error_kind) == (None, None, "no_verify")
    assert score.error == "the task has no verify commands and no reward file"
