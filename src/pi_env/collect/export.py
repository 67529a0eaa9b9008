"""Exports of a collect store, one JSON line per row (each loads with
`datasets.load_dataset("json", data_files=...)`):

- `sft`: `messages` + `tools` (TRL's SFTTrainer, tool calling), default keep `reward>=1`.
- `grpo`: one row per token sequence of a scored rollout: `prompt_ids`, `completion_ids`,
  `logprobs` and `loss_mask` over the completion (0 on tool results and other inserted
  tokens), `reward`, `group_id`, `group_index`. Default keep `scored`.
- `atif`: Harbor's Agent Trajectory Interchange Format (ATIF-v1.8, as harbor 0.26 writes it), one trajectory per line,
  with each agent step's prompt and completion token ids and logprobs when they were captured
  (Harbor's own Pi adapter records none). Default keep `all`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from .runner import KeepFilter
from .store import StoreError, check_record_fields, read_numbered_records

DEFAULT_KEEP = {"sft": "reward>=1", "grpo": "scored", "atif": "all"}
ATIF_VERSION = "ATIF-v1.8"


def export(
    out_dir: str | Path, fmt: str, *, keep: str | None = None, path: str | Path | None = None
) -> tuple[Path, int, int]:
    """Write an export; returns (path, rows written, records used)."""
    from .card import EXPORTS_DIR, write_card

    if fmt not in DEFAULT_KEEP:
        raise ValueError(f"--format {fmt!r}: choose sft, grpo or atif")
    out_dir = Path(out_dir)
    if not (out_dir / "results.jsonl").exists():
        raise FileNotFoundError(f"{out_dir}/results.jsonl is missing: give the --out directory of pi-env collect")
    keep_filter = KeepFilter.parse(keep or DEFAULT_KEEP[fmt])
    build = {"sft": sft_rows, "grpo": grpo_rows, "atif": atif_rows}[fmt]
    target = Path(path) if path else out_dir / EXPORTS_DIR / f"{fmt}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    written = used = 0
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            for record, where, number in read_numbered_records(out_dir):
                check_record_fields(record, where, number)
                if not keep_filter(record):
                    continue
                used += 1
                try:  # a field of the wrong shape deep in a record: name the line, not a traceback
                    lines = [json.dumps(row, ensure_ascii=False, allow_nan=False) for row in build([record])]
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
                    raise StoreError(
                        f"{where}:{number}: cannot export record {record['id']!r} as {fmt}: "
                        f"{type(error).__name__}: {error} (fix or remove that line)"
                    ) from None
                handle.write("".join(line + "\n" for line in lines))
                written += len(lines)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(target)
    if not path:
        write_card(out_dir)  # the card lists the exports next to the results
    return target, written, used


def sft_rows(records: Iterable[dict]) -> Iterator[dict]:
    for r in records:
        yield {
            "messages": r["messages"],
            "tools": r["tools"],
            "id": r["id"],
            "task_id": r["task_id"],
            "group_index": r["group_index"],
            "reward": r["reward"],
            "synthetic": r["synthetic"],
        }


def grpo_rows(records: Iterable[dict]) -> Iterator[dict]:
    for r in records:
        if r.get("reward") is None or not r.get("training"):
            continue  # unscored: masked; no training view: nothing token-level to train on
        for index, segment in enumerate(r["training"]["segments"]):
            start = segment["prompt_length"]
            yield {
                "id": f"{r['id']}/{index}",
                "group_id": r["group_id"],
                "task_id": r["task_id"],
                "group_index": r["group_index"],
                "segment": index,
                "reward": r["reward"],
                "prompt_ids": segment["token_ids"][:start],
                "completion_ids": segment["token_ids"][start:],
                "logprobs": segment["logprobs"][start:],
                "loss_mask": segment["loss_mask"][start:],
                "turns": segment["turns"],
                "synthetic": r["synthetic"],
            }


def atif_rows(records: Iterable[dict]) -> Iterator[dict]:
    for r in records:
        yield atif_trajectory(r)


def atif_trajectory(record: dict) -> dict:
    turns = [t for t in record.get("turns") or [] if t.get("upstream_status") == 200]
    prompts = _prompt_ids_by_turn(record)
    messages = record["messages"]
    assistant_count = sum(1 for m in messages if m["role"] == "assistant")
    ids_line_up = len(turns) == assistant_count  # each answered model call is one assistant message
    steps: list[dict] = []
    answered = 0
    for index, message in enumerate(messages):
        role = message["role"]
        if role in ("system", "user"):
            steps.append({"step_id": len(steps) + 1, "source": role, "message": message["content"]})
        elif role == "assistant":
            step: dict = {
                "step_id": len(steps) + 1,
                "source": "agent",
                "model_name": record["model"],
                "message": message.get("content", ""),
            }
            if message.get("reasoning_content"):
                step["reasoning_content"] = message["reasoning_content"]
            calls = message.get("tool_calls") or []
            if calls:
                step["tool_calls"] = [
                    {
                        "tool_call_id": c["id"],
                        "function_name": c["function"]["name"],
                        "arguments": _object(c["function"]["arguments"]),
                    }
                    for c in calls
                ]
                results = [
                    {"source_call_id": m.get("tool_call_id"), "content": m.get("content", "")}
                    for m in _following_tool_results(messages, index)
                ]
                if results:
                    step["observation"] = {"results": results}
            if ids_line_up:
                turn = turns[answered]
                metrics = {
                    "prompt_tokens": turn.get("prompt_length") or None,
                    "completion_tokens": turn.get("completion_tokens"),
                }
                if turn.get("completion_token_ids"):
                    metrics["completion_token_ids"] = turn["completion_token_ids"]
                    metrics["logprobs"] = turn.get("logprobs") or []
                if turn["turn"] in prompts:
                    metrics["prompt_token_ids"] = prompts[turn["turn"]]
                step["metrics"] = {k: v for k, v in metrics.items() if v is not None}
                step["llm_call_count"] = 1  # each assistant message is one model call
            answered += 1
            steps.append(step)
    completion = sum(t.get("completion_tokens") or 0 for t in turns)
    prompt = sum(t.get("prompt_length") or 0 for t in turns)
    trajectory = {
        "schema_version": ATIF_VERSION,
        "session_id": record["id"],
        "trajectory_id": record["id"],
        "agent": {
            "name": record.get("agent") or "pi",
            "version": record.get("agent_version") or record.get("pi_version") or "unknown",
            "model_name": record["model"],
            "extra": {"harness": "pi-env", "mode": record["mode"], "endpoint": record["endpoint"]},
        },
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": prompt,
            "total_completion_tokens": completion,
            "total_steps": len(steps),
        },
        "extra": {
            "task_id": record["task_id"],
            "group_id": record["group_id"],
            "group_index": record["group_index"],
            "reward": record["reward"],
            "error_kind": record["error_kind"],
            "synthetic": record["synthetic"],
        },
    }
    if not ids_line_up and turns:
        trajectory["notes"] = (
            f"{len(turns)} answered model calls for {assistant_count} assistant messages: "
            "token ids left out rather than attached to the wrong step"
        )
    return trajectory


def _following_tool_results(messages: list[dict], index: int) -> Iterator[dict]:
    for message in messages[index + 1 :]:
        if message["role"] != "tool":
            return
        yield message


def _object(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return {"_raw": arguments}  # ATIF wants an object; keep what the model wrote
    return value if isinstance(value, dict) else {"_value": value}


def _prompt_ids_by_turn(record: dict) -> dict[int, list[int]]:
    """Each turn's prompt ids, cut from the training sequences (turns keep only their own
    completion ids: the prompts would repeat the whole history every turn)."""
    training = record.get("training") or {}
    completion_lengths = {t["turn"]: len(t.get("completion_token_ids") or []) for t in record.get("turns") or []}
    prompts: dict[int, list[int]] = {}
    for segment in training.get("segments") or []:
        ids, mask, position = segment["token_ids"], segment["loss_mask"], 0
        for turn in segment["turns"]:
            while position < len(mask) and mask[position] == 0:
                position += 1
            prompts[turn] = ids[:position]
            position += completion_lengths.get(turn, 0)
    return prompts
