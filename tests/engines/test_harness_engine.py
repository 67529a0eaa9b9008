"""The OpenEnv harness contract against a real engine (vLLM CPU, SmolLM2-135M-Instruct): what
TRL's HarnessRolloutWorker reads from a pi-env session is openenv's own TrainingTrace, built from
the engine's ids and logprobs and passing openenv's validation, with the trainer's sampling
forced on every call and the same weights reproducing the logprobs."""

from __future__ import annotations

import math

import pytest

from engine import NOTES
from pi_env import PiConfig, PiTask
from scoring import score_with_transformers
from test_engine_direct import SEED



def test_training_trace_from_vllm_passes_openenv_validation(openenv_harness, vllm_engine, tmp_path):
    from openenv.core.harness.capture.upstream import training_sampling

    from pi_env.harness import HarnessSessionFactory

    config = PiConfig(
        endpoint={"name": vllm_engine.base_url, "model": vllm_engine.model},
        mode={"name": "transparent_proxy", "return_token_ids": True, "sampling": {"seed": SEED}, "trace_dir": str(tmp_path)},
        gateway={"max_turns": 3, "max_tokens": 48},
        agent={"context_window": 8192},
    )
    factory = HarnessSessionFactory(config, sampling=training_sampling({"temperature": 1.0}))
    task = PiTask(task_id="engine-harness", instruction="Say hello in one short sentence.", verify=["true"],
                  timeouts={"agent_s": 600})
    with factory.create(task, seed=0, episode_id="engine-harness-0") as session:
        assert isinstance(session, openenv_harness.TrainableSession)
        session.wait_for_completion(timeout_s=900)
        trace = session.fetch_training_trace()
        verdict = session.verify()
        entries = session.fetch_proxy_trace()
    assert isinstance(trace, openenv_harness.TrainingTrace)
    # openenv's own validation, again, on the serialised form (what crosses TRL's process boundary).
    again = openenv_harness.TrainingTrace.model_validate_json(trace.model_dump_json())
    assert again == trace and trace.turns
    assert verdict.env_reward == 1.0 and verdict.metrics["error_kind"] is None
    for turn, entry in zip(trace.turns, entries):
        assert turn.prompt_token_ids and turn.completion_token_ids
        assert len(turn.per_token_logps) == len(turn.completion_token_ids)
        assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in turn.per_token_logps)
        assert turn.request["temperature"] == 1.0 and turn.request["top_k"] == -1  # forced by the trainer
        assert entry["completion_token_ids"] == turn.completion_token_ids
        scored = score_with_transformers(vllm_engine.model_dir, turn.prompt_token_ids, turn.completion_token_ids)
        diff = max(abs(a - b) for a, b in zip(scored, turn.per_token_logps))
        NOTES.append(f"harness turn {turn.node_id}: {len(turn.completion_token_ids)} tokens, openenv TrainingTrace "
                     f"valid, transformers vs captured max abs diff {diff:.5f}")
        assert diff < 0.05
