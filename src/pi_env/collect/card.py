"""`DIR/README.md` (the dataset card) and the push to the Hugging Face Hub.

The card's YAML front matter names `results.jsonl` as the `train` split of the default config
(and each export present as a config of its own), so the Hub's viewer never tries to read
`metadata.json` or `discarded.jsonl` as rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .store import RESULTS

EXPORTS_DIR = "exports"
EXPORT_FORMATS = ("sft", "grpo", "atif")
UPLOADED = [RESULTS, "metadata.json", "README.md", "report.png", f"{EXPORTS_DIR}/*.jsonl"]


def front_matter(out_dir: Path) -> str:
    lines = ["---", "configs:", "- config_name: default", "  data_files:", "  - split: train", f"    path: {RESULTS}"]
    for name in EXPORT_FORMATS:
        if (out_dir / EXPORTS_DIR / f"{name}.jsonl").exists():
            lines += [
                f"- config_name: {name}",
                "  data_files:",
                "  - split: train",
                f"    path: {EXPORTS_DIR}/{name}.jsonl",
            ]
    lines += ["tags:", "- pi-env", "- agent-trajectories", "- tool-calling", "---"]
    return "\n".join(lines)


def build_card(out_dir: Path) -> str:
    out_dir = Path(out_dir)
    try:
        metadata = json.loads((out_dir / "metadata.json").read_text())
    except (OSError, ValueError):
        metadata = {}
    counts, run, config = metadata.get("counts", {}), metadata.get("run", {}), metadata.get("config", {})
    synthetic = counts.get("synthetic", 0)
    body = [
        "",
        "# pi-env rollouts",
        "",
        "Rollouts of the [Pi coding agent](https://www.npmjs.com/package/@earendil-works/pi-coding-agent) "
        "on coding tasks in an isolated sandbox, collected with `pi-env collect`; each is scored by the "
        "task's own verifier.",
        "",
        f"- records: {counts.get('records', 0)} ({counts.get('kept', 0)} in `{RESULTS}`), "
        f"tasks: {counts.get('tasks', 0)}, group size: {run.get('group_size', '?')}",
        f"- scored: {counts.get('scored', 0)}, mean reward: {counts.get('mean_reward')}, "
        f"unscored by kind: {counts.get('errors') or 'none'}",
        f"- endpoint: `{_saved(config, 'endpoint', 'name')}`, model: {', '.join(counts.get('models') or ['?'])}, "
        f"mode: `{_saved(config, 'mode', 'name')}`, "
        f"Pi {', '.join(counts.get('pi_versions') or [str(_saved(config, 'agent', 'pi', 'version'))])}",
    ]
    if synthetic:
        body += [
            "",
            f"**{synthetic} records are synthetic**: the `oracle` endpoint replayed each task's reference "
            "solution through the real Pi; no model wrote them (`synthetic: true`).",
        ]
    body += [
        "",
        "## Fields",
        "",
        "- `messages`, `tools`: the conversation for TRL's `SFTTrainer` (tool calls with JSON-string "
        "arguments, `tool` results; `tools` is a JSON string of the schemas Pi offered)",
        "- `reward` (null when unscored), `error_kind`, `scored`, `task_id`, `group_id`, `group_index`, `attempt`",
        "- `turns` (per model call: completion token ids and logprobs, when captured) and `training` "
        "(token sequences with a loss mask over generated tokens)",
        "- `timings`, `wall_s`, `endpoint`, `model`, `mode`, `pi_version`, `synthetic`",
        "",
        "Unscored records (`reward` null) failed for a reason other than the agent's work: mask them, "
        "never read them as 0.",
        "",
        "```python",
        "from datasets import load_dataset",
        'ds = load_dataset("REPO", split="train")',
        "```",
        "",
    ]
    return front_matter(out_dir) + "\n" + "\n".join(body)


def write_card(out_dir: Path) -> Path:
    path = Path(out_dir) / "README.md"
    path.write_text(build_card(out_dir))
    return path


def push_to_hub(out_dir: str | Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Create (or reuse) the dataset repo and upload the card, results, metadata, report and
    exports in one commit. Returns the commit URL."""
    from huggingface_hub import HfApi

    out_dir = Path(out_dir)
    if not (out_dir / RESULTS).exists():
        raise FileNotFoundError(f"{out_dir}/{RESULTS} is missing: collect before pushing")
    write_card(out_dir)
    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="dataset", private=private, exist_ok=True)
    records = sum(1 for line in (out_dir / RESULTS).open("rb") if line.strip())
    commit = api.upload_folder(
        folder_path=str(out_dir),
        repo_id=repo_id,
        repo_type="dataset",
        allow_patterns=UPLOADED,
        commit_message=f"pi-env collect: {records} records",
    )
    return str(getattr(commit, "commit_url", commit))


def _saved(config: dict, *path: str):
    """A setting of a saved config: in sections, or flat (a dataset collected before them)."""
    flat = {("endpoint", "name"): "endpoint", ("mode", "name"): "mode", ("agent", "pi", "version"): "pi_version"}
    value: Any = config
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return config.get(flat[path]) if value is None else value
