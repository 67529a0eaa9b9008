"""`python -m pi_env.learning STAGE... --run-dir DIR [--option value]`: run stages of the
learning run in order (each resumes from its outputs); `all` runs every stage. With
`--state-dir S` the run is carried across machines (pi_env.learning.state): restored from S
first, packed into S after; `pack` or `restore --run-dir DIR --state-dir S` only does that, and `rebuild` only
brings back every checkpoint a carried run lacks (checked against its recorded digest)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import typing
from pathlib import Path

from pi_env.learning import state
from pi_env.learning.pipeline import STAGES, Engines, LearnConfig, log, rebuild_checkpoints, run_stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pi_env.learning", description=__doc__)
    parser.add_argument("stages", nargs="+", help=f"all, or some of: {', '.join(STAGES)}")
    hints = typing.get_type_hints(LearnConfig)
    for f in dataclasses.fields(LearnConfig):
        if f.name == "extra":
            continue
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=dataclasses.MISSING)
        elif f.name in ("families", "rl_families"):
            parser.add_argument(
                flag, default=None, help="comma-separated coding families (default: all; for RL: the probe's pick)"
            )
        elif kind in (int, float, Path, str) or f.name in ("sft_limit", "eval_limit"):
            convert = int if f.name in ("sft_limit", "eval_limit") else kind
            parser.add_argument(
                flag,
                type=convert,
                required=f.name == "run_dir",
                default=None if f.name == "run_dir" else dataclasses.MISSING,
            )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="carry the run across machines (pi_env.learning.state): restore the run directory from this "
        "state before the stages, pack it into it after them (also when stopped); see pack, restore, rebuild",
    )
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so a stage's engine is stopped and its stores closed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    values = {k: v for k, v in vars(args).items() if k not in ("stages", "state_dir") and v is not dataclasses.MISSING}
    for name in ("families", "rl_families"):
        if values.get(name):
            values[name] = values[name].split(",")
    cfg = LearnConfig(**values)
    stages = list(STAGES) if args.stages == ["all"] else args.stages
    if args.stages in (["pack"], ["restore"]) and not args.state_dir:
        parser.error(f"{args.stages[0]}: give --state-dir")
    if args.stages not in (["pack"], ["restore"], ["rebuild"]):
        for stage in stages:
            if stage not in STAGES:
                parser.error(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}; or pack, restore or rebuild alone")
    if args.stages == ["pack"]:
        log(f"packed: {state.pack(cfg.run_dir, args.state_dir)}")
        return 0
    if args.state_dir:  # before anything else reads the run directory
        log(f"restored from {args.state_dir}: {state.restore(args.state_dir, cfg.run_dir)}")
    if args.stages == ["restore"]:
        return 0
    if args.stages == ["rebuild"]:
        log(f"checkpoints: {json.dumps(rebuild_checkpoints(cfg), indent=1)}")
        return 0
    try:
        # One engine across consecutive stages that serve checkpoints (probe -> eval -> RL -> eval).
        with Engines(cfg) as engines:
            for stage in stages:
                log(f"stage {stage}")
                result = run_stage(cfg, stage, engines)
                if stage != "report":
                    log(f"stage {stage} done: {json.dumps(result, default=str)[:400]}")
    finally:  # after every stage, and when stopped part-way (what a collect stored is kept)
        if args.state_dir:
            log(f"packed: {state.pack(cfg.run_dir, args.state_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
