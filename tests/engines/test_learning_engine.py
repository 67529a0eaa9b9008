"""The learning run's stages on tiny sizes, for real: base eval, oracle collect + SFT, eval of
the SFT checkpoint, one GRPO step with rollouts through the real Pi against vLLM serving the
checkpoint, eval of the RL checkpoint, the report (scripts/learn_on_cpu.sh is the full run).
Plus the trainer's shared-prefix scoring against scoring every row whole, and the RL engine's
in-place weight load against transformers on the loaded weights.

The torch side runs in the engine venv (it has torch + transformers), pi-env from src/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine import ENGINE_PYTHON, MODEL_DIR, ROOT, free_port, post_json, vllm_missing
from scoring import score_with_transformers

pytestmark = pytest.mark.timeout(3600)


def _engine_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def _needs_vllm():
    reason = vllm_missing()
    if reason:
        if os.environ.get("ENGINE_TIER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


GRADIENT_CHECK = textwrap.dedent("""
    import json, sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from pi_env.learning.rows import Row
    from pi_env.learning.trainer import backward_rows, train_top_layers

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    trained = train_top_layers(model, int(sys.argv[1]))
    prefix = torch.randint(0, 64, (20,)).tolist()
    rows = []
    for n in (7, 11, 4):
        tail = torch.randint(0, 64, (n,)).tolist()
        rows.append(Row(prefix + tail, [0] * 20 + [0, 0] + [1] * (n - 2), weight=float(n)))
    loss_fn = lambda row, logprobs, targets: -(logprobs * row.weight).sum()

    stats = backward_rows(model, rows, loss_fn, micro_batch=2, normaliser=10.0)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    shared = {k: p.grad.clone() for k, p in params.items()}
    model.zero_grad()
    whole = 0.0  # every row scored alone, no cache, plain cross entropy
    for row in rows:
        logits = model(input_ids=torch.tensor([row.token_ids])).logits[0]
        logprobs = torch.log_softmax(logits, -1)
        picked = torch.stack([logprobs[t - 1, row.token_ids[t]] for t in range(len(row.token_ids)) if row.loss_mask[t]])
        loss = -(picked * row.weight).sum() / 10.0
        loss.backward()
        whole += float(loss)
    worst = max(float((shared[k] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)) for k, p in params.items())
    print(json.dumps({"prefix_tokens": stats["prefix_tokens"], "loss_shared": stats["loss"], "loss_whole": whole,
                      "worst_relative_grad_diff": worst, "trained_parameters": trained,
                      "all_parameters": sum(p.numel() for p in model.parameters())}))
""")


@pytest.mark.parametrize("train_layers", [0, 1])
def test_shared_prefix_scoring_matches_scoring_every_row_whole(train_layers):
    """Same loss and gradients as whole rows, training every layer or only the top one."""
    out = subprocess.run([str(ENGINE_PYTHON), "-c", GRADIENT_CHECK, str(train_layers)], env=_engine_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["prefix_tokens"] == 20
    assert (result["trained_parameters"] < result["all_parameters"]) == bool(train_layers)
    assert abs(result["loss_shared"] - result["loss_whole"]) < 1e-4 * abs(result["loss_whole"])
    assert result["worst_relative_grad_diff"] < 1e-3, result


def test_every_stage_on_tiny_sizes(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), "--n-train", "3", "--n-eval", "2", "--n-rl", "4", "--families", "write_file,fix_bug",
            "--sft-epochs", "2", "--sft-batch", "3", "--rl-steps", "2", "--rl-tasks-per-step", "1",
            "--group-size", "4", "--max-turns", "4", "--max-tokens", "96", "--agent-timeout-s", "180",
            "--engine-port", str(free_port()), "--base-model", str(MODEL_DIR)]
    stages = ["tasks", "oracle", "eval_base", "sft", "eval_sft", "rl", "eval_rl"]
    out = subprocess.run(["nice", "-n", "10", str(ENGINE_PYTHON), "-m", "pi_env.learning", *stages, *args],
                         env=_engine_env(), capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report_out = subprocess.run([sys.executable, "-m", "pi_env.learning", "report", *args],
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
                                timeout=300)
    assert report_out.returncode == 0, report_out.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000

    evals = [report["stages"]["base"], report["stages"]["sft"]["eval"], report["stages"]["rl"]["eval"]]
    for summary in evals:
        assert summary["count"] == 2 and summary["unscored"] == 0, summary
        assert summary["held_out_checked_against"] >= 3  # every eval checked against what was trained on
    assert report["stages"]["oracle"]["sft_rows"] == 3
    sft = report["stages"]["sft"]["train"]
    assert sft["steps"] == 2 and sft["loss_last"] < sft["loss_first"]

    steps = report["rl_steps"]
    assert len(steps) == 2
    for step in steps:
        assert len(step["rows_per_rollout"]) == 4 and all(n >= 1 for n in step["rows_per_rollout"])
        assert step["tasks"][0].startswith("rl-")  # RL trains on fresh instances, not the SFT data's
        assert step["generated_tokens"] > 0
        assert set(step["time_s"]) >= {"rollouts", "generation_summed", "pi_and_sandbox_summed", "train"}
        if step["trained_rows"]:  # a group with different rewards: a real gradient step on the sampled trace
            assert 0.5 < step["ratio_mean"] < 2.0 and step["old_logprobs_missing"] == 0
            assert len(step["updates"]) == 2  # --rl-updates' default: the batch is used twice
    # One engine for the stage: started once, then step 0's checkpoint loaded into it in place.
    assert "engine_start" in steps[0]["time_s"] and "weights_load" in steps[1]["time_s"]
    if steps[0]["trained_rows"] and steps[1]["trained_rows"]:
        # Step 1's first update is on-policy only if the engine sampled from step 0's weights.
        assert 0.99 < steps[1]["ratio_min"] and steps[1]["ratio_max"] < 1.01, steps[1]
    trained = any(step["trained_rows"] for step in steps)
    # The RL checkpoint is what the last eval served, and it is not the SFT one.
    assert report["stages"]["rl"]["eval"]["model_dir"].endswith("rl/policy")
    sft_weights = (run_dir / "sft" / "policy" / "model.safetensors").read_bytes()
    rl_weights = (run_dir / "rl" / "policy" / "model.safetensors").read_bytes()
    assert (sft_weights != rl_weights) == trained

    # Resumable: a second run finds every stage's outputs and redoes nothing.
    again = subprocess.run([str(ENGINE_PYTHON), "-m", "pi_env.learning", *stages, *args], env=_engine_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "vLLM" not in again.stderr and "sft step" not in again.stdout


PERTURB = textwrap.dedent("""
    import sys, torch
    from pi_env.learning import trainer

    model, tokenizer = trainer.load_policy(sys.argv[1])
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std())
    trainer.save_policy(model, tokenizer, sys.argv[1], sys.argv[2])
""")


def test_the_rl_engine_serves_a_checkpoint_loaded_in_place(tmp_path):
    """What each RL step relies on: after Engine.load, vLLM samples from the loaded weights, to
    transformers' logprobs on them, and loading the first checkpoint back gives its answer again."""
    from pi_env.learning.pipeline import Engine

    changed = tmp_path / "changed"
    out = subprocess.run([str(ENGINE_PYTHON), "-c", PERTURB, str(MODEL_DIR), str(changed)], env=_engine_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]

    def answer(engine):
        body = {"model": "policy", "prompt": "<|im_start|>user\nWrite a Python function that adds two numbers."
                "<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 12, "temperature": 0, "logprobs": 0,
                "return_token_ids": True}
        choice = post_json(engine.base_url + "/completions", body)["choices"][0]
        return choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["token_logprobs"]

    with Engine(MODEL_DIR, free_port(), tmp_path / "vllm.log", timeout_s=900) as engine:
        prompt, before_ids, before = answer(engine)
        engine.load(changed)
        _, after_ids, after = answer(engine)
        engine.load(MODEL_DIR)
        _, again_ids, again = answer(engine)
    expected = score_with_transformers(changed, prompt, after_ids)
    worst = max(abs(a - b) for a, b in zip(after, expected))
    assert worst < 1e-3, (worst, after, expected)
    assert (after_ids, after) != (before_ids, before)  # the load changed what the engine samples from
    assert again_ids == before_ids and max(abs(a - b) for a, b in zip(again, before)) < 1e-4
