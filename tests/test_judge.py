"""The outcome rules without a sandbox (pi_env.judge): what ended the agent, every branch of
`judge_agent` in its order, and `score_reward`. The end-to-end tests (test_rollout.py,
test_gateway_record.py, test_gate.py) check the same rules through real Pi and bubblewrap."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pi_env.judge import ENDPOINT_FAULT_STATUSES, AgentEnd, LastCall, Verdict, judge_agent, score_reward
from pi_env.results import CommandResult

ANSWERED = LastCall(upstream_status=200, ttfb_s=0.1, streamed=True)
# Pi's streamed call, cut off by the time limit before the endpoint's first byte.
HUNG_STREAM = LastCall(upstream_status=None, client_disconnected=True, ttfb_s=None, streamed=True)
DONE = AgentEnd(exit_code=0, answered=True, last=ANSWERED, limit_s=30)


def test_an_agent_that_ended_on_its_own_is_scored():
    verdict = judge_agent(DONE)
    assert verdict == Verdict() and verdict.scored and verdict.stop_reason is None


def test_a_session_closed_under_the_agent_is_infra_before_any_other_rule():
    verdict = judge_agent(replace(DONE, closed=True, timed_out=True, gate_stop="gate_timeout", budget_exhausted="max_turns"))
    assert (verdict.error_kind, verdict.error) == ("infra", "the session was closed while the agent ran")
    assert verdict.stop_reason is None  # the conversation's stays


@pytest.mark.parametrize("end", [
    replace(DONE, timed_out=True, answered=False, last=None),  # before Pi called the model
    replace(DONE, timed_out=True, answered=False, last=ANSWERED),  # no message yet
    replace(DONE, timed_out=True, last=HUNG_STREAM),  # the endpoint never began its answer
    replace(DONE, timed_out=True, last=replace(HUNG_STREAM, streamed=None)),  # a refused body counts as streamed
], ids=["never-called", "no-message", "hung-stream", "streamed-unknown"])
def test_a_time_limit_while_the_endpoint_had_not_answered_is_unscored(end):
    verdict = judge_agent(end)
    assert verdict.error_kind == "agent_timeout" and verdict.stop_reason == "timeout"
    assert verdict.error.startswith("the agent's 30 s limit passed while the model endpoint had not begun")


@pytest.mark.parametrize("last", [
    ANSWERED,  # a hung tool, a stopped Pi: its own time
    replace(HUNG_STREAM, streamed=False),  # its own slow non-streamed call
    replace(HUNG_STREAM, ttfb_s=0.5),  # the endpoint had begun answering
    replace(HUNG_STREAM, client_disconnected=False),
], ids=["own-time", "non-streamed", "answer-begun", "not-disconnected"])
def test_a_time_limit_the_agent_spent_itself_is_scored(last):
    verdict = judge_agent(replace(DONE, timed_out=True, last=last, gate_stop="gate_timeout", budget_exhausted="max_turns"))
    assert verdict.scored and verdict.stop_reason == "timeout" and verdict.budget_exhausted is None


def test_a_trainer_that_never_answered_is_gate_timeout():
    end = replace(DONE, gate_stop="gate_timeout", gate_message="no completion in 5 s", budget_exhausted="max_turns")
    assert judge_agent(end) == Verdict("gate_timeout", "no completion in 5 s", stop_reason="gate_timeout")


def test_a_budget_is_scored_and_said_so_even_after_a_failed_call():
    end = replace(DONE, budget_exhausted="max_total_tokens", last=LastCall(upstream_status=500, upstream_error="x"))
    assert judge_agent(end) == Verdict(stop_reason="budget", budget_exhausted="max_total_tokens")


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
    broke = LastCall(upstream_status=200, upstream_error="upstream stream broken: reset", ttfb_s=0.1, upstream_broke=True)
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
    assert LastCall.of(record) == LastCall(429, "slow down", True, None, True, upstream_broke=True)


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
