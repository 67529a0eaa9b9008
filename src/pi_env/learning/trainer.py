"""The torch side of the learning run: SFT on rendered oracle conversations and GRPO on the
sessions' exact training traces, on the CPU.

Both score many sequences that share one long start (Pi's system prompt and tool schemas,
~1,500 tokens, about 90 % of a short rollout). `masked_logprobs` runs that shared prefix ONCE
per batch, with gradients: its keys/values become leaf tensors, each micro-batch of suffixes
attends to them and back-propagates into them, and the prefix's own graph is back-propagated
once at the end with the accumulated key/value gradients. Same loss and gradients as scoring
every row whole, at a fraction of the cost and memory.

Needs torch and transformers (`pi-env[learn]`, or the engine venv).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from pi_env.learning.rows import Row
from pi_env.training import build_training_trace


def load_policy(model_dir: str | Path):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    template = Path(model_dir) / "chat_template.jinja"
    if template.is_file():
        tokenizer.chat_template = template.read_text()
    return model, tokenizer


def train_top_layers(model, count: int | None) -> int:
    """Train only the top `count` decoder layers and the final norm (None or 0: everything).
    The frozen bottom needs no backward pass and no optimizer state, which on a shared 2-core
    CPU is the difference between a run that fits and one that does not. The embeddings (tied
    to the LM head in SmolLM2) stay frozen with the bottom. Returns the trainable parameters."""
    if count:
        layers = model.get_decoder().layers
        if not 0 < count <= len(layers):
            raise ValueError(f"train_layers: {count}; the model has {len(layers)} decoder layers")
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        for module in [*layers[len(layers) - count :], model.get_decoder().norm]:
            for parameter in module.parameters():
                parameter.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def save_policy(model, tokenizer, source_dir: str | Path, out_dir: str | Path) -> Path:
    """A directory vLLM serves: weights, config, tokenizer, the engine's chat template. Written
    next to the target and renamed, so a killed save never leaves a half checkpoint."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    for name in ("chat_template.jinja", "generation_config.json"):
        if (Path(source_dir) / name).is_file():
            shutil.copyfile(Path(source_dir) / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------
# Rendering SFT conversations the way the engine sees them


def _template_messages(messages: list[dict]) -> list[dict]:
    """Tool-call arguments as dicts, content parts as one string (what vLLM does before templating)."""
    out = json.loads(json.dumps(messages))
    for message in out:
        if isinstance(message.get("content"), list):
            message["content"] = "".join(p.get("text", "") for p in message["content"] if isinstance(p, dict))
        message["content"] = message.get("content") or ""
        for call in message.get("tool_calls") or []:
            arguments = call.get("function", {}).get("arguments")
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments) if arguments else {}
                except json.JSONDecodeError:
                    pass  # left a string: the template writes it as the model wrote it
    return out


@dataclass
class _Turn:
    turn: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    per_token_logps: list[float | None]


def render_sft_rows(messages: list[dict], tools: list[dict], tokenizer) -> list[Row]:
    """A conversation as the engine would have seen it, turn by turn: each assistant message's
    prompt is the chat template's rendering of what came before (+ the generation prompt), its
    completion the model's own text tokenised alone plus EOS, as a sampled completion is. The
    turns are merged by `pi_env.training.build_training_trace`, the same code that merges a live
    session's turns, so SFT and RL train on sequences of the same shape."""
    messages = _template_messages(messages)
    eos = tokenizer.eos_token_id
    turns: list[_Turn] = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[:index], tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        full = tokenizer.apply_chat_template(messages[: index + 1], tools=tools or None, tokenize=False)
        if full.startswith(prompt):
            completion = full[len(prompt) :]
            completion = completion[: completion.rindex(tokenizer.eos_token)]
        else:  # an empty answer renders without the generation prompt's newline
            completion = ""
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
        turns.append(_Turn(len(turns), prompt_ids, completion_ids, [None] * len(completion_ids)))
    trace = build_training_trace(turns)
    return [Row(segment.token_ids, segment.loss_mask) for segment in trace.segments]


# ---------------------------------------------------------------------------------------------
# Scoring with a shared prefix


def _shared_prefix(rows: Sequence[Row]) -> int:
    """Tokens every row starts with, stopping before the first trained position of any row (a
    trained token's logprob comes from the position before it, which must be in the suffix)."""
    first = rows[0].token_ids
    length = min(len(r.token_ids) for r in rows)
    for row in rows:
        trained = row.loss_mask.index(1) if 1 in row.loss_mask else len(row.loss_mask)
        length = min(length, trained - 1)
        for i in range(length):
            if row.token_ids[i] != first[i]:
                length = i
                break
    return max(length, 0)


def backward_rows(
    model,
    rows: Sequence[Row],
    loss_fn: Callable,
    *,
    micro_batch: int = 2,
    normaliser: float = 1.0,
    temperature: float = 1.0,
) -> dict:
    """Score `rows` with gradients (shared prefix once), call `loss_fn(row, logprobs)` per row
    (logprobs of the row's trained tokens, in order) for a scalar, back-propagate
    sum(loss) / normaliser. Returns {"loss": ..., "prefix_tokens": ..., "tokens": ...}.
    `temperature`: the logits are divided by it, so the logprobs are those of the distribution
    the engine sampled from at that temperature (what its processed logprobs report). Under
    torch.no_grad() it only scores (nothing to back-propagate)."""
    prefix_len = _shared_prefix(rows)
    lm_head, body = model.get_output_embeddings(), model.get_decoder()
    total, tokens = 0.0, 0
    leaves: list[torch.Tensor] = []
    prefix_out: list[torch.Tensor] = []
    if prefix_len:
        prefix_cache = DynamicCache()
        body(input_ids=torch.tensor([rows[0].token_ids[:prefix_len]]), past_key_values=prefix_cache, use_cache=True)
        for layer in range(len(prefix_cache)):
            key, value = _layer_kv(prefix_cache, layer)
            prefix_out += [key, value]
            leaves += [
                key.detach().requires_grad_(key.requires_grad),
                value.detach().requires_grad_(value.requires_grad),
            ]
    for start in range(0, len(rows), micro_batch):
        chunk = rows[start : start + micro_batch]
        width = max(len(r.token_ids) for r in chunk) - prefix_len
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), prefix_len + width, dtype=torch.long)
        attention[:, :prefix_len] = 1
        for b, row in enumerate(chunk):
            suffix = row.token_ids[prefix_len:]
            ids[b, : len(suffix)] = torch.tensor(suffix)
            attention[b, prefix_len : prefix_len + len(suffix)] = 1
        cache: DynamicCache | None = None
        if prefix_len:
            cache = DynamicCache()
            for layer in range(len(leaves) // 2):
                key, value = leaves[2 * layer], leaves[2 * layer + 1]
                cache.update(key.expand(len(chunk), -1, -1, -1), value.expand(len(chunk), -1, -1, -1), layer)
        positions = torch.arange(prefix_len, prefix_len + width).unsqueeze(0).expand(len(chunk), -1)
        hidden = body(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
        ).last_hidden_state
        loss = hidden.new_zeros(())
        for b, row in enumerate(chunk):
            targets = [t for t in range(prefix_len, len(row.token_ids)) if row.loss_mask[t]]
            if not targets:
                continue
            states = hidden[b, [t - 1 - prefix_len for t in targets]]
            logprobs = torch.log_softmax(lm_head(states).float() / temperature, -1)
            picked = logprobs.gather(1, torch.tensor([[row.token_ids[t]] for t in targets]))[:, 0]
            loss = loss + loss_fn(row, picked, targets)
            tokens += len(targets)
        if loss.requires_grad:  # a micro-batch with no trained token has nothing to back-propagate
            (loss / normaliser).backward()
        total += float(loss.detach())
    if prefix_len:
        pairs = [
            (out, leaf.grad) for out, leaf in zip(prefix_out, leaves) if out.requires_grad and leaf.grad is not None
        ]
        if pairs:  # frozen bottom layers' keys/values have no graph to go back through
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    return {"loss": total / normaliser, "prefix_tokens": prefix_len, "tokens": tokens}


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


# ---------------------------------------------------------------------------------------------
# SFT


def sft_train(
    model,
    rows: list[Row],
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int = 0,
    micro_batch: int = 2,
    log: Callable[[dict], None] = print,
) -> list[dict]:
    """Full fine-tune, AdamW, linear warm-up then cosine; loss = mean NLL over trained tokens."""
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(rows) / batch_size)
    total_steps = max(1, steps_per_epoch * epochs)
    optimizer = torch.optim.AdamW(trainable(model), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, total_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps))))
    )
    model.train()
    history = []
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(rows), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            batch = [rows[i] for i in order[start : start + batch_size]]
            started = time.monotonic()
            trained = sum(sum(r.loss_mask) for r in batch)
            stats = backward_rows(
                model, batch, lambda row, logprobs, _: -logprobs.sum(), micro_batch=micro_batch, normaliser=trained
            )
            torch.nn.utils.clip_grad_norm_(trainable(model), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            entry = {
                "step": step,
                "epoch": epoch,
                "loss": round(stats["loss"], 5),
                "rows": len(batch),
                "tokens": sum(len(r.token_ids) for r in batch),
                "trained_tokens": trained,
                "prefix_tokens": stats["prefix_tokens"],
                "wall_s": round(time.monotonic() - started, 2),
            }
            history.append(entry)
            log(entry)
    model.eval()
    return history


# ---------------------------------------------------------------------------------------------
# GRPO


def _checked_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(
            f"temperature {temperature}: RL samples and scores at a temperature > 0 "
            "(greedy decoding has no sampling distribution to train)"
        )
    return temperature


def _update(
    model, optimizer, rows: list[Row], loss_fn: Callable, *, micro_batch: int, normaliser: float, temperature: float
) -> tuple[dict, float]:
    """Back-propagate `loss_fn` over `rows` at `temperature`, clip, step: one optimizer update."""
    model.train()
    stats = backward_rows(
        model,
        rows,
        loss_fn,
        micro_batch=micro_batch,
        normaliser=normaliser,
        temperature=_checked_temperature(temperature),
    )
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable(model), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return stats, grad_norm


def grpo_step(
    model, optimizer, rows: list[Row], *, clip_eps: float = 0.2, micro_batch: int = 2, temperature: float = 1.0
) -> dict:
    """One policy-gradient step on rows carrying advantages (`weight`) and the engine's sampled
    logprobs: PPO-clipped ratio objective, token-level mean (DAPO/TRL's `loss_type="dapo"`
    normalisation), no reference-model KL term (beta = 0, TRL's default); the statistics of
    the ratio new/old and the k3 estimate of KL(old || new) on the sampled tokens are returned.
    `temperature`: the one the rollouts were sampled at (the engine's logprobs are of that
    distribution: vLLM's `--logprobs-mode processed_logprobs`). The result's `_before` holds the
    trainer's own logprobs before the step (for `kl_after`)."""
    rows = [r for r in rows if r.weight != 0.0 and sum(r.loss_mask) != 0]
    if not rows:
        return {"rows": 0, "loss": 0.0, "tokens": 0, "skipped": "every group had equal rewards"}
    trained = sum(sum(r.loss_mask) for r in rows)
    ratios: list[torch.Tensor] = []
    before: list[torch.Tensor] = []
    missing = 0

    def loss_fn(row: Row, logprobs: torch.Tensor, targets: list[int]) -> torch.Tensor:
        nonlocal missing
        assert row.old_logprobs is not None, "GRPO rows carry the engine's sampled logprobs (only SFT rows lack them)"
        old = [row.old_logprobs[t] for t in targets]
        known = torch.tensor([o is not None for o in old])
        missing += int((~known).sum())
        old_t = torch.tensor([o if o is not None else 0.0 for o in old])
        # Unknown old logprob (the engine gave none): on-policy, ratio 1 (old = current, detached).
        old_t = torch.where(known, old_t, logprobs.detach())
        ratio = torch.exp(logprobs - old_t)
        ratios.append(ratio.detach())
        before.append(logprobs.detach())
        unclipped, clipped = ratio * row.weight, ratio.clamp(1 - clip_eps, 1 + clip_eps) * row.weight
        return -torch.minimum(unclipped, clipped).sum()

    stats, grad_norm = _update(
        model, optimizer, rows, loss_fn, micro_batch=micro_batch, normaliser=trained, temperature=temperature
    )
    ratio = torch.cat(ratios)
    log_ratio = ratio.log()
    return {
        "rows": len(rows),
        "loss": round(stats["loss"], 6),
        "tokens": trained,
        "prefix_tokens": stats["prefix_tokens"],
        "grad_norm": round(grad_norm, 4),
        "ratio_mean": round(float(ratio.mean()), 5),
        "ratio_min": round(float(ratio.min()), 5),
        "ratio_max": round(float(ratio.max()), 5),
        "clip_fraction": round(float(((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float().mean()), 5),
        "kl_old_new_k3": round(float((ratio - 1 - log_ratio).mean()), 6),
        "old_logprobs_missing": missing,
        "_rows": rows,
        "_before": before,
    }


def nll_step(model, optimizer, rows: list[Row], *, micro_batch: int = 2, temperature: float = 1.0) -> dict:
    """One step of token-mean NLL on `rows` (rejection sampling: the chosen rollouts' own
    tokens), scored at the sampling temperature like `grpo_step`."""
    rows = [r for r in rows if sum(r.loss_mask)]
    if not rows:
        return {"rows": 0, "loss": 0.0, "tokens": 0, "skipped": "no passing rollout in a mixed group"}
    trained = sum(sum(r.loss_mask) for r in rows)
    before: list[torch.Tensor] = []

    def loss_fn(row: Row, logprobs: torch.Tensor, targets: list[int]) -> torch.Tensor:
        before.append(logprobs.detach())
        return -logprobs.sum()

    stats, grad_norm = _update(
        model, optimizer, rows, loss_fn, micro_batch=micro_batch, normaliser=trained, temperature=temperature
    )
    return {
        "rows": len(rows),
        "loss": round(stats["loss"], 6),
        "tokens": trained,
        "prefix_tokens": stats["prefix_tokens"],
        "grad_norm": round(grad_norm, 4),
        "_rows": rows,
        "_before": before,
    }


def kl_after(model, update: dict, *, micro_batch: int = 2, temperature: float = 1.0) -> float:
    """KL(before || after) of the step `update` made (k3 estimate on the tokens it trained,
    which were sampled from the policy before it): the step's size in distribution, whatever
    the learning rate and optimizer state turned into. One forward pass, no gradients."""
    after: list[torch.Tensor] = []

    def score(row: Row, logprobs: torch.Tensor, targets: list[int]) -> torch.Tensor:
        after.append(logprobs)
        return logprobs.new_zeros(())

    with torch.no_grad():
        backward_rows(model, update["_rows"], score, micro_batch=micro_batch, temperature=temperature)
    log_ratio = torch.cat(after) - torch.cat(update["_before"])
    return float((log_ratio.exp() - 1 - log_ratio).mean())


def guarded_step(
    model,
    optimizer,
    step: Callable[[], dict],
    *,
    kl_soft: float,
    kl_hard: float,
    micro_batch: int = 2,
    temperature: float = 1.0,
) -> dict:
    """Run `step` (one `grpo_step` or `nll_step` on `model`/`optimizer`) under the KL guard:
    measure KL(before || after) of the update on the tokens it trained; above `kl_hard` put the
    weights and the optimizer's state back as they were ("rolled_back"), above `kl_soft` keep
    it but say the lr should be lowered ("lr_lowered"), else "ok". Returns the step's statistics
    (private `_` entries dropped) with `kl_after` and `kl_guard`."""
    saved = snapshot(model, optimizer)
    update = step()
    public = {k: v for k, v in update.items() if not k.startswith("_")}
    if not update["rows"]:
        return {**public, "kl_after": None, "kl_guard": "ok"}
    started = time.monotonic()
    kl = kl_after(model, update, micro_batch=micro_batch, temperature=temperature)
    guard = "ok"
    if kl > kl_hard:
        restore(model, optimizer, saved)
        guard = "rolled_back"
    elif kl > kl_soft:
        guard = "lr_lowered"
    return {**public, "kl_after": round(kl, 6), "kl_guard": guard, "guard_s": round(time.monotonic() - started, 1)}


def snapshot(model, optimizer) -> dict:
    """The trainable weights and the optimizer's state, in memory (what `restore` puts back)."""
    return {
        "weights": [p.detach().clone() for p in trainable(model)],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
    }


def restore(model, optimizer, saved: dict) -> None:
    with torch.no_grad():
        for parameter, value in zip(trainable(model), saved["weights"]):
            parameter.copy_(value)
    # load_state_dict may keep the given tensors: a copy, so the snapshot stays as it was
    optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
