"""GRPO on the real Pi agent with TRL's AsyncGRPOTrainer and pi-env as its OpenEnv harness.

NEEDS A GPU AND A vLLM SERVER: it cannot run on a CPU-only machine (this repository's CI
only compiles and import-checks it; `examples/gate_loop.py` is the CPU loop that runs).

TRL 1.16's `HarnessRolloutWorker` (trl.experimental.async_grpo.openenv_harness) builds the
factory with `sampling=training_sampling(...)` and, per rollout, calls
`create(prompt, seed=group_id, episode_id=...)`, `wait_for_completion()`,
`fetch_training_trace()` and `verify()`. pi-env's `HarnessSessionFactory` runs Pi against the
vLLM server in transparent_proxy mode (the gateway records vLLM's token ids and logprobs) and
scores each rollout with the task's verify commands: no reward functions are needed.

    pip install -e '.[trl]'         # pi-env + openenv 0.10 + trl 1.16 (+ vllm, with CUDA)
    # 1. the policy server (the trainer pushes weights into it over NCCL):
    VLLM_SERVER_DEV_MODE=1 CUDA_VISIBLE_DEVICES=0 vllm serve Qwen/Qwen3-1.7B --port 8000 \
        --enable-auto-tool-choice --tool-call-parser hermes \
        --weight-transfer-config '{"backend": "nccl"}'
    # 2. the trainer, on another GPU:
    CUDA_VISIBLE_DEVICES=1 python examples/trl_async_grpo.py --tasks examples/fizzbuzz.json
"""

from __future__ import annotations

import argparse
from functools import partial

from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker

from pi_env import PiConfig, load_tasks
from pi_env.harness import HarnessSessionFactory, dataset_rows


def main() -> None:
    parser = argparse.ArgumentParser(description="AsyncGRPO on Pi rollouts (GPU + vLLM)")
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--vllm-url", default="http://127.0.0.1:8000")  # the `vllm serve` above
    parser.add_argument("--tasks", nargs="+", default=["examples/fizzbuzz.json", "examples/binary_search.json"])
    parser.add_argument("--output-dir", default="pi-env-async-grpo")
    args = parser.parse_args()

    tasks = [task for path in args.tasks for task in load_tasks(path)]
    dataset = Dataset.from_list(dataset_rows(tasks))  # one row per task; the row selects its task
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = AsyncGRPOConfig(
        output_dir=args.output_dir,
        vllm_server_base_url=args.vllm_url,
        num_generations=8,
        max_completion_length=4096,  # per model call
        max_tool_calling_iterations=20,  # Pi's model calls per rollout
        temperature=1.0,
        learning_rate=1e-6,
        max_steps=100,
    )
    # Pi talks to the same vLLM server through pi-env's gateway (OpenAI API under /v1).
    pi = PiConfig(
        endpoint={"name": f"{args.vllm_url}/v1", "model": args.model},
        mode="transparent_proxy",
        gateway={"max_turns": config.max_tool_calling_iterations},
        limits={"agent_timeout_s": 900},
    )
    worker = HarnessRolloutWorker(
        harness_session_factory=partial(HarnessSessionFactory, pi, tasks=tasks),
        model_name=args.model,
        dataset=dataset,
        reward_funcs=[],  # the reward is the harness's (the task's verify commands)
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        num_generations=config.num_generations,
        max_inflight_tasks=32,
        vllm_server_url=config.vllm_server_base_url,
        max_tokens=config.max_completion_length,
        temperature=config.temperature,
        max_tool_calling_iterations=config.max_tool_calling_iterations,
    )
    trainer = AsyncGRPOTrainer(model=args.model, args=config, train_dataset=dataset,
                               processing_class=tokenizer, rollout_worker=worker)
    trainer.train()


if __name__ == "__main__":
    main()
