"""The learning run's stages, each resumable from its outputs in one run directory:

    tasks     tasks/train.jsonl, tasks/eval.jsonl, tasks/rl.jsonl (pi_env.workspace.coding,
              pairwise disjoint, checked)
    oracle    oracle/ (pi-env collect of the train split, oracle endpoint) + oracle/exports/sft.jsonl
    eval      eval_<stage>/ (pi-env collect of the eval split against vLLM serving a checkpoint)
    sft       sft/policy (checkpoint) + sft/summary.json
    rl        rl/step_<k>/ (group rollouts), rl/policy (latest checkpoint), rl/steps.jsonl
    report    report.json + learning_curve.png

Every rollout is the real Pi in the real sandbox; eval and RL generation go through the
transparent proxy to a vLLM (CPU) engine started on the stage's checkpoint and stopped after;
RL's engine serves the current weights: each GRPO step's checkpoint is loaded into it in place
(`Engine.load`, in the next step's time breakdown). The trainer (pi_env.learning.trainer) needs torch and
transformers; the other stages only pi-env.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pi_env.config import PiConfig
from pi_env.task import PiTask

ROOT = Path(__file__).resolve().parents[3]
STAGES = ("tasks", "oracle", "eval_base", "sft", "eval_sft", "rl", "eval_rl", "report")


class LeakError(RuntimeError):
    """An eval task is also a training instance: the eval would not be held out."""


@dataclass
class LearnConfig:
    run_dir: Path
    base_model: Path = Path(os.environ.get("PI_ENV_ENGINES_DIR") or ROOT / ".engines") / "models" / "smollm2-135m-instruct"
    seed: int = 0
    n_train: int = 200
    n_eval: int = 50
    # RL draws from its own split of fresh instances: the SFT data memorised the train split,
    # so its groups there are mostly all-solved and teach nothing. 0: RL draws from train.
    n_rl: int = 200
    families: list[str] | None = None
    # rollouts
    concurrency: int = 4
    max_turns: int = 8
    max_tokens: int = 256  # per model call (the longest oracle call is ~200 tokens)
    agent_timeout_s: float = 600  # generous: on a loaded machine generation is slow; budgets are max_turns and max_tokens
    eval_temperature: float = 0.0
    # Token-in (docs/token-in.md): the gateway renders and bridges ids, so a rollout is one
    # training sequence; off: the engine's own ids through plain transparent_proxy capture.
    token_in: bool = True
    engine_port: int = 8031
    engine_timeout_s: int = 1200  # vLLM's start-up, which on a loaded 2-core machine takes minutes
    # SFT
    sft_epochs: int = 1
    sft_batch: int = 8
    sft_lr: float = 2e-4
    sft_limit: int | None = None  # use only the first N oracle conversations (default: all)
    eval_limit: int | None = 20  # evaluate only the first N eval tasks (families alternate; 0: all of them)
    # RL
    rl_steps: int = 6
    rl_tasks_per_step: int = 4
    group_size: int = 4
    rl_lr: float = 2e-5  # 5e-5 with two updates a batch collapsed the policy in run r4 (docs/learning.md)
    rl_updates: int = 2  # optimizer steps per batch of rollouts (PPO epochs; the first is on-policy)
    rl_temperature: float = 1.0
    clip_eps: float = 0.2
    micro_batch: int = 2
    train_layers: int = 0  # train only the top N decoder layers (0: all); see trainer.train_top_layers
    extra: dict = field(default_factory=dict)

    def path(self, *parts: str) -> Path:
        return Path(self.run_dir, *parts)


def log(message: str) -> None:
    print(f"[learn {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# Tasks and the held-out check


def read_tasks(path: Path) -> list[PiTask]:
    return [PiTask.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


def stage_tasks(cfg: LearnConfig) -> dict:
    from pi_env.workspace.coding import generate_coding_tasks, make_coding_splits
    from pi_env.workspace.tasks import check_disjoint

    paths = {name: cfg.path("tasks", f"{name}.jsonl") for name in ("train", "eval", "rl")}
    if paths["train"].is_file() and paths["eval"].is_file():
        train, evaluation = read_tasks(paths["train"]), read_tasks(paths["eval"])
    else:
        train, evaluation = make_coding_splits(cfg.n_train, cfg.n_eval, seed=cfg.seed, families=cfg.families)
        _write_tasks(paths["train"], train)
        _write_tasks(paths["eval"], evaluation)
    # Made on its own (also for a run directory from before it existed): train and eval stay as they are.
    if paths["rl"].is_file():
        fresh = read_tasks(paths["rl"])
    else:
        fresh = generate_coding_tasks(cfg.n_rl, split="rl", seed=cfg.seed, families=cfg.families,
                                      exclude={task.digest() for task in train + evaluation})
        _write_tasks(paths["rl"], fresh)
    check_disjoint(train=train, eval=evaluation, rl=fresh)
    families: dict[str, int] = {}
    for task in evaluation:
        families[task.metadata["family"]] = families.get(task.metadata["family"], 0) + 1
    return {"train": len(train), "eval": len(evaluation), "rl": len(fresh), "eval_families": families}


def _write_tasks(path: Path, tasks: list[PiTask]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(task.model_dump_json() + "\n" for task in tasks))


def training_instances(cfg: LearnConfig) -> dict[str, str]:
    """Digest -> task id of every task whose rollouts the weights were trained on: what the SFT
    data and the RL steps actually used (read from their stores, not from the plan)."""
    from pi_env.collect.store import read_records

    known = {task.task_id: task for path in cfg.path("tasks").glob("*.jsonl") for task in read_tasks(path)}
    used: set[str] = set()
    sft = cfg.path("oracle", "exports", "sft.jsonl")
    if sft.is_file():
        used |= {json.loads(line)["task_id"] for line in sft.read_text().splitlines() if line.strip()}
    for step_dir in sorted(cfg.path("rl").glob("step_*")):
        used |= {r["task_id"] for r in read_records(step_dir)}
    missing = sorted(used - set(known))
    if missing:
        raise LeakError(f"trained on task ids that are in no task file of {cfg.run_dir}: {missing[:5]}; "
                        f"cannot prove the eval is held out")
    return {known[task_id].digest(): task_id for task_id in used}


def check_held_out(cfg: LearnConfig, eval_tasks: list[PiTask]) -> int:
    """Raise LeakError if any eval task (by content digest, whatever its id) was trained on."""
    trained = training_instances(cfg)
    leaks = [(task.task_id, trained[task.digest()]) for task in eval_tasks if task.digest() in trained]
    if leaks:
        raise LeakError(f"{len(leaks)} eval task(s) were trained on, e.g. eval {leaks[0][0]!r} = trained "
                        f"{leaks[0][1]!r}; the eval split must be held out")
    return len(trained)


# ---------------------------------------------------------------------------------------------
# Engine


class Engine:
    """vLLM serving one checkpoint on 127.0.0.1 (scripts/engines/serve_vllm.sh), stopped by PID.
    `load` swaps another checkpoint of the same model in without a restart."""

    WORKER_EXTENSION = "pi_env.learning.engine_reload.WeightReload"

    def __init__(self, model_dir: Path, port: int, log_path: Path, timeout_s: int = 1200):
        self.model_dir, self.port, self.log_path, self.timeout_s = Path(model_dir), port, log_path, timeout_s
        self.pid: int | None = None
        self.start_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "Engine":
        started = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The dev endpoints (/collective_rpc, /reset_prefix_cache) are what `load` calls; the
        # engine binds 127.0.0.1, which no sandboxed agent can reach.
        env = {**os.environ, "ENGINE_MODEL_NAME": "policy", "VLLM_SERVER_DEV_MODE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
        out = subprocess.run(["bash", str(ROOT / "scripts" / "engines" / "serve_vllm.sh"), "--model-dir",
                              str(self.model_dir), "--port", str(self.port), "--log", str(self.log_path),
                              "--timeout", str(self.timeout_s), "--", "--worker-extension-cls", self.WORKER_EXTENSION],
                             stdout=subprocess.PIPE, text=True, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"vLLM did not start on {self.model_dir} (log {self.log_path})")
        self.pid = int(out.stdout.strip().splitlines()[-1])
        self.start_s = time.monotonic() - started
        return self

    def load(self, model_dir: Path) -> float:
        """Serve `model_dir`'s weights from now on (same architecture and tokenizer): they are
        loaded in place and the prefix cache, computed with the old ones, is dropped. Seconds taken."""
        started = time.monotonic()
        root = f"http://127.0.0.1:{self.port}"
        for path, body in (("/collective_rpc", {"method": "load_checkpoint", "args": [str(model_dir)]}),
                           ("/reset_prefix_cache", None)):
            request = urllib.request.Request(root + path, data=json.dumps(body).encode() if body else b"",
                                             headers={"Content-Type": "application/json"}, method="POST")
            try:
                urllib.request.urlopen(request, timeout=self.timeout_s).read()
            except urllib.error.HTTPError as error:
                raise RuntimeError(f"vLLM could not load {model_dir}: {path} answered {error.code} "
                                   f"{error.read()[:500]!r} (log {self.log_path})") from None
        self.model_dir = Path(model_dir)
        return time.monotonic() - started

    def __exit__(self, *exc) -> None:
        if self.pid is not None:
            subprocess.run(["bash", str(ROOT / "scripts" / "engines" / "stop_engine.sh"), str(self.pid)], check=False)
            self.pid = None


def rollout_config(cfg: LearnConfig, engine: Engine, temperature: float) -> PiConfig:
    token_in = {"proxy_token_in": True, "proxy_renderer": "chatml-hermes",
                "proxy_tokenizer": str(engine.model_dir)} if cfg.token_in else {}
    return PiConfig(endpoint="vllm", base_url=engine.base_url, model="policy", api_key="none",
                    mode="transparent_proxy", max_turns=cfg.max_turns, proxy_max_tokens_cap=cfg.max_tokens,
                    agent_timeout_s=cfg.agent_timeout_s, proxy_return_token_ids=True,
                    proxy_sampling={"temperature": temperature, "top_p": 1.0}, **token_in)


def collect(tasks: list[PiTask], out: Path, config: PiConfig, *, group_size: int, concurrency: int):
    from pi_env.collect import CollectRunner
    from pi_env.collect.store import read_records

    started = time.monotonic()
    summary = CollectRunner(tasks, out, config, group_size=group_size, concurrency=concurrency).run()
    if not summary.complete:
        raise RuntimeError(f"collect into {out} did not finish: {summary.counts}")
    return list(read_records(out)), time.monotonic() - started


def score_records(records: list[dict]) -> dict:
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    families: dict[str, list[float]] = {}
    for r in records:
        families.setdefault(r["task_id"].split("-", 3)[-1], []).append(r.get("reward") or 0.0)
    passed = sum(1 for r in rewards if r >= 1.0)
    return {"count": len(records), "scored": len(rewards), "passed": passed,
            "pass_rate": round(passed / len(records), 4) if records else None,
            # unscored (infra) rollouts are left out of the mean, never counted as 0
            "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
            "unscored": len(records) - len(rewards),
            "tool_calls": sum(1 for r in records for m in r["messages"] if m["role"] == "assistant" and m.get("tool_calls")),
            "per_family_pass": {f: f"{sum(1 for v in vs if v >= 1.0)}/{len(vs)}" for f, vs in sorted(families.items())}}


# ---------------------------------------------------------------------------------------------
# Stages


def stage_oracle(cfg: LearnConfig) -> dict:
    from pi_env.collect.export import export

    done = _read_json(cfg.path("oracle", "summary.json"))
    if done:
        return done
    train = read_tasks(cfg.path("tasks", "train.jsonl"))
    records, wall = collect(train, cfg.path("oracle"), PiConfig(endpoint="oracle", mode="black_box"),
                            group_size=1, concurrency=cfg.concurrency)
    scores = score_records(records)
    if scores["passed"] != len(train):
        failed = [r["task_id"] for r in records if (r.get("reward") or 0) < 1][:5]
        raise RuntimeError(f"the oracle must solve every train task; it failed {failed}")
    path, rows, _ = export(cfg.path("oracle"), "sft")
    summary = {"rollouts": len(records), "sft_rows": rows, "sft_path": str(path), "wall_s": round(wall, 1)}
    _write_json(cfg.path("oracle", "summary.json"), summary)
    return summary


def stage_eval(cfg: LearnConfig, name: str, model_dir: Path) -> dict:
    done = _read_json(cfg.path(f"eval_{name}", "summary.json"))
    if done:
        return done
    evaluation = read_tasks(cfg.path("tasks", "eval.jsonl"))[:cfg.eval_limit or None]
    trained = check_held_out(cfg, evaluation)
    started = time.monotonic()
    with Engine(model_dir, cfg.engine_port, cfg.path("logs", f"vllm-eval_{name}.log"), cfg.engine_timeout_s) as engine:
        records, wall = collect(evaluation, cfg.path(f"eval_{name}", "rollouts"),
                                rollout_config(cfg, engine, cfg.eval_temperature), group_size=1,
                                concurrency=cfg.concurrency)
        engine_start = engine.start_s
    summary = {"stage": name, "model_dir": str(model_dir), **score_records(records),
               "temperature": cfg.eval_temperature, "held_out_checked_against": trained,
               "engine_start_s": round(engine_start, 1), "rollouts_s": round(wall, 1),
               "wall_s": round(time.monotonic() - started, 1)}
    _write_json(cfg.path(f"eval_{name}", "summary.json"), summary)
    log(f"eval {name}: {summary['passed']}/{summary['count']} passed, mean reward {summary['mean_reward']}")
    return summary


def stage_sft(cfg: LearnConfig) -> dict:
    done = _read_json(cfg.path("sft", "summary.json"))
    if done:
        return done
    import torch

    from pi_env.learning import trainer

    torch.manual_seed(cfg.seed)
    started = time.monotonic()
    model, tokenizer = trainer.load_policy(cfg.base_model)
    trained_parameters = trainer.train_top_layers(model, cfg.train_layers)
    rows = []
    data = [json.loads(line) for line in cfg.path("oracle", "exports", "sft.jsonl").read_text().splitlines() if line.strip()]
    data = data[:cfg.sft_limit] if cfg.sft_limit else data
    for item in data:
        rows += trainer.render_sft_rows(item["messages"], json.loads(item["tools"]), tokenizer)
    log(f"sft: {len(data)} conversations -> {len(rows)} rows, {sum(len(r.token_ids) for r in rows)} tokens, "
        f"{sum(sum(r.loss_mask) for r in rows)} trained")
    history_path = cfg.path("sft", "history.jsonl")
    history_path.parent.mkdir(parents=True, exist_ok=True)
    with history_path.open("w") as handle:
        def note(entry: dict) -> None:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            log(f"sft step {entry['step']}: loss {entry['loss']:.4f} ({entry['wall_s']} s)")
        history = trainer.sft_train(model, rows, epochs=cfg.sft_epochs, batch_size=cfg.sft_batch,
                                    learning_rate=cfg.sft_lr, seed=cfg.seed, micro_batch=cfg.micro_batch, log=note)
    trainer.save_policy(model, tokenizer, cfg.base_model, cfg.path("sft", "policy"))
    summary = {"conversations": len(data), "rows": len(rows), "steps": len(history),
               "trained_parameters": trained_parameters, "train_layers": cfg.train_layers or "all",
               "loss_first": history[0]["loss"] if history else None,
               "loss_last": history[-1]["loss"] if history else None,
               "train_s": round(sum(h["wall_s"] for h in history), 1), "wall_s": round(time.monotonic() - started, 1)}
    _write_json(cfg.path("sft", "summary.json"), summary)
    return summary


def rl_tasks(cfg: LearnConfig, step: int, history: list[dict]) -> list[PiTask]:
    """The step's tasks: drawn without replacement from the RL split (the train split if it is
    empty), each draw picking a family first, weighted by how often that family failed in the
    earlier steps' rollouts (`history`: their records), so groups the policy always solves
    (all rewards equal, no GRPO signal) are drawn less. Deterministic for (seed, step, history)."""
    pool = read_tasks(cfg.path("tasks", "rl.jsonl")) if cfg.path("tasks", "rl.jsonl").is_file() else []
    pool = pool or read_tasks(cfg.path("tasks", "train.jsonl"))
    used = {record["task_id"] for record in history}
    by_family: dict[str, list[PiTask]] = {}
    for task in pool:
        if task.task_id not in used:
            by_family.setdefault(task.metadata["family"], []).append(task)
    rewards: dict[str, list[float]] = {}
    for record in history:
        if record.get("reward") is not None:
            rewards.setdefault(record["task_id"].rsplit("-", 1)[-1], []).append(record["reward"])
    rng = random.Random(f"pi-env-learn-rl/{cfg.seed}/{step}")
    chosen: list[PiTask] = []
    while len(chosen) < cfg.rl_tasks_per_step and any(by_family.values()):
        families = sorted(f for f, tasks in by_family.items() if tasks)
        # A family never tried weighs 1; one always solved 0.25 (still drawn: it can regress).
        weights = [1.0 - 0.75 * _mean(rewards.get(f), default=0.0) for f in families]
        tasks = by_family[rng.choices(families, weights)[0]]
        chosen.append(tasks.pop(rng.randrange(len(tasks))))
    return chosen


def _mean(values: list[float] | None, default: float) -> float:
    return sum(values) / len(values) if values else default


def stage_rl(cfg: LearnConfig) -> dict:
    import torch

    from pi_env.learning import trainer

    steps_path = cfg.path("rl", "steps.jsonl")
    steps = _jsonl(steps_path)
    policy_dir = cfg.path("rl", "policy")
    if len(steps) >= cfg.rl_steps:
        if not policy_dir.is_dir():
            raise RuntimeError(f"{steps_path} records {len(steps)} finished steps but {policy_dir} is missing: "
                               "remove the steps file (RL starts again from the SFT checkpoint)")
        return {"steps": len(steps)}
    source = policy_dir if steps else cfg.path("sft", "policy")
    torch.manual_seed(cfg.seed + len(steps))
    model, tokenizer = trainer.load_policy(source)
    trainer.train_top_layers(model, cfg.train_layers)
    # Resuming starts Adam's moments afresh (the weights are the last finished step's).
    optimizer = torch.optim.AdamW(trainer.trainable(model), lr=cfg.rl_lr, betas=(0.9, 0.99), weight_decay=0.0)
    # One engine for the whole stage: after each GRPO step it swaps the new weights in (Engine.load).
    with Engine(source, cfg.engine_port, cfg.path("logs", "vllm-rl.log"), cfg.engine_timeout_s) as engine:
        engine_time = {"engine_start": round(engine.start_s, 1)}
        for step in range(len(steps), cfg.rl_steps):
            entry = _rl_step(cfg, step, engine, model, tokenizer, optimizer, engine_time)
            with steps_path.open("a") as handle:
                handle.write(json.dumps(entry) + "\n")
            steps.append(entry)
            log(f"rl step {step}: mean reward {entry['mean_reward']}, loss {entry['loss']}, "
                f"ratio {entry.get('ratio_mean')}, {entry['time_s']}")
            if step + 1 < cfg.rl_steps:
                engine_time = {"weights_load": round(engine.load(policy_dir), 1)}
    return {"steps": len(steps)}


def _rl_step(cfg: LearnConfig, step: int, engine: Engine, model, tokenizer, optimizer, engine_time: dict) -> dict:
    """One GRPO step: group rollouts of the step's tasks against the engine (serving the current
    weights), `rl_updates` policy-gradient updates on their exact traces, the checkpoint saved.
    `engine_time`: the engine's start or weight load before this step, counted in its total."""
    from pi_env.collect.store import read_records
    from pi_env.learning import trainer
    from pi_env.learning.rows import rl_rows

    started = time.monotonic() - sum(engine_time.values())
    tasks = rl_tasks(cfg, step, [r for k in range(step) for r in read_records(cfg.path("rl", f"step_{k}"))])
    records, rollouts_s = collect(tasks, cfg.path("rl", f"step_{step}"), rollout_config(cfg, engine, cfg.rl_temperature),
                                  group_size=cfg.group_size, concurrency=cfg.concurrency)
    rows = rl_rows(records)
    train_started = time.monotonic()
    # The first update is on-policy: its ratio new/old ~ 1 checks that the engine served the
    # trainer's weights. Later ones reuse the batch under the clip (PPO epochs).
    updates = [trainer.grpo_step(model, optimizer, rows, clip_eps=cfg.clip_eps, micro_batch=cfg.micro_batch)
               for _ in range(cfg.rl_updates)]
    stats = {**updates[0], "updates": [{k: u[k] for k in _UPDATE_STATS if k in u} for u in updates]}
    train_s = time.monotonic() - train_started
    save_started = time.monotonic()
    trainer.save_policy(model, tokenizer, cfg.base_model, cfg.path("rl", "policy"))
    save_s = time.monotonic() - save_started
    generation = sum(t.get("latency_s") or 0.0 for r in records for t in r.get("turns") or [])
    rollout_walls = sum(r.get("wall_s") or 0.0 for r in records)
    scores = score_records(records)
    return {"step": step, "tasks": [t.task_id for t in tasks], "mean_reward": scores["mean_reward"],
            "pass_rate": scores["pass_rate"], "unscored": scores["unscored"],
            "groups_with_signal": len({r["group_id"] for r in records}) - _flat_groups(records),
            "rows_per_rollout": [len((r.get("training") or {}).get("segments") or []) for r in records],
            "generated_tokens": sum(t.get("completion_tokens") or 0 for r in records for t in r.get("turns") or []),
            **{k: v for k, v in stats.items() if k != "rows"}, "trained_rows": stats["rows"],
            "time_s": {**engine_time, "rollouts": round(rollouts_s, 1), "generation_summed": round(generation, 1),
                       "pi_and_sandbox_summed": round(rollout_walls - generation, 1),
                       "train": round(train_s, 1), "save": round(save_s, 1),
                       "total": round(time.monotonic() - started, 1)}}


_UPDATE_STATS = ("loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_fraction", "kl_old_new_k3")


def _flat_groups(records: list[dict]) -> int:
    groups: dict[str, set] = {}
    for r in records:
        groups.setdefault(r["group_id"], set()).add(r.get("reward"))
    return sum(1 for rewards in groups.values() if len(rewards) == 1)


# ---------------------------------------------------------------------------------------------
# Report


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def stage_status(cfg: LearnConfig) -> dict[str, str]:
    """done / in progress / not started, per stage, from the run directory's outputs."""
    done = {"tasks": cfg.path("tasks", "rl.jsonl"), "oracle": cfg.path("oracle", "summary.json"),
            "eval_base": cfg.path("eval_base", "summary.json"), "sft": cfg.path("sft", "summary.json"),
            "eval_sft": cfg.path("eval_sft", "summary.json"), "eval_rl": cfg.path("eval_rl", "summary.json")}
    started = {"oracle": cfg.path("oracle"), "eval_base": cfg.path("eval_base"), "sft": cfg.path("sft"),
               "eval_sft": cfg.path("eval_sft"), "rl": cfg.path("rl"), "eval_rl": cfg.path("eval_rl")}
    status = {}
    for stage in STAGES[:-1]:
        if stage == "rl":
            finished = len(_jsonl(cfg.path("rl", "steps.jsonl")))
            status[stage] = ("done" if finished >= cfg.rl_steps else f"{finished}/{cfg.rl_steps} steps") \
                if started["rl"].exists() else "not started"
        elif done[stage].exists():
            status[stage] = "done"
        else:
            status[stage] = "in progress or stopped" if started.get(stage, done[stage]).exists() else "not started"
    return status


def stage_report(cfg: LearnConfig) -> dict:
    """report.json and learning_curve.png from whatever the run directory holds: a run stopped
    part-way is reported as far as it got (`status` says which stages finished)."""
    steps = _jsonl(cfg.path("rl", "steps.jsonl"))
    evals = {name: _read_json(cfg.path(f"eval_{name}", "summary.json")) for name in ("base", "sft", "rl")}
    # An eval stopped part-way: what its store holds, marked partial (never used for the targets).
    partial = {name: {"partial": True, **score_records(_jsonl(cfg.path(f"eval_{name}", "rollouts", "results.jsonl"))),
                      "error_kinds": _error_kinds(cfg.path(f"eval_{name}", "rollouts", "results.jsonl"))}
               for name, summary in evals.items()
               if summary is None and cfg.path(f"eval_{name}", "rollouts", "results.jsonl").is_file()}
    stage_times = _read_json(cfg.path("stage_times.json")) or {}
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "status": stage_status(cfg),
        "tasks": _read_json(cfg.path("tasks", "summary.json")),
        "stages": {
            "base": evals["base"] or partial.get("base"),
            "oracle": _read_json(cfg.path("oracle", "summary.json")),
            "sft": {"train": _read_json(cfg.path("sft", "summary.json")), "eval": evals["sft"] or partial.get("sft"),
                    "history": _jsonl(cfg.path("sft", "history.jsonl"))},
            "rl": {"steps": len(steps), "eval": evals["rl"] or partial.get("rl")},
        },
        "rl_steps": steps,
        "stage_wall_s": stage_times,
        "total_wall_s": round(sum(stage_times.values()), 1) if stage_times else None,
        "targets": _targets(evals),
    }
    _write_json(cfg.path("report.json"), report)
    try:
        plot(report, cfg.path("learning_curve.png"))
    except ImportError as error:
        log(f"no plot ({error}): install matplotlib (pi-env[collect])")
    return report


def _error_kinds(path: Path) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for record in _jsonl(path):
        if record.get("error_kind"):
            kinds[record["error_kind"]] = kinds.get(record["error_kind"], 0) + 1
    return kinds


def _targets(evals: dict) -> dict:
    def rate(name):
        return evals[name]["pass_rate"] if evals.get(name) else None

    base, sft, rl = rate("base"), rate("sft"), rate("rl")
    return {"sft_minus_base_points": round(100 * (sft - base), 1) if None not in (sft, base) else None,
            "rl_minus_sft_points": round(100 * (rl - sft), 1) if None not in (rl, sft) else None,
            "sft_target_met": (sft - base) >= 0.20 if None not in (sft, base) else None,
            "rl_target_met": (rl - sft) >= 0.05 if None not in (rl, sft) else None}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names, rates, labels = [], [], []
    for name, summary in (("base", report["stages"]["base"]), ("SFT", report["stages"]["sft"]["eval"]),
                          ("SFT+RL", report["stages"]["rl"]["eval"])):
        if summary and summary.get("count"):
            names.append(name + (" (partial)" if summary.get("partial") else ""))
            rates.append(100 * (summary["pass_rate"] or 0))
            labels.append(f"{summary['passed']}/{summary['count']}" + (f"\n{summary['unscored']} unscored" if summary["unscored"] else ""))
    bars = left.bar(names, rates, color=["#999999", "#4c72b0", "#dd8452"][:len(names)])
    for bar, label in zip(bars, labels):
        left.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    left.set_ylim(0, 100)
    left.set_ylabel("held-out pass rate (%)")
    left.set_title("SmolLM2-135M through real Pi: held-out eval")
    steps = report["rl_steps"]
    sft_history = report["stages"]["sft"]["history"]
    if not steps and sft_history:  # no RL yet: the SFT loss is the curve there is
        right.plot([h["step"] for h in sft_history], [h["loss"] for h in sft_history], marker="o")
        right.set_xlabel("SFT step (batch of %d)" % sft_history[0]["rows"])
        right.set_ylabel("loss (mean NLL of assistant tokens)")
        right.set_title("SFT warm-up")
    if steps:
        xs = [s["step"] for s in steps]
        right.plot(xs, [s["mean_reward"] or 0 for s in steps], marker="o", label="mean reward (train groups)")
        right.plot(xs, [s["pass_rate"] or 0 for s in steps], marker="s", label="pass rate (train groups)")
        right.set_xlabel("GRPO step")
        right.set_ylim(0, 1)
        right.legend()
        right.set_title("on-policy RL (sampled, T=1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line: python -m pi_env.learning STAGE [--options]


def run_stage(cfg: LearnConfig, stage: str) -> dict:
    started = time.monotonic()
    if stage == "tasks":
        result = stage_tasks(cfg)
        _write_json(cfg.path("tasks", "summary.json"), result)
    elif stage == "oracle":
        result = stage_oracle(cfg)
    elif stage == "eval_base":
        result = stage_eval(cfg, "base", cfg.base_model)
    elif stage == "sft":
        result = stage_sft(cfg)
    elif stage == "eval_sft":
        result = stage_eval(cfg, "sft", cfg.path("sft", "policy"))
    elif stage == "rl":
        result = stage_rl(cfg)
    elif stage == "eval_rl":
        result = stage_eval(cfg, "rl", cfg.path("rl", "policy"))
    elif stage == "report":
        return stage_report(cfg)
    else:
        raise SystemExit(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    times_path = cfg.path("stage_times.json")
    times = _read_json(times_path) or {}
    # A stage resumed from its outputs takes ~0 s now: keep the time of the run that did the work.
    elapsed = round(time.monotonic() - started, 1)
    if elapsed > times.get(stage, 0):
        times[stage] = elapsed
    _write_json(times_path, times)
    return result
