"""The learning run's stages, each resumable from its outputs in one run directory:

    tasks     tasks/{train,eval,rl,heldout,unseen}.jsonl (pi_env.workspace.coding, pairwise
              disjoint, checked; unseen: templates no other split uses, checked)
    oracle    oracle/ (pi-env collect of the train split, oracle endpoint) + oracle/exports/sft.jsonl
    eval      eval_<stage>/ (pi-env collect against vLLM serving a checkpoint: the greedy eval split,
              and samples_per_task samples at the RL temperature of the unseen-template set
              (primary) and the in-distribution held-out set; eval_<stage>/samples.jsonl)
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

import functools
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pi_env.config import BLACK_BOX, TRANSPARENT_PROXY, PiConfig
from pi_env.errors import BadInputError
from pi_env.task import PiTask

ROOT = Path(__file__).resolve().parents[3]
STAGES = (
    "tasks",
    "oracle",
    "eval_base",
    "sft",
    "probe",
    "eval_sft",
    "rl",
    "eval_rl",
    "eval_curve",
    "retest_sft",
    "report",
)


class LeakError(BadInputError, RuntimeError):
    """An eval task is also a training instance: the eval would not be held out."""


@dataclass
class LearnConfig:
    run_dir: Path
    base_model: Path = (
        Path(os.environ.get("PI_ENV_ENGINES_DIR") or ROOT / ".engines") / "models" / "smollm2-135m-instruct"
    )
    seed: int = 0
    n_train: int = 200
    n_eval: int = 50
    # RL draws from its own split of fresh instances: the SFT data memorised the train split,
    # so its groups there are mostly all-solved and teach nothing. 0: RL draws from train.
    n_rl: int = 200
    # The paired evals (docs/learning_protocol.md), samples_per_task samples of each task at the
    # RL temperature, the same tasks for every checkpoint, over the eval families (the RL families
    # and rl_excluded_family): `unseen` (primary) draws only templates no other split uses;
    # `heldout` (in-distribution, reported beside it) fresh instances of the train templates.
    # tasks/unseen.jsonl and tasks/heldout.jsonl hold this many of every family.
    n_unseen: int = 70
    n_heldout: int = 20
    samples_per_task: int = 4
    families: list[str] | None = None
    # rollouts
    concurrency: int = 4
    max_turns: int = 8
    max_tokens: int = 256  # per model call (the longest oracle call is ~200 tokens)
    agent_timeout_s: float = (
        600  # generous: on a loaded machine generation is slow; budgets are max_turns and max_tokens
    )
    eval_temperature: float = 0.0  # the secondary greedy eval (eval_limit tasks)
    base_max_turns: int = 4  # the base model runs every turn to its token limit: its eval is capped
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
    eval_limit: int | None = 20  # greedy eval on the first N eval tasks (families alternate; 0: all of them)
    train_layers: int = 0  # SFT trains only the top N decoder layers (0: all); see trainer.train_top_layers
    # Probe: the SFT policy's sampled pass rate per family, which picks the RL families
    probe_tasks_per_family: int = 2
    probe_samples: int = 4
    rl_families: list[str] | None = None  # given: no probe, RL and the held-out eval use these
    # The family RL never trains (the RL split leaves it out; SFT trains its train templates): the
    # paired evals include it, so they measure transfer to a family RL never saw. "": none.
    rl_excluded_family: str = "rename_symbol"
    # RL (docs/learning.md: why these values)
    rl_algorithm: str = "grpo"  # or "raft": NLL on the passing rollouts of mixed groups (rl_raft/)
    # Which RL seed (from the same SFT checkpoint): 0 writes rl/, K writes rl_seedK/ (RAFT:
    # rl_raft/, rl_raft_seedK/); the report pools the GRPO seeds it finds.
    rl_seed: int = 0
    rl_steps: int = 8  # the first half visits fresh tasks, the second half the same ones again
    rl_tasks_per_step: int = 4
    group_size: int = 8
    rl_lr: float = 1e-5
    rl_warmup_steps: int = (
        3  # lr ramps linearly over the first steps (a fresh Adam's first step moves every weight by lr)
    )
    rl_updates: int = 1  # optimizer steps per batch of rollouts (>1: PPO epochs under the clip)
    rl_temperature: float = 1.0
    rl_train_layers: int = 10  # RL trains only the top N decoder layers (embeddings, LM head frozen; 0: all)
    scale_rewards: bool = False  # divide advantages by the group's std (original GRPO); off: Dr. GRPO
    skip_flat_revisits: bool = True  # a task whose first group was flat is not visited again
    # The curve (docs/learning_protocol.md): RL seed 0 keeps its checkpoint after these many steps
    # (<arm>/checkpoint_K/) and `eval_curve` evaluates each on the unseen set; the last step's is
    # eval_rl's. Comma-separated; "": none.
    curve_steps: str = "3,6"
    kl_soft: float = 0.01  # KL(before || after) of an update above this halves the lr from then on
    kl_hard: float = 0.03  # above this the update is rolled back (and the lr halved)
    clip_eps: float = 0.2
    micro_batch: int = 2
    extra: dict = field(default_factory=dict)

    def path(self, *parts: str) -> Path:
        return Path(self.run_dir, *parts)

    @property
    def rl_name(self) -> str:
        """The RL arm's directory: rl/ for GRPO, rl_raft/ for RAFT (one run dir can hold both),
        with `_seedK` for rl_seed K > 0."""
        return arm_name(self.rl_algorithm, self.rl_seed)

    def __post_init__(self):
        if self.rl_algorithm not in RL_ALGORITHMS:
            raise ValueError(f"rl_algorithm {self.rl_algorithm!r}: use one of {', '.join(RL_ALGORITHMS)}")
        if self.rl_temperature <= 0:
            raise ValueError(f"rl_temperature {self.rl_temperature}: RL samples at a temperature > 0")
        if self.samples_per_task < 1:
            raise ValueError(f"samples_per_task {self.samples_per_task}: give at least 1")
        if self.rl_seed < 0:
            raise ValueError(f"rl_seed {self.rl_seed}: give a seed >= 0")
        if self.rl_excluded_family and self.rl_excluded_family in (self.rl_families or []):
            raise ValueError(
                f"rl_families {self.rl_families}: {self.rl_excluded_family!r} is the family RL never trains "
                "(rl_excluded_family)"
            )


RL_ALGORITHMS = ("grpo", "raft")
SAMPLED_SETS = ("unseen", "heldout")  # the paired evals: primary first, in-distribution second


def arm_name(algorithm: str, seed: int = 0) -> str:
    """An RL arm's directory: rl, rl_raft, rl_seed1, rl_raft_seed2, ..."""
    name = "rl" if algorithm == "grpo" else f"rl_{algorithm}"
    return name if seed == 0 else f"{name}_seed{seed}"


def parse_arm(name: str) -> tuple[str, int] | None:
    """(algorithm, seed) of an arm directory name, None if it is not one."""
    base, _, seed = name.partition("_seed")
    algorithm = "grpo" if base == "rl" else base.removeprefix("rl_")
    if algorithm not in RL_ALGORITHMS or (seed and not seed.isdigit()) or arm_name(algorithm, int(seed or 0)) != name:
        return None
    return algorithm, int(seed or 0)


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
    from pi_env.workspace.coding import (
        CODING_FAMILIES,
        check_unseen_templates,
        generate_coding_tasks,
        make_coding_splits,
    )
    from pi_env.workspace.tasks import check_disjoint

    families = list(cfg.families or CODING_FAMILIES)
    paths = {name: cfg.path("tasks", f"{name}.jsonl") for name in ("train", "eval", "rl", "heldout", "unseen")}
    if paths["train"].is_file() and paths["eval"].is_file():
        train, evaluation = read_tasks(paths["train"]), read_tasks(paths["eval"])
    else:
        train, evaluation = make_coding_splits(cfg.n_train, cfg.n_eval, seed=cfg.seed, families=cfg.families)
        _write_tasks(paths["train"], train)
        _write_tasks(paths["eval"], evaluation)
    # Each later split is made on its own (also for a run directory from before it existed):
    # the files already there stay as they are.
    if paths["rl"].is_file():
        fresh = read_tasks(paths["rl"])
    else:
        # RL never trains rl_excluded_family: its split has none of it.
        rl_families = [f for f in families if f != cfg.rl_excluded_family]
        fresh = generate_coding_tasks(
            cfg.n_rl,
            split="rl",
            seed=cfg.seed,
            families=rl_families,
            exclude={task.digest() for task in train + evaluation},
        )
        _write_tasks(paths["rl"], fresh)
    # The paired evals' pools: n of every family, so whichever families the probe picks for RL,
    # n of their tasks are there (families take turns in the files).
    if paths["heldout"].is_file():
        heldout = read_tasks(paths["heldout"])
    else:
        heldout = generate_coding_tasks(
            cfg.n_heldout * len(families),
            split="heldout",
            seed=cfg.seed,
            families=cfg.families,
            exclude={task.digest() for task in train + evaluation + fresh},
        )
        _write_tasks(paths["heldout"], heldout)
    if paths["unseen"].is_file():
        unseen = read_tasks(paths["unseen"])
    else:
        unseen = generate_coding_tasks(
            cfg.n_unseen * len(families),
            split="unseen",
            seed=cfg.seed,
            families=cfg.families,
            exclude={task.digest() for task in train + evaluation + fresh + heldout},
        )
        _write_tasks(paths["unseen"], unseen)
    check_disjoint(train=train, eval=evaluation, rl=fresh, heldout=heldout, unseen=unseen)
    check_unseen_templates(unseen, train + evaluation + fresh + heldout)
    if cfg.rl_excluded_family and any(t.metadata["family"] == cfg.rl_excluded_family for t in fresh):
        raise RuntimeError(
            f"tasks/rl.jsonl holds {cfg.rl_excluded_family} tasks, the family RL never trains: remove it and "
            "run the tasks stage again (a run directory from before the exclusion: --rl-excluded-family '')"
        )
    counts: dict[str, int] = {}
    for task in evaluation:
        counts[task.metadata["family"]] = counts.get(task.metadata["family"], 0) + 1

    def templates(tasks: list[PiTask]) -> list[str]:
        return sorted({t.metadata.get("template", "?") for t in tasks})

    return {
        "train": len(train),
        "eval": len(evaluation),
        "rl": len(fresh),
        "heldout": len(heldout),
        "unseen": len(unseen),
        "eval_families": counts,
        "rl_excluded_family": cfg.rl_excluded_family or None,
        "templates": {"train_pool": templates(train + evaluation + fresh + heldout), "unseen_pool": templates(unseen)},
    }


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
    for step_dir in sorted(cfg.path().glob("rl*/step_*")):  # every RL arm's steps
        used |= {r["task_id"] for r in read_records(step_dir)}
    missing = sorted(used - set(known))
    if missing:
        raise LeakError(
            f"trained on task ids that are in no task file of {cfg.run_dir}: {missing[:5]}; "
            f"cannot prove the eval is held out"
        )
    return {known[task_id].digest(): task_id for task_id in used}


def check_held_out(cfg: LearnConfig, eval_tasks: list[PiTask], unseen_tasks: Sequence[PiTask] = ()) -> int:
    """Raise LeakError if any eval task (by content digest, whatever its id) was trained on, or if
    any of `unseen_tasks` shares a template with a task trained on (or is not from the unseen pool)."""
    trained = training_instances(cfg)
    leaks = [
        (task.task_id, trained[task.digest()]) for task in [*eval_tasks, *unseen_tasks] if task.digest() in trained
    ]
    if leaks:
        raise LeakError(
            f"{len(leaks)} eval task(s) were trained on, e.g. eval {leaks[0][0]!r} = trained "
            f"{leaks[0][1]!r}; the eval split must be held out"
        )
    if unseen_tasks:
        known = {task.digest(): task for path in cfg.path("tasks").glob("*.jsonl") for task in read_tasks(path)}
        templates = {known[digest].metadata.get("template"): task_id for digest, task_id in trained.items()}
        for task in unseen_tasks:
            if task.metadata.get("pool") != "unseen" or task.metadata.get("template") in templates:
                raise LeakError(
                    f"unseen eval task {task.task_id!r} (template {task.metadata.get('template')!r}, pool "
                    f"{task.metadata.get('pool')!r}) is not unseen: its template was trained on "
                    f"({templates.get(task.metadata.get('template'))!r}) or it is from the train pool"
                )
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

    def __enter__(self) -> Engine:
        started = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The dev endpoints (/collective_rpc, /reset_prefix_cache) are what `load` calls; the
        # engine binds 127.0.0.1, which no sandboxed agent can reach.
        env = {
            **os.environ,
            "ENGINE_MODEL_NAME": "policy",
            "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        }
        out = subprocess.run(
            [
                "bash",
                str(ROOT / "scripts" / "engines" / "serve_vllm.sh"),
                "--model-dir",
                str(self.model_dir),
                "--port",
                str(self.port),
                "--log",
                str(self.log_path),
                "--timeout",
                str(self.timeout_s),
                "--",
                "--worker-extension-cls",
                self.WORKER_EXTENSION,
                # logprobs of the distribution sampled from (after temperature), which
                # is what the trainer scores; vLLM's default is the raw model's
                "--logprobs-mode",
                "processed_logprobs",
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
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
        for path, body in (
            ("/collective_rpc", {"method": "load_checkpoint", "args": [str(model_dir)]}),
            ("/reset_prefix_cache", None),
        ):
            request = urllib.request.Request(
                root + path,
                data=json.dumps(body).encode() if body else b"",
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                urllib.request.urlopen(request, timeout=self.timeout_s).read()
            except urllib.error.HTTPError as error:
                raise RuntimeError(
                    f"vLLM could not load {model_dir}: {path} answered {error.code} "
                    f"{error.read()[:500]!r} (log {self.log_path})"
                ) from None
        self.model_dir = Path(model_dir)
        return time.monotonic() - started

    def __exit__(self, *exc) -> None:
        if self.pid is not None:
            subprocess.run(["bash", str(ROOT / "scripts" / "engines" / "stop_engine.sh"), str(self.pid)], check=False)
            self.pid = None


class Engines:
    """One vLLM for consecutive stages (probe -> eval -> RL -> eval): started on first use, later
    checkpoints loaded into it in place (`Engine.load`), stopped by `close` (before a stage that
    trains on the CPU without it) or at the end. Each `serve` says what it cost."""

    def __init__(self, cfg: LearnConfig):
        self.cfg = cfg
        self.engine: Engine | None = None

    def serve(self, model_dir: Path, log_name: str, *, rewritten: bool = False) -> tuple[Engine, dict]:
        """The engine serving `model_dir` (`rewritten`: the directory was saved again since it
        was loaded, as RL's policy/ after each step) and what that cost."""
        if self.engine is None:
            engine = Engine(
                model_dir,
                self.cfg.engine_port,
                self.cfg.path("logs", f"vllm-{log_name}.log"),
                self.cfg.engine_timeout_s,
            )
            self.engine = engine.__enter__()
            return self.engine, {"engine_start": round(self.engine.start_s, 1)}
        if Path(model_dir).resolve() == self.engine.model_dir.resolve() and not rewritten:
            return self.engine, {}
        return self.engine, {"weights_load": round(self.engine.load(model_dir), 1)}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.__exit__(None, None, None)
            self.engine = None

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rollout_config(cfg: LearnConfig, engine: Engine, temperature: float, max_turns: int | None = None) -> PiConfig:
    token_in: dict[str, Any] = (
        {"proxy_token_in": True, "proxy_renderer": "chatml-hermes", "proxy_tokenizer": str(engine.model_dir)}
        if cfg.token_in
        else {}
    )
    return PiConfig(
        endpoint={"name": "vllm", "base_url": engine.base_url, "model": "policy", "api_key": "none"},
        mode={
            "name": TRANSPARENT_PROXY,
            "return_token_ids": True,
            "sampling": {"temperature": temperature, "top_p": 1.0},
        },
        gateway={"max_turns": max_turns or cfg.max_turns, "max_tokens": cfg.max_tokens},
        limits={"agent_timeout_s": cfg.agent_timeout_s},
        **token_in,
    )


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
    return {
        "count": len(records),
        "scored": len(rewards),
        "passed": passed,
        "pass_rate": round(passed / len(records), 4) if records else None,
        # unscored (infra) rollouts are left out of the mean, never counted as 0
        "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "unscored": len(records) - len(rewards),
        "tool_calls": sum(
            1 for r in records for m in r["messages"] if m["role"] == "assistant" and m.get("tool_calls")
        ),
        "per_family_pass": {f: f"{sum(1 for v in vs if v >= 1.0)}/{len(vs)}" for f, vs in sorted(families.items())},
    }


# ---------------------------------------------------------------------------------------------
# Stages


def stage_oracle(cfg: LearnConfig) -> dict:
    from pi_env.collect.export import export

    done = _read_json(cfg.path("oracle", "summary.json"))
    if done:
        return done
    train = read_tasks(cfg.path("tasks", "train.jsonl"))
    records, wall = collect(
        train,
        cfg.path("oracle"),
        PiConfig(endpoint="oracle", mode=BLACK_BOX),
        group_size=1,
        concurrency=cfg.concurrency,
    )
    scores = score_records(records)
    if scores["passed"] != len(train):
        failed = [r["task_id"] for r in records if (r.get("reward") or 0) < 1][:5]
        raise RuntimeError(f"the oracle must solve every train task; it failed {failed}")
    path, rows, _ = export(cfg.path("oracle"), "sft")
    summary = {"rollouts": len(records), "sft_rows": rows, "sft_path": str(path), "wall_s": round(wall, 1)}
    _write_json(cfg.path("oracle", "summary.json"), summary)
    return summary


def rl_families(cfg: LearnConfig) -> list[str]:
    """The families RL trains on and the paired held-out eval covers: given, or the probe's pick."""
    if cfg.rl_families:
        return list(cfg.rl_families)
    probe = _read_json(cfg.path("probe", "summary.json"))
    if not probe:
        raise RuntimeError(
            f"no {cfg.path('probe', 'summary.json')}: run the probe stage first (it picks the RL "
            "families that RL and the held-out eval use), or give --rl-families"
        )
    return probe["rl_families"]


def eval_families(cfg: LearnConfig) -> list[str]:
    """The paired evals' families: the RL families and the family RL never trains."""
    from pi_env.workspace.coding import CODING_FAMILIES

    families = list(rl_families(cfg))
    excluded = cfg.rl_excluded_family
    if excluded and excluded in (cfg.families or CODING_FAMILIES) and excluded not in families:
        families.append(excluded)
    return families


def eval_set(cfg: LearnConfig, kind: str) -> list[PiTask]:
    """A paired eval's tasks (`kind` unseen or heldout): the first n_unseen / n_heldout of the
    eval families in tasks/<kind>.jsonl (families take turns there, so each gets its share)."""
    size = {"unseen": cfg.n_unseen, "heldout": cfg.n_heldout}[kind]
    families = set(eval_families(cfg))
    path = cfg.path("tasks", f"{kind}.jsonl")
    tasks = [t for t in read_tasks(path) if t.metadata["family"] in families] if path.is_file() else []
    if len(tasks) < size:
        raise RuntimeError(
            f"tasks/{kind}.jsonl has {len(tasks)} tasks of {sorted(families)}, fewer than "
            f"n_{kind}={size}: remove it and run the tasks stage again"
        )
    return tasks[:size]


def heldout_tasks(cfg: LearnConfig) -> list[PiTask]:
    """The in-distribution paired eval's tasks (eval_set 'heldout')."""
    return eval_set(cfg, "heldout")


def sample_rows(cfg: LearnConfig, name: str) -> list[dict]:
    """One small row per sampled eval rollout of checkpoint `name` (eval_<name>/<kind>/), in task
    and sample order: what every paired figure is computed from."""
    tasks = {t.task_id: t for path in cfg.path("tasks").glob("*.jsonl") for t in read_tasks(path)}
    rows = []
    for kind in SAMPLED_SETS:
        records = _jsonl(cfg.path(f"eval_{name}", kind, "results.jsonl"))
        for r in sorted(records, key=lambda r: (r["task_id"], r.get("group_index") or 0)):
            task = tasks.get(r["task_id"])
            metadata = task.metadata if task else {}
            rows.append(
                {
                    "checkpoint": name,
                    "set": kind,
                    "task_id": r["task_id"],
                    "family": metadata.get("family"),
                    "template": metadata.get("template"),
                    "split": metadata.get("split"),
                    "sample": r.get("group_index") or 0,
                    "reward": r.get("reward"),
                    "passed": None if r.get("reward") is None else r["reward"] >= 1.0,
                }
            )
    return rows


def stage_eval(cfg: LearnConfig, name: str, model_dir: Path | Callable[[], Path], engines: Engines) -> dict:
    """The checkpoint's greedy eval on the first eval_limit eval tasks (secondary, for continuity)
    and, except for the base model, samples_per_task samples at the RL temperature of each task of
    the unseen-template set (primary) and the in-distribution held-out set (the retest: the unseen
    set only); the report compares these task by task. Per-sample rows: eval_<name>/samples.jsonl.
    `model_dir` may be a function giving it: it rebuilds a checkpoint a carried run lacks, only
    when the eval still has to run."""
    done = _read_json(cfg.path(f"eval_{name}", "summary.json"))
    if done:
        return done
    model_dir = model_dir() if callable(model_dir) else model_dir
    started = time.monotonic()
    sets: dict[str, tuple[list[PiTask], float, int]] = {}
    curve = "_step" in name  # a curve checkpoint: the primary set only
    if name != "sft_retest" and not curve:  # the retest is a control of the paired evals only
        eval_tasks = read_tasks(cfg.path("tasks", "eval.jsonl"))[: cfg.eval_limit or None]
        sets["greedy"] = (eval_tasks, cfg.eval_temperature, 1)
    if name != "base":
        sets["unseen"] = (eval_set(cfg, "unseen"), cfg.rl_temperature, cfg.samples_per_task)
        if name != "sft_retest" and not curve:
            sets["heldout"] = (eval_set(cfg, "heldout"), cfg.rl_temperature, cfg.samples_per_task)
    trained = check_held_out(
        cfg,
        [task for kind, (tasks, _, _) in sets.items() if kind != "unseen" for task in tasks],
        sets["unseen"][0] if "unseen" in sets else [],
    )
    engine, engine_time = engines.serve(model_dir, f"eval_{name}")
    summary: dict[str, Any] = {
        "stage": name,
        "model_dir": str(model_dir),
        "held_out_checked_against": trained,
        "time_s": dict(engine_time),
    }
    for kind, (tasks, temperature, samples) in sets.items():
        # The base model runs every turn to its token limit: its turns are capped (said in the report).
        max_turns = cfg.base_max_turns if name == "base" else cfg.max_turns
        records, wall = collect(
            tasks,
            cfg.path(f"eval_{name}", kind),
            rollout_config(cfg, engine, temperature, max_turns),
            group_size=samples,
            concurrency=cfg.concurrency,
        )
        summary[kind] = {
            **score_records(records),
            "tasks": len(tasks),
            "samples_per_task": samples,
            "temperature": temperature,
            "max_turns": max_turns,
            "label": _SET_LABELS[kind],
        }
        summary["time_s"][kind] = round(wall, 1)
        log(
            f"eval {name} {kind}: {summary[kind]['passed']}/{summary[kind]['count']} passed, "
            f"mean reward {summary[kind]['mean_reward']}"
        )
    rows = sample_rows(cfg, name)
    _write_jsonl(cfg.path(f"eval_{name}", "samples.jsonl"), rows)
    summary["samples_jsonl"] = {"path": str(cfg.path(f"eval_{name}", "samples.jsonl")), "rows": len(rows)}
    summary["wall_s"] = round(time.monotonic() - started, 1)
    _write_json(cfg.path(f"eval_{name}", "summary.json"), summary)
    return summary


_SET_LABELS = {
    "greedy": "secondary: greedy, the first eval_limit eval-split tasks (train templates)",
    "unseen": "primary: unseen templates (no SFT or RL task uses them), sampled at the RL temperature",
    "heldout": "in-distribution: new instances of the train templates, sampled at the RL temperature",
}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    tmp.replace(path)


def stage_probe(cfg: LearnConfig, engines: Engines) -> dict:
    """The SFT policy's sampled pass rate per family (probe_tasks_per_family RL-split tasks of
    each, probe_samples samples each, at the RL temperature): RL's families are those it passes
    20-80 % of the time (schedule.choose_families), where GRPO's groups are mixed."""
    from pi_env.learning.schedule import choose_families, flat

    done = _read_json(cfg.path("probe", "summary.json"))
    if done:
        return done
    started = time.monotonic()
    if cfg.rl_families:
        summary: dict[str, Any] = {"rl_families": list(cfg.rl_families), "chosen_by": "--rl-families (no probe)"}
        _write_json(cfg.path("probe", "summary.json"), summary)
        return summary
    by_family = _rl_pool(cfg)
    tasks = [task for family in sorted(by_family) for task in by_family[family][: cfg.probe_tasks_per_family]]
    engine, engine_time = engines.serve(sft_policy(cfg), "probe")
    records, wall = collect(
        tasks,
        cfg.path("probe", "rollouts"),
        rollout_config(cfg, engine, cfg.rl_temperature),
        group_size=cfg.probe_samples,
        concurrency=cfg.concurrency,
    )
    table = {}
    for family in sorted(by_family):
        mine = [r for r in records if r["task_id"] in {t.task_id for t in by_family[family]}]
        scores = score_records(mine)
        groups: dict[str, list] = {}
        for r in mine:
            groups.setdefault(r["group_id"], []).append(r.get("reward"))
        table[family] = {
            "rollouts": scores["count"],
            "passed": scores["passed"],
            "pass_rate": round(scores["passed"] / scores["scored"], 3) if scores["scored"] else 0.0,
            "mean_reward": scores["mean_reward"],
            "unscored": scores["unscored"],
            "mixed_groups": f"{sum(not flat(g) for g in groups.values())}/{len(groups)}",
        }
    families = choose_families({f: row["pass_rate"] for f, row in table.items()})
    summary = {
        "table": table,
        "rl_families": families,
        "band": [0.2, 0.8],
        "temperature": cfg.rl_temperature,
        "probed_tasks": [t.task_id for t in tasks],
        "time_s": {**engine_time, "rollouts": round(wall, 1)},
        "wall_s": round(time.monotonic() - started, 1),
    }
    _write_json(cfg.path("probe", "summary.json"), summary)
    log(f"probe: {json.dumps({f: row['pass_rate'] for f, row in table.items()})} -> RL families {families}")
    return summary


def _rl_pool(cfg: LearnConfig) -> dict[str, list[PiTask]]:
    """RL-split tasks by family, in file order (the train split if there is no RL split), never
    of rl_excluded_family."""
    pool = read_tasks(cfg.path("tasks", "rl.jsonl")) if cfg.path("tasks", "rl.jsonl").is_file() else []
    by_family: dict[str, list[PiTask]] = {}
    for task in pool or read_tasks(cfg.path("tasks", "train.jsonl")):
        if task.metadata["family"] != cfg.rl_excluded_family:
            by_family.setdefault(task.metadata["family"], []).append(task)
    return by_family


def stage_sft(cfg: LearnConfig) -> dict:
    """Full fine-tune (or the top `train_layers`) on the oracle conversations: sft/policy."""
    return _read_json(cfg.path("sft", "summary.json")) or _train_sft(cfg)


def sft_policy(cfg: LearnConfig) -> Path:
    """sft/policy for a stage that serves or trains it. A run carried to another machine
    (pi_env.learning.state) has the SFT summary but not the checkpoint: it is trained again on
    the same rows with the same seed, and must have the recorded digest."""
    policy = cfg.path("sft", "policy")
    if not policy.is_dir():
        if not cfg.path("sft", "summary.json").is_file():
            raise RuntimeError(f"no {policy}: run the sft stage first")
        log("sft: the checkpoint is not on this machine; training it again from the run's records")
        _train_sft(cfg, rebuild=True)
    return policy


def _train_sft(cfg: LearnConfig, *, rebuild: bool = False) -> dict:
    import torch

    from pi_env.learning import state, trainer

    torch.manual_seed(cfg.seed)
    started = time.monotonic()
    model, tokenizer = trainer.load_policy(cfg.base_model)
    trained_parameters = trainer.train_top_layers(model, cfg.train_layers)
    rows = []
    data = [
        json.loads(line) for line in cfg.path("oracle", "exports", "sft.jsonl").read_text().splitlines() if line.strip()
    ]
    data = data[: cfg.sft_limit] if cfg.sft_limit else data
    for item in data:
        rows += trainer.render_sft_rows(item["messages"], json.loads(item["tools"]), tokenizer)
    log(
        f"sft: {len(data)} conversations -> {len(rows)} rows, {sum(len(r.token_ids) for r in rows)} tokens, "
        f"{sum(sum(r.loss_mask) for r in rows)} trained"
    )
    history_path = cfg.path("sft", "rebuild_history.jsonl" if rebuild else "history.jsonl")
    history_path.parent.mkdir(parents=True, exist_ok=True)
    with history_path.open("w") as handle:

        def note(entry: dict) -> None:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            log(f"sft step {entry['step']}: loss {entry['loss']:.4f} ({entry['wall_s']} s)")

        history = trainer.sft_train(
            model,
            rows,
            epochs=cfg.sft_epochs,
            batch_size=cfg.sft_batch,
            learning_rate=cfg.sft_lr,
            seed=cfg.seed,
            micro_batch=cfg.micro_batch,
            log=note,
        )
    trainer.save_policy(model, tokenizer, cfg.base_model, cfg.path("sft", "policy"))
    if rebuild:
        state.check_rebuilt(cfg.run_dir, "sft/policy")
        log(f"sft: rebuilt in {time.monotonic() - started:.0f} s, the recorded weights")
        return {"rebuilt_s": round(time.monotonic() - started, 1)}
    summary = {
        "conversations": len(data),
        "rows": len(rows),
        "steps": len(history),
        "trained_parameters": trained_parameters,
        "train_layers": cfg.train_layers or "all",
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "train_s": round(sum(h["wall_s"] for h in history), 1),
        "wall_s": round(time.monotonic() - started, 1),
        "weights_sha256": state.record_weights(cfg.run_dir, "sft/policy"),
    }
    _write_json(cfg.path("sft", "summary.json"), summary)
    return summary


def rl_plan(cfg: LearnConfig) -> list[list[str]]:
    """The RL stage's task ids per step (schedule.rl_schedule over the RL families' fresh tasks:
    the RL split minus what the probe ran)."""
    from pi_env.learning.schedule import rl_schedule

    probed = set((_read_json(cfg.path("probe", "summary.json")) or {}).get("probed_tasks") or [])
    pool = {f: [t.task_id for t in tasks if t.task_id not in probed] for f, tasks in _rl_pool(cfg).items()}
    return rl_schedule(pool, rl_families(cfg), steps=cfg.rl_steps, per_step=cfg.rl_tasks_per_step)


def stage_rl(cfg: LearnConfig, engines: Engines) -> dict:
    """RL from the SFT checkpoint, one step at a time (`_rl_step`). A stage resumed part-way
    first replays its finished steps (`_replay_rl`), so it goes on with the weights and Adam's
    moments of an uninterrupted run."""
    steps_path = cfg.path(cfg.rl_name, "steps.jsonl")
    steps = _jsonl(steps_path)
    if len(steps) >= cfg.rl_steps:
        return {"steps": len(steps)}
    plan = rl_plan(cfg)
    model, tokenizer, optimizer = _rl_start(cfg)
    if steps:
        _replay_rl(cfg, steps, model, tokenizer, optimizer, keep=_kept_checkpoints(cfg, len(steps)))
    policy_dir = cfg.path(cfg.rl_name, "policy")
    # One engine across the stages: each step's checkpoint is swapped into it in place.
    engine, engine_time = engines.serve(policy_dir if steps else sft_policy(cfg), cfg.rl_name)
    for step in range(len(steps), cfg.rl_steps):
        entry = _rl_step(cfg, plan, step, steps, engine, model, tokenizer, optimizer, engine_time)
        with steps_path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
        steps.append(entry)
        log(
            f"{cfg.rl_name} step {step}: mean reward {entry['mean_reward']}, pass {entry['pass_rate']}, "
            f"kl {entry.get('kl_after')} ({entry['kl_guard']}), {entry['time_s']}"
        )
        _, engine_time = engines.serve(policy_dir, cfg.rl_name, rewritten=True)
    return {"steps": len(steps)}


def rebuild_checkpoints(cfg: LearnConfig) -> dict[str, str]:
    """Every checkpoint recorded in the run's weights.json that this machine lacks (a run carried
    from another one): sft/policy trained again, each RL arm's replayed from SFT through as many
    of its steps as the checkpoint holds, each checked against its digest. Returns checkpoint ->
    digest."""
    from pi_env.learning import state

    recorded = state.recorded_weights(cfg.run_dir)
    missing: dict[str, dict[int, list[str]]] = {}  # arm -> steps -> checkpoints it holds
    for name, facts in sorted(recorded.items()):
        arm, _, checkpoint = name.partition("/")
        if name == "sft/policy" or cfg.path(name).is_dir():
            continue
        if not parse_arm(arm) or "steps" not in facts:
            raise RuntimeError(f"{name} in {cfg.path(state.WEIGHTS_FILE)}: not an RL arm's checkpoint with its steps")
        missing.setdefault(arm, {}).setdefault(facts["steps"], []).append(checkpoint)
    if "sft/policy" in recorded or missing:
        sft_policy(cfg)
    for arm, keep in missing.items():
        algorithm, seed = parse_arm(arm)  # type: ignore[misc]
        arm_cfg = replace(cfg, rl_algorithm=algorithm, rl_seed=seed)
        steps = _jsonl(arm_cfg.path(arm, "steps.jsonl"))[: max(keep)]
        log(f"{arm}: {sorted(c for cs in keep.values() for c in cs)} not on this machine; replaying from SFT")
        _replay_rl(arm_cfg, steps, *_rl_start(arm_cfg), keep=keep)
    return {name: facts["sha256"] for name, facts in sorted(state.recorded_weights(cfg.run_dir).items())}


def _kept_checkpoints(cfg: LearnConfig, steps: int) -> dict[int, list[str]]:
    """What the RL arm keeps after `steps` finished steps: the curve's checkpoint_K of each kept
    K <= steps, and the policy after the last."""
    keep: dict[int, list[str]] = {k: [curve_checkpoint(cfg, k).name] for k in curve_steps(cfg) if k <= steps}
    keep.setdefault(steps, []).append("policy")
    return keep


def _rl_start(cfg: LearnConfig):
    """The SFT weights with the RL arm's trainable layers, and a fresh optimizer."""
    import torch

    from pi_env.learning import trainer

    torch.manual_seed(cfg.seed + 1000 * cfg.rl_seed)
    model, tokenizer = trainer.load_policy(sft_policy(cfg))
    trainer.train_top_layers(model, cfg.rl_train_layers)
    optimizer = torch.optim.AdamW(trainer.trainable(model), lr=cfg.rl_lr, betas=(0.9, 0.99), weight_decay=0.0)
    return model, tokenizer, optimizer


def rl_checkpoint(cfg: LearnConfig, name: str = "policy") -> Path:
    """The RL arm's checkpoint `name` (policy, or a curve's checkpoint_K) for a stage that serves
    it. A run carried to another machine (pi_env.learning.state) has the steps but not the
    weights: they are replayed from SFT (`_replay_rl`), checked against the recorded digests."""
    path = cfg.path(cfg.rl_name, name)
    if not path.is_dir():
        steps = _jsonl(cfg.path(cfg.rl_name, "steps.jsonl"))
        if len(steps) < cfg.rl_steps:
            raise RuntimeError(f"no {path}: run the rl stage first (its steps are not all done)")
        log(f"{cfg.rl_name}: {name} is not on this machine; replaying the arm's steps from SFT")
        _replay_rl(cfg, steps, *_rl_start(cfg), keep=_kept_checkpoints(cfg, len(steps)))
    return path


def _replay_rl(cfg: LearnConfig, steps: list[dict], model, tokenizer, optimizer, *, keep: dict[int, list[str]]) -> None:
    """The finished `steps` again on their stored rollouts, from SFT: each update must end as
    recorded (its guard's verdict, KL and rows), and the checkpoints `keep` names (steps ->
    checkpoints of the arm holding them) are saved and must have their recorded digests."""
    from pi_env.collect.store import read_records
    from pi_env.learning.state import RebuildMismatch

    started = time.monotonic()
    for entry in steps:
        step = entry["step"]
        records = list(read_records(cfg.path(cfg.rl_name, f"step_{step}")))
        updates = _rl_update(cfg, model, optimizer, records, entry["lr"])
        replayed = [(u["kl_guard"], u.get("kl_after"), u["rows"]) for u in updates]
        recorded = [(u["kl_guard"], u.get("kl_after"), u["rows"]) for u in entry["updates"]]
        if replayed != recorded:
            raise RebuildMismatch(
                f"{cfg.rl_name} step {step} replayed as {replayed} (guard, KL, rows), recorded as {recorded}: "
                "the stored rollouts, the training code or this machine differ from the run's; start a new "
                "run directory"
            )
        _save_rl_checkpoints(cfg, model, tokenizer, step, keep.get(step + 1, []), replayed=True)
    log(f"{cfg.rl_name}: replayed {len(steps)} steps from SFT in {time.monotonic() - started:.0f} s")


def _save_rl_checkpoints(cfg: LearnConfig, model, tokenizer, step: int, names: list[str], *, replayed: bool) -> float:
    """Save the weights after `step` as the arm's checkpoints `names` (policy, a curve's
    checkpoint_K), each with its digest recorded (a replay checks it instead). Returns the
    seconds it took."""
    from pi_env.learning import state, trainer

    started = time.monotonic()
    record = state.check_rebuilt if replayed else state.record_weights
    for name in names:
        trainer.save_policy(model, tokenizer, cfg.base_model, cfg.path(cfg.rl_name, name))
        record(cfg.run_dir, f"{cfg.rl_name}/{name}", steps=step + 1)
    return time.monotonic() - started


def _rl_update(cfg: LearnConfig, model, optimizer, records: list[dict], lr: float) -> list[dict]:
    """A step's updates (GRPO or RAFT, `rl_updates` of them) at `lr` on its rollouts' exact
    training traces, under the KL guard; stops at the first update the guard acted on."""
    from pi_env.learning import trainer
    from pi_env.learning.rows import raft_rows, rl_rows

    for group in optimizer.param_groups:
        group["lr"] = lr
    rows = raft_rows(records) if cfg.rl_algorithm == "raft" else rl_rows(records, scale_rewards=cfg.scale_rewards)
    if cfg.rl_algorithm == "raft":
        step_fn = functools.partial(
            trainer.nll_step, model, optimizer, rows, micro_batch=cfg.micro_batch, temperature=cfg.rl_temperature
        )
    else:
        step_fn = functools.partial(
            trainer.grpo_step,
            model,
            optimizer,
            rows,
            clip_eps=cfg.clip_eps,
            micro_batch=cfg.micro_batch,
            temperature=cfg.rl_temperature,
        )
    updates = []
    for _ in range(cfg.rl_updates):
        update = trainer.guarded_step(
            model,
            optimizer,
            step_fn,
            kl_soft=cfg.kl_soft,
            kl_hard=cfg.kl_hard,
            micro_batch=cfg.micro_batch,
            temperature=cfg.rl_temperature,
        )
        updates.append(update)
        if update["kl_guard"] != "ok" or not update["rows"]:
            break
    return updates


def curve_steps(cfg: LearnConfig) -> list[int]:
    """The RL step counts whose checkpoints the curve keeps (RL seed 0 only; the last step's is
    the final checkpoint, not kept twice)."""
    if cfg.rl_seed != 0 or not cfg.curve_steps.strip():
        return []
    return sorted({int(k) for k in cfg.curve_steps.split(",") if 0 < int(k) < cfg.rl_steps})


def curve_checkpoint(cfg: LearnConfig, steps: int) -> Path:
    return cfg.path(cfg.rl_name, f"checkpoint_{steps}")


def stage_eval_curve(cfg: LearnConfig, engines: Engines) -> dict:
    """The curve: each kept checkpoint of RL seed 0 on the unseen set (eval_<arm>_stepK/), with the
    same samples per task as the other evals. Each resumes from its outputs."""
    results = {}
    for k in curve_steps(cfg):
        if not curve_checkpoint(cfg, k).is_dir():
            raise RuntimeError(f"no {curve_checkpoint(cfg, k)}: run the rl stage first (it keeps it)")
        summary = stage_eval(
            cfg, f"{cfg.rl_name}_step{k}", functools.partial(rl_checkpoint, cfg, curve_checkpoint(cfg, k).name), engines
        )
        results[k] = {"passed": summary["unseen"]["passed"], "count": summary["unseen"]["count"]}
    return results


def _lr(cfg: LearnConfig, step: int, steps: list[dict]) -> tuple[float, float]:
    """This step's lr (linear warm-up times what the KL guard left) and the guard's scale."""
    scale = steps[-1]["lr_scale_next"] if steps else 1.0
    return cfg.rl_lr * min(1.0, (step + 1) / max(1, cfg.rl_warmup_steps)) * scale, scale


def _rl_step(
    cfg: LearnConfig,
    plan: list[list[str]],
    step: int,
    steps: list[dict],
    engine: Engine,
    model,
    tokenizer,
    optimizer,
    engine_time: dict,
) -> dict:
    """One step: group rollouts of the step's planned tasks against the engine (serving the
    current weights; a revisit of a task whose first group was flat is skipped), `rl_updates`
    updates (GRPO or RAFT) on their exact traces under the KL guard, the checkpoint saved.
    `engine_time`: the engine's start or weight load before this step, counted in its total."""
    from pi_env.collect.store import read_records
    from pi_env.learning.schedule import first_visit, flat

    started = time.monotonic() - sum(engine_time.values())
    tasks_by_id = {t.task_id: t for tasks in _rl_pool(cfg).values() for t in tasks}
    planned = plan[step]
    skipped = []
    if cfg.skip_flat_revisits:
        for task_id in planned:
            earlier = first_visit(plan, step, task_id)
            if earlier is not None and flat(
                [
                    r.get("reward")
                    for r in read_records(cfg.path(cfg.rl_name, f"step_{earlier}"))
                    if r["task_id"] == task_id
                ]
            ):
                skipped.append(task_id)
    tasks = [tasks_by_id[t] for t in planned if t not in skipped]
    records, rollouts_s = [], 0.0
    if tasks:
        records, rollouts_s = collect(
            tasks,
            cfg.path(cfg.rl_name, f"step_{step}"),
            rollout_config(cfg, engine, cfg.rl_temperature),
            group_size=cfg.group_size,
            concurrency=cfg.concurrency,
        )
    lr, scale = _lr(cfg, step, steps)
    train_started = time.monotonic()
    updates = _rl_update(cfg, model, optimizer, records, lr)
    # The guard halves the lr from the next step on when it acted (and it already undid a rollback).
    guard = next((u["kl_guard"] for u in updates if u["kl_guard"] != "ok"), "ok")
    scale = scale / 2 if guard != "ok" else scale
    kl = updates[-1]["kl_after"] if updates else None
    train_s = time.monotonic() - train_started
    # the policy, and the curve's checkpoint when this step's is kept (a rerun of the step overwrites it)
    kept = [curve_checkpoint(cfg, step + 1).name] if step + 1 in curve_steps(cfg) else []
    save_s = _save_rl_checkpoints(cfg, model, tokenizer, step, [*kept, "policy"], replayed=False)
    generation = sum(t.get("latency_s") or 0.0 for r in records for t in r.get("turns") or [])
    rollout_walls = sum(r.get("wall_s") or 0.0 for r in records)
    scores = score_records(records)
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(r["task_id"], []).append(r.get("reward"))
    first = updates[0] if updates else {}
    return {
        "step": step,
        "algorithm": cfg.rl_algorithm,
        "rl_seed": cfg.rl_seed,
        "visit": "revisit" if first_visit(plan, step, planned[0]) is not None else "first",
        "tasks": [t.task_id for t in tasks],
        "skipped_flat_revisits": skipped,
        "mean_reward": scores["mean_reward"],
        "pass_rate": scores["pass_rate"],
        "unscored": scores["unscored"],
        "group_rewards": groups,
        "groups_with_signal": sum(not flat(g) for g in groups.values()),
        "entropy_sampled": sampled_entropy(records),
        "rows_per_rollout": [len((r.get("training") or {}).get("segments") or []) for r in records],
        "generated_tokens": sum(t.get("completion_tokens") or 0 for r in records for t in r.get("turns") or []),
        "lr": lr,
        "kl_guard": guard,
        "kl_after": kl,
        "lr_scale_next": scale,
        **{k: first[k] for k in _UPDATE_STATS if k in first},
        "trained_rows": first.get("rows", 0),
        "skipped_update": first.get("skipped"),
        "updates": updates,
        "time_s": {
            **engine_time,
            "rollouts": round(rollouts_s, 1),
            "generation_summed": round(generation, 1),
            "pi_and_sandbox_summed": round(rollout_walls - generation, 1),
            "train": round(train_s, 1),
            "kl_guard": round(sum(u.get("guard_s") or 0 for u in updates), 1),
            "save": round(save_s, 1),
            "total": round(time.monotonic() - started, 1),
        },
    }


_UPDATE_STATS = (
    "loss",
    "grad_norm",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "clip_fraction",
    "kl_old_new_k3",
    "old_logprobs_missing",
    "tokens",
)


def sampled_entropy(records: list[dict]) -> float | None:
    """Mean -logprob of the tokens the policy sampled (the engine's logprobs, of the distribution
    it sampled from): a Monte-Carlo estimate of the policy's per-token entropy on its own
    rollouts. A collapse shows as a fall towards 0."""
    values = [
        -lp
        for r in records
        for s in (r.get("training") or {}).get("segments") or []
        for lp, m in zip(s["logprobs"], s["loss_mask"])
        if m and lp is not None
    ]
    return round(sum(values) / len(values), 4) if values else None


# ---------------------------------------------------------------------------------------------
# Report


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _arms(cfg: LearnConfig) -> list[str]:
    """The RL arms this run directory holds (rl/ = GRPO, rl_raft/ = RAFT, _seedK: other RL seeds),
    the configured one first, then by algorithm and seed."""
    found = [p.name for p in cfg.path().glob("rl*") if p.is_dir() and parse_arm(p.name)]
    found.sort(key=lambda n: (RL_ALGORITHMS.index(parse_arm(n)[0]), parse_arm(n)[1]))  # type: ignore[index]
    return list(dict.fromkeys([cfg.rl_name, *found]))


def stage_status(cfg: LearnConfig) -> dict[str, str]:
    """done / in progress / not started, per stage (and RL arm, and curve checkpoint), from the
    run directory's outputs."""
    done = {
        "tasks": cfg.path("tasks", "heldout.jsonl"),
        "oracle": cfg.path("oracle", "summary.json"),
        "sft": cfg.path("sft", "summary.json"),
        "probe": cfg.path("probe", "summary.json"),
        "retest_sft": cfg.path("eval_sft_retest", "summary.json"),
    }
    status = {}
    for stage in ("tasks", "oracle", "eval_base", "sft", "probe", "eval_sft", "retest_sft"):
        marker = done.get(stage, cfg.path(stage, "summary.json"))
        status[stage] = "not started" if stage == "tasks" and not marker.exists() else _progress(marker)
    for arm in _arms(cfg):
        finished = len(_jsonl(cfg.path(arm, "steps.jsonl")))
        status[arm] = (
            ("done" if finished >= cfg.rl_steps else f"{finished}/{cfg.rl_steps} steps")
            if cfg.path(arm).exists()
            else "not started"
        )
        status[f"eval_{arm}"] = _progress(cfg.path(f"eval_{arm}", "summary.json"))
    for k in curve_steps(cfg):  # the curve's checkpoints (RL seed 0 only)
        status[f"eval_curve_step{k}"] = _progress(cfg.path(f"eval_{cfg.rl_name}_step{k}", "summary.json"))
    return status


def _progress(summary: Path) -> str:
    """A stage is done once its summary is written, in progress (or stopped) while only its
    directory exists."""
    if summary.exists():
        return "done"
    return "in progress or stopped" if summary.parent.exists() else "not started"


def _eval_summary(cfg: LearnConfig, name: str) -> dict | None:
    """eval_<name>/summary.json, or what its stores hold if it stopped part-way (marked partial,
    never used for the targets)."""
    done = _read_json(cfg.path(f"eval_{name}", "summary.json"))
    if done:
        return done
    partial = {
        kind: {
            "partial": True,
            **score_records(_jsonl(cfg.path(f"eval_{name}", kind, "results.jsonl"))),
            "error_kinds": _error_kinds(cfg.path(f"eval_{name}", kind, "results.jsonl")),
        }
        for kind in ("greedy", *SAMPLED_SETS)
        if cfg.path(f"eval_{name}", kind, "results.jsonl").is_file()
    }
    return {"partial": True, **partial} if partial else None


def heldout_rewards(cfg: LearnConfig, name: str) -> dict[str, float]:
    """Task id -> reward of a finished eval's held-out rollouts (unscored ones left out; the
    first sample of each task)."""
    return {task: rewards[0] for task, rewards in eval_samples(cfg, name, "heldout").items()}


def eval_samples(cfg: LearnConfig, name: str, kind: str) -> dict[str, list[float]]:
    """Task id -> the scored rewards of a finished eval's sampled rollouts of set `kind`, in sample
    order (unscored ones left out; a task with none scored is absent)."""
    if not cfg.path(f"eval_{name}", "summary.json").is_file():
        return {}
    by_task: dict[str, list[tuple[int, float]]] = {}
    for r in _jsonl(cfg.path(f"eval_{name}", kind, "results.jsonl")):
        if r.get("reward") is not None:
            by_task.setdefault(r["task_id"], []).append((r.get("group_index") or 0, r["reward"]))
    return {task: [reward for _, reward in sorted(pairs)] for task, pairs in by_task.items()}


def revisit_gain(steps: list[dict]) -> dict | None:
    """Per RL task visited twice: its group's pass fraction and mean reward at the first visit and
    at the revisit, compared paired (in-distribution: the steps in between trained on these tasks)."""
    from pi_env.learning.stats import paired_bootstrap

    first: dict[str, list] = {}
    pairs = []
    for step in steps:
        for task_id, rewards in (step.get("group_rewards") or {}).items():
            scored = [r for r in rewards if r is not None]
            if not scored:
                continue
            if task_id in first:
                pairs.append((first[task_id], scored))
            else:
                first[task_id] = scored
    if not pairs:
        return None

    def rate(rewards):
        return sum(r >= 1.0 for r in rewards) / len(rewards)

    def points(result):
        return {"mean": round(100 * result["mean"], 1), "ci95": [round(100 * v, 1) for v in result["ci95"]]}

    return {
        "tasks": len(pairs),
        "pass_points": points(paired_bootstrap([rate(a) for a, _ in pairs], [rate(b) for _, b in pairs])),
        "reward_points": points(
            paired_bootstrap([sum(a) / len(a) for a, _ in pairs], [sum(b) / len(b) for _, b in pairs])
        ),
        "note": "in-distribution: the same RL tasks before and after the steps between two visits, which trained "
        "on them; only tasks whose first group was mixed are revisited (skip_flat_revisits), a selection "
        "on the first visit's outcome, so read it as a trend, not a held-out gain",
    }


def collapse_check(steps: list[dict]) -> dict:
    """Did a step make the policy worse? Judged on the same tasks (consecutive steps differ by
    their tasks' difficulty far more than by the weights): each revisit step's group mean rewards
    against its tasks' first visits, paired bootstrap 95 % CI in points. A `fall` is a CI entirely
    below 0; `collapsed` is a fall with no KL guard action at or between the two visits."""
    from pi_env.learning.stats import paired_bootstrap

    first: dict[str, tuple[float, int]] = {}
    revisits = []
    for step in steps:
        pairs = []
        for task_id, rewards in (step.get("group_rewards") or {}).items():
            scored = [r for r in rewards if r is not None]
            if not scored:
                continue
            if task_id in first:
                pairs.append((*first[task_id], sum(scored) / len(scored)))
            else:
                first[task_id] = (sum(scored) / len(scored), step["step"])
        if not pairs:
            continue
        diff = paired_bootstrap([before for before, _, _ in pairs], [after for _, _, after in pairs])
        since = min(k for _, k, _ in pairs)
        acted = any(s.get("kl_guard") not in (None, "ok") for s in steps if since <= s["step"] <= step["step"])
        revisits.append(
            {
                "step": step["step"],
                "tasks": len(pairs),
                "reward_points": round(100 * diff["mean"], 1),
                "ci95": [round(100 * v, 1) for v in diff["ci95"]],
                "kl_guard_acted": acted,
            }
        )
    falls = [r for r in revisits if r["ci95"][1] < 0]
    return {"revisits": revisits, "falls": falls, "collapsed": any(not f["kl_guard_acted"] for f in falls)}


def _sequences(cfg: LearnConfig, arms: list[str]) -> dict:
    """How many RL and held-out eval rollouts are one training sequence (token-in's promise), and
    how many were unscored, over the whole run directory."""
    records = [r for arm in arms for d in sorted(cfg.path(arm).glob("step_*")) for r in _jsonl(d / "results.jsonl")]
    records += [
        r
        for kind in SAMPLED_SETS
        for d in sorted(cfg.path().glob(f"eval_*/{kind}"))
        for r in _jsonl(d / "results.jsonl")
    ]
    traced = [len((r.get("training") or {}).get("segments") or []) for r in records if r.get("training")]
    return {
        "rollouts": len(records),
        "one_sequence": sum(n == 1 for n in traced),
        "with_trace": len(traced),
        "unscored": sum(r.get("reward") is None for r in records),
    }


# docs/learning_protocol.md: a change to what the report decides, or to how a run is made, is a
# new version. PROTOCOL_VERSION is the one this code's runs are made under (3: the sizes, the stage
# order, the run carried across machines). The decisive metric of each success rule, keyed by the
# version that fixed it (the compared quantity of its primary figure and collapse check (a)):
# version 1's pass rate and version 2's mean reward, both kept by version 3.
PROTOCOL_VERSION = 3
PROTOCOL_METRICS = {1: "pass", 2: "reward"}


def _figure(comparison: dict | None, metric: str = "pass", **extra) -> dict | None:
    """{mean, ci95} in points of a comparison's difference in `metric` ("pass": the pass rate,
    protocol version 1's; "reward": the mean reward, version 2's), with its task count."""
    if not comparison or not comparison.get("tasks"):
        return None
    points = comparison[f"{metric}_points"]
    return {**{k: points[k] for k in ("mean", "ci95")}, "tasks": comparison["tasks"], **extra}


def protocol_checks(cfg: LearnConfig, steps: list[dict], primary: dict | None) -> dict:
    """The checks of docs/learning_protocol.md for one RL arm, under every protocol version
    (`collapse` and `collapse_reasons` by version). Collapse: (a) the arm's unseen difference
    against SFT has a 95 % CI entirely below 0, in the version's metric (v1 the pass rate, v2
    the mean reward), or (b) a revisit step's paired reward difference against its tasks' first
    visits has a CI entirely below 0 (`collapse_check` falls, whether or not the KL guard acted),
    or (c) a step's sampled-token entropy is below a quarter of step 0's. KL: every update's
    measured KL(before||after) at most kl_soft. Neither removes the arm from the pooled estimate;
    both are reported."""
    shared = []
    for fall in collapse_check(steps)["falls"]:
        shared.append(f"revisit step {fall['step']}: reward vs first visits CI {fall['ci95']} below 0")
    entropy = [(s["step"], s["entropy_sampled"]) for s in steps if s.get("entropy_sampled") is not None]
    for step, value in entropy[1:]:
        if value < 0.25 * entropy[0][1]:
            shared.append(f"step {step}: sampled entropy {value} < 1/4 of step 0's {entropy[0][1]}")
    reasons = {}
    for version, metric in PROTOCOL_METRICS.items():
        figure = _figure(primary, metric)
        below = [f"unseen {metric} vs SFT: CI {figure['ci95']} below 0"] if figure and figure["ci95"][1] < 0 else []
        reasons[str(version)] = below + shared
    kls = [(s["step"], s["kl_after"]) for s in steps if s.get("kl_after") is not None]
    over = [{"step": step, "kl_after": kl} for step, kl in kls if kl > cfg.kl_soft]
    return {
        "collapse": {version: bool(found) for version, found in reasons.items()},
        "collapse_reasons": reasons,
        "kl_max": max((kl for _, kl in kls), default=None),
        "kl_limit": cfg.kl_soft,
        "kl_over_limit": over,
        "kl_check_passed": not over if kls else None,
    }


def stage_report(cfg: LearnConfig) -> dict:
    """report.json, learn_samples.jsonl and learning_curve.png from whatever the run directory
    holds: a run stopped part-way is reported as far as it got (`status` says which stages
    finished). The primary figure is RL - SFT on the unseen-template set, per-task means over
    samples, pooled over the GRPO seeds found, in each protocol version's metric
    (docs/learning_protocol.md: v1 the pass rate, v2 the mean reward)."""
    from pi_env.learning.stats import compare_samples

    arms = _arms(cfg)

    def compare(before: dict, afters: list[dict]) -> dict | None:
        afters = [a for a in afters if a]
        return compare_samples(before, afters, seed=cfg.seed) if before and afters else None

    sft = {kind: eval_samples(cfg, "sft", kind) for kind in SAMPLED_SETS}
    retest = {kind: eval_samples(cfg, "sft_retest", kind) for kind in SAMPLED_SETS}
    comparisons = {
        arm: {kind: compare(sft[kind], [eval_samples(cfg, arm, kind)]) for kind in SAMPLED_SETS} for arm in arms
    }
    # The control: the SFT checkpoint evaluated again on the same tasks, new samples. Its
    # difference is the paired eval's own noise; its CI should hold 0.
    control = {kind: compare(sft[kind], [retest[kind]]) for kind in SAMPLED_SETS}
    grpo = {
        parse_arm(arm)[1]: arm  # type: ignore[index]
        for arm in arms
        if parse_arm(arm)[0] == "grpo" and eval_samples(cfg, arm, "unseen")  # type: ignore[index]
    }
    seeds = sorted(grpo)
    pooled = {kind: compare(sft[kind], [eval_samples(cfg, grpo[s], kind) for s in seeds]) for kind in SAMPLED_SETS}
    # Secondary: the baseline as both SFT evals pooled (2 x samples_per_task per task).
    both_sft = {t: sft["unseen"][t] + retest["unseen"].get(t, []) for t in sft["unseen"]} if retest["unseen"] else {}
    pooled_vs_both = compare(both_sft, [eval_samples(cfg, grpo[s], "unseen") for s in seeds])
    stage_times = _read_json(cfg.path("stage_times.json")) or {}
    rl: dict[str, dict[str, Any]] = {}
    for arm in arms:
        steps = _jsonl(cfg.path(arm, "steps.jsonl"))
        rl[arm] = {
            "algorithm": steps[0]["algorithm"] if steps else (parse_arm(arm) or (cfg.rl_algorithm,))[0],
            "rl_seed": (parse_arm(arm) or (None, cfg.rl_seed))[1],
            "steps": steps,
            "eval": _eval_summary(cfg, arm),
            "vs_sft_unseen": comparisons[arm]["unseen"],
            "vs_sft_heldout": comparisons[arm]["heldout"],
            "revisit_gain": revisit_gain(steps),
            "collapse_check": collapse_check(steps),
            "checks": protocol_checks(cfg, steps, comparisons[arm]["unseen"]),
            "kl_guard_acted": [
                {"step": s["step"], "action": s["kl_guard"], "kl_after": s["kl_after"]}
                for s in steps
                if s.get("kl_guard") not in (None, "ok")
            ],
        }
    sft_summary = _eval_summary(cfg, "sft") or {}
    samples_per_task = (sft_summary.get("unseen") or {}).get("samples_per_task", cfg.samples_per_task)
    curve_evals = sorted(d.name.removeprefix("eval_") for d in cfg.path().glob("eval_rl*_step*"))
    all_rows = [row for name in ["sft", "sft_retest", *arms, *curve_evals] for row in sample_rows(cfg, name)]
    if all_rows:
        _write_jsonl(cfg.path("learn_samples.jsonl"), all_rows)
    # The figures of every protocol version: v1's in the pass rate, v2's in the mean reward.
    figures: dict[str, Any] = {}
    for metric in PROTOCOL_METRICS.values():
        figures |= {
            f"unseen_rl_minus_sft_{metric}": _figure(pooled["unseen"], metric, seeds=seeds),
            f"unseen_rl_minus_sft_{metric}_by_seed": {
                str(seed): _figure(comparisons[grpo[seed]]["unseen"], metric) for seed in seeds
            },
            f"heldout_rl_minus_sft_{metric}": _figure(
                pooled["heldout"], metric, seeds=seeds, label="in-distribution: new instances of the train templates"
            ),
            f"unseen_rl_minus_pooled_sft_{metric}": _figure(
                pooled_vs_both,
                metric,
                label="secondary: the baseline is both SFT evals pooled (eval_sft and the retest)",
            ),
            f"sft_retest_minus_sft_unseen_{metric}": _figure(
                control["unseen"], metric, label="control: CI should hold 0"
            ),
        }
    # The curve: the unseen-set figures of seed 0 after each kept checkpoint, then the final one.
    curve = []
    if 0 in grpo:
        points = [
            (int(d.name.rsplit("_step", 1)[1]), d.name.removeprefix("eval_"))
            for d in cfg.path().glob(f"eval_{grpo[0]}_step*")
            if d.name.rsplit("_step", 1)[1].isdigit()
        ]
        finished = len(_jsonl(cfg.path(grpo[0], "steps.jsonl")))
        for k, name in [*sorted(points), (finished, grpo[0])]:
            comparison = compare(sft["unseen"], [eval_samples(cfg, name, "unseen")])
            if comparison and comparison.get("tasks"):
                curve.append(
                    {"rl_steps": k, "checkpoint": name}
                    | {f"unseen_rl_minus_sft_{m}": _figure(comparison, m) for m in PROTOCOL_METRICS.values()}
                )
    paired_stages = ["eval_sft", *[name for arm in arms for name in (arm, f"eval_{arm}")]]
    report = {
        # The version the run was made under; its success rules are keyed by the version that
        # fixed each (docs/learning_protocol.md), and every one is reported.
        "protocol_version": PROTOCOL_VERSION,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "status": stage_status(cfg),
        # Every start, stop and end of the run, with its commit and load (scripts/learn_on_cpu.sh
        # writes them; the protocol reports every run started, stopped or failed ones too).
        "runs_log": _lines(cfg.path(RUNS_LOG)),
        # The primary figures: on unseen templates, per-task mean over samples, RL minus SFT in
        # points, pooled over the GRPO seeds, paired cluster bootstrap. Version 1 decides on the
        # pass rate (unseen_rl_minus_sft_pass), version 2 on the mean reward (..._reward).
        "seeds": seeds,
        "samples_per_task": samples_per_task,
        **figures,
        "curve": curve,
        "success_rule": {
            str(version): {
                "figure": f"unseen_rl_minus_sft_{metric}",
                "rule": f"pooled unseen RL - SFT {metric} 95 % CI low end > 0, with 3 RL seeds",
                "met": (figure["ci95"][0] > 0) if figure and len(seeds) >= 3 else None,
            }
            for version, metric in PROTOCOL_METRICS.items()
            for figure in [figures[f"unseen_rl_minus_sft_{metric}"]]
        },
        "samples_jsonl": str(cfg.path("learn_samples.jsonl")) if all_rows else None,
        "tasks": _read_json(cfg.path("tasks", "summary.json")),
        "stages": {
            "base": _eval_summary(cfg, "base"),
            "oracle": _read_json(cfg.path("oracle", "summary.json")),
            "sft": {
                "train": _read_json(cfg.path("sft", "summary.json")),
                "eval": _eval_summary(cfg, "sft"),
                "history": _jsonl(cfg.path("sft", "history.jsonl")),
            },
            "probe": _read_json(cfg.path("probe", "summary.json")),
            "sft_retest": {
                "eval": _eval_summary(cfg, "sft_retest"),
                "vs_sft_unseen": control["unseen"],
                "vs_sft_heldout": control["heldout"],
            },
            **rl,
        },
        "stage_wall_s": stage_times,
        "stage_load_average": _read_json(cfg.path("stage_load.json")),
        "training_sequences": _sequences(cfg, arms),
        "rl_and_paired_evals_wall_s": round(sum(stage_times.get(s, 0) for s in paired_stages), 1)
        if stage_times
        else None,
        "total_wall_s": round(sum(stage_times.values()), 1) if stage_times else None,
        "targets": _targets(cfg, comparisons),
    }
    report["targets"]["sft_retest_minus_sft_pass"] = _figure(control["unseen"] or control["heldout"])
    rl_arm = rl.get(cfg.rl_name)
    if rl_arm and rl_arm["steps"]:
        report["targets"]["no_collapse"] = {v: not found for v, found in rl_arm["checks"]["collapse"].items()}
    _write_json(cfg.path("report.json"), report)
    try:
        plot(report, cfg.path("learning_curve.png"))
    except ImportError as error:
        log(f"no plot ({error}): install matplotlib (pi-env[collect])")
    return report


RUNS_LOG = "runs_started.txt"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _error_kinds(path: Path) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for record in _jsonl(path):
        if record.get("error_kind"):
            kinds[record["error_kind"]] = kinds.get(record["error_kind"], 0) + 1
    return kinds


def _targets(cfg: LearnConfig, comparisons: dict) -> dict:
    """The claims in a form a script can check, per RL arm of the configured seed, on the primary
    set (unseen; a run directory from before it existed: the in-distribution held-out set, said in
    `primary_set`). RL > SFT is claimed only when the paired 95 % CI lies above 0, never on a
    point estimate; the pooled, three-seed rule is the report's `success_rule`."""

    def greedy(name):
        summary = _read_json(cfg.path(f"eval_{name}", "summary.json"))
        return summary["greedy"]["pass_rate"] if summary and summary.get("greedy") else None

    base, sft = greedy("base"), greedy("sft")
    targets: dict[str, Any] = {
        "sft_minus_base_greedy_points": round(100 * (sft - base), 1) if None not in (sft, base) else None,
        "sft_target_met": (sft - base) >= 0.20 if None not in (sft, base) else None,
    }
    for algorithm, name in (("grpo", "rl"), ("raft", "raft")):
        arm = arm_name(algorithm, cfg.rl_seed)
        by_set = comparisons.get(arm) or {}
        kind = "unseen" if by_set.get("unseen") else "heldout"
        comparison = by_set.get(kind)
        if algorithm == "grpo" or comparison:
            targets[f"{name}_minus_sft_pass"] = _figure(comparison)
            targets[f"{name}_minus_sft_reward"] = _figure(comparison, "reward")
            targets[f"{name}_mcnemar_p" if name != "rl" else "mcnemar_p"] = (
                (comparison.get("mcnemar") or {}).get("p") if comparison else None
            )
            targets[f"{name}_target_met"] = comparison["pass_points"]["ci95"][0] > 0 if comparison else None
            if algorithm == "grpo":
                targets["primary_set"] = kind if comparison else None
                targets["paired_tasks"] = comparison["tasks"] if comparison else 0
                heldout = by_set.get("heldout")
                targets["heldout_tasks"] = heldout["tasks"] if heldout else 0  # in-distribution
    return targets


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report.get("curve") or []
    fig, axes = plt.subplots(1, 3 if curve else 2, figsize=(18 if curve else 12, 4.5))
    left, right = axes[0], axes[1]
    stages = report["stages"]
    arms = [(name, stages[name]) for name in stages if parse_arm(name)]

    def arm_label(name: str) -> str:
        algorithm, seed = parse_arm(name)  # type: ignore[misc]
        return f"SFT+{algorithm.upper()}" + (f"\nseed {seed}" if seed else "")

    checkpoints = [("base", stages["base"]), ("SFT", stages["sft"]["eval"])] + [
        (arm_label(n), a["eval"]) for n, a in arms
    ]
    width = 0.27
    for offset, kind, color, legend in (
        (-width, "unseen", "#4c72b0", "unseen templates, sampled (paired, primary)"),
        (0.0, "heldout", "#8fb0d9", "in-distribution held-out, sampled (paired)"),
        (width, "greedy", "#bbbbbb", "greedy, 20 eval tasks (secondary)"),
    ):
        xs, rates, labels = [], [], []
        for x, (_, summary) in enumerate(checkpoints):
            result = (summary or {}).get(kind)
            if result and result.get("count"):
                xs.append(x + offset)
                rates.append(100 * (result["pass_rate"] or 0))
                labels.append(
                    f"{result['passed']}/{result['count']}"
                    + (" partial" if result.get("partial") else "")
                    + (f"\n{result['unscored']} unscored" if result["unscored"] else "")
                )
        drawn = left.bar(xs, rates, width, color=color, label=legend)
        for bar, label in zip(drawn, labels):
            left.annotate(
                label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
            )
    left.set_xticks(range(len(checkpoints)), [name for name, _ in checkpoints], fontsize=8)
    left.legend(fontsize=8, loc="upper left")
    targets = report["targets"]
    lines = []
    figures = [
        (report.get("unseen_rl_minus_sft_pass"), f"GRPO - SFT, unseen pass, seeds {report.get('seeds')}"),
        (report.get("unseen_rl_minus_sft_reward"), "GRPO - SFT, unseen mean reward (protocol v2)"),
        (report.get("heldout_rl_minus_sft_pass"), "GRPO - SFT, in-distribution"),
        (targets.get("raft_minus_sft_pass"), "RAFT - SFT"),
    ]
    for figure, name in figures:
        if figure:
            low, high = figure["ci95"]
            lines.append(f"{name}: {figure['mean']:+.1f} pts, 95% CI [{low:+.1f}, {high:+.1f}]")
    left.set_title("pass rate by checkpoint" + ("\n" + "\n".join(lines) if lines else ""), fontsize=9)
    left.set_ylim(0, 100)
    left.set_ylabel("pass rate (%)")
    steps = arms[0][1]["steps"] if arms else []
    sft_history = stages["sft"]["history"]
    if not steps and sft_history:  # no RL yet: the SFT loss is the curve there is
        right.plot([h["step"] for h in sft_history], [h["loss"] for h in sft_history], marker="o")
        right.set_xlabel(f"SFT step (batch of {sft_history[0]['rows']:d})")
        right.set_ylabel("loss (mean NLL of assistant tokens)")
        right.set_title("SFT warm-up")
    if steps:
        xs = [s["step"] for s in steps]
        right.plot(xs, [s["mean_reward"] or 0 for s in steps], marker="o", label="mean reward (RL groups)")
        right.plot(xs, [s["pass_rate"] or 0 for s in steps], marker="s", label="pass rate (RL groups)")
        right.plot(xs, [s.get("entropy_sampled") or 0 for s in steps], marker="^", label="entropy (nats/token)")
        for s in steps:
            if s.get("kl_guard") not in (None, "ok"):
                right.axvline(s["step"], color="red", alpha=0.3)
        right.set_xlabel(f"{arms[0][1]['algorithm'].upper()} step (second half: revisits; red: KL guard acted)")
        right.set_ylim(0, max(1.0, max(s.get("entropy_sampled") or 0 for s in steps) * 1.1))
        right.legend(fontsize=8)
        right.set_title(f"on-policy RL (sampled, T={report['config']['rl_temperature']})")
    if curve:
        plot_curve(axes[2], report)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curve(ax: Any, report: dict) -> None:
    """The primary figure against RL steps: seed 0's kept checkpoints and its final one, each
    seed's final figure beside it and the pooled one, all with their 95 % CIs, and 0 (SFT)."""
    ax.axhline(0, color="#888888", linewidth=1)

    def draw(xs: list[float], figures: list[dict], **style: Any) -> None:
        means = [f["mean"] for f in figures]
        errors = [[f["mean"] - f["ci95"][0] for f in figures], [f["ci95"][1] - f["mean"] for f in figures]]
        ax.errorbar(xs, means, yerr=errors, capsize=3, **style)

    points = [p for p in report["curve"] if p.get("unseen_rl_minus_sft_pass")]
    draw(
        [p["rl_steps"] for p in points],
        [p["unseen_rl_minus_sft_pass"] for p in points],
        marker="o",
        label="seed 0 after k steps",
    )
    final = points[-1]["rl_steps"] if points else 0
    by_seed = report.get("unseen_rl_minus_sft_pass_by_seed") or {}
    others = [(seed, f) for seed, f in sorted(by_seed.items()) if seed != "0" and f]
    for i, (seed, figure) in enumerate(others):
        draw([final + 0.15 * (i + 1)], [figure], marker="s", linestyle="none", label=f"seed {seed}, final")
    pooled = report.get("unseen_rl_minus_sft_pass")
    if pooled:
        draw(
            [final + 0.15 * (len(others) + 1)],
            [pooled],
            marker="D",
            linestyle="none",
            color="black",
            label=f"pooled, seeds {pooled.get('seeds')}",
        )
    ax.set_xlim(-0.5, final + 1)
    ax.set_xlabel("GRPO steps (0 = the SFT checkpoint)")
    ax.set_ylabel("RL - SFT, unseen sampled pass (points)")
    ax.set_title("the curve: unseen templates, 95 % CIs (paired cluster bootstrap)", fontsize=9)
    ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------
# Command line: python -m pi_env.learning STAGE [--options]


def run_stage(cfg: LearnConfig, stage: str, engines: Engines) -> dict:
    """Run one stage and record its wall time and the load average at its end. A stage stopped
    or failed part-way keeps the time it spent (stage_partial_times.json) and adds it when it
    resumes, so a stage split over sessions reports its whole time; a stage already done, which
    returns at once from its outputs, keeps the time of the runs that did the work."""
    if stage == "report":
        return stage_report(cfg)
    key = {"rl": cfg.rl_name, "eval_rl": f"eval_{cfg.rl_name}", "eval_curve": f"eval_curve_{cfg.rl_name}"}.get(
        stage, stage
    )
    times_path, partial_path = cfg.path("stage_times.json"), cfg.path("stage_partial_times.json")
    done_before = key in (_read_json(times_path) or {})
    started = time.monotonic()
    try:
        result = _stage(cfg, stage, engines)
    except BaseException:  # SIGTERM is SystemExit here (__main__): the time so far is kept
        if not done_before:
            partial = _read_json(partial_path) or {}
            partial[key] = round(partial.get(key, 0) + time.monotonic() - started, 1)
            _write_json(partial_path, partial)
        raise
    if not done_before:
        partial = _read_json(partial_path) or {}
        times = _read_json(times_path) or {}
        times[key] = round(partial.pop(key, 0) + time.monotonic() - started, 1)
        _write_json(times_path, times)
        _write_json(partial_path, partial)
        # The machine is shared: each figure with the 1/5/15-min load average at its end.
        loads = _read_json(cfg.path("stage_load.json")) or {}
        loads[key] = [round(v, 2) for v in os.getloadavg()]
        _write_json(cfg.path("stage_load.json"), loads)
    return result


def _stage(cfg: LearnConfig, stage: str, engines: Engines) -> dict:
    if stage in ("tasks", "oracle", "sft"):
        engines.close()  # CPU work that needs no engine: an idle vLLM would only hold memory
    if stage == "tasks":
        result = stage_tasks(cfg)
        _write_json(cfg.path("tasks", "summary.json"), result)
        return result
    if stage == "oracle":
        return stage_oracle(cfg)
    if stage == "eval_base":
        return stage_eval(cfg, "base", cfg.base_model, engines)
    if stage == "sft":
        return stage_sft(cfg)
    if stage == "probe":
        return stage_probe(cfg, engines)
    if stage == "eval_sft":
        return stage_eval(cfg, "sft", functools.partial(sft_policy, cfg), engines)
    if stage == "rl":
        return stage_rl(cfg, engines)
    if stage == "eval_rl":
        return stage_eval(cfg, cfg.rl_name, functools.partial(rl_checkpoint, cfg), engines)
    if stage == "eval_curve":
        return stage_eval_curve(cfg, engines)
    if stage == "retest_sft":
        return stage_eval(cfg, "sft_retest", functools.partial(sft_policy, cfg), engines)
    raise SystemExit(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
