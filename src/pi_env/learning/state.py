"""A learning run's state that crosses machines: its records without its weights.

A run takes longer than a session, and the next session may be on another machine. What goes on
is the run directory's records; the weights are rebuilt from them there (`stage_sft` retrains on
the same rows with the same seed, `stage_rl` replays each arm from SFT through its stored steps)
and each rebuilt checkpoint is checked against the digest recorded when it was first made
(`weights.json`): a checkpoint that differs is never used in its place.

`pack(run_dir, state_dir)` writes the state, `restore(state_dir, run_dir)` puts it back into a run
directory that lacks it: a file the run directory has is never overwritten, except that an
append-only log it has begun gets the carried lines in front. What the state holds:

- every file of the run directory as it is (tasks, summaries, histories, steps, times, loads,
  the run log, `weights.json`), except
- checkpoints (directories holding `model.safetensors`: rebuilt), the engines' logs (`logs/`),
  locks, pid and temp files;
- collect stores (`results.jsonl`, `discarded.jsonl`) gzipped, each record without its token
  arrays and tool schemas, which no later stage reads: kept are its rewards, error kinds, timings,
  conversation and the shape of its training trace (one entry per sequence, with its length). An
  RL step's records keep their training traces whole: the replay trains on them.

Pure Python (no torch): the report's venv packs too.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

from pi_env.errors import InfraError

WEIGHTS_FILE = "weights.json"
STORE_FILES = ("results.jsonl", "discarded.jsonl")
_LEFT_OUT = (".lock", ".tmp", ".pid")
# Arrays of token ids and logprobs in a turn record (the training trace has its own rule).
_TURN_ARRAYS = ("prompt_token_ids", "completion_token_ids", "per_token_logps", "top_logprobs")


class RebuildMismatch(InfraError, RuntimeError):
    """A checkpoint rebuilt from a run's records is not the one it replaces (another CPU kind,
    torch or transformers version, or changed training code)."""


# ---------------------------------------------------------------------------------------------
# Digests


def checkpoint_digest(model_dir: str | Path) -> str:
    """sha256 over a checkpoint's tensors (name, dtype, shape and raw bytes, in name order),
    read from its safetensors files: the same weights give the same digest whatever the file
    layout or its metadata."""
    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors checkpoint")
    tensors = []
    for path in files:
        with path.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        tensors += [(name, info, path, 8 + size) for name, info in header.items()]
    for name, info, path, start in sorted(tensors, key=lambda t: t[0]):
        digest.update(f"{name}|{info['dtype']}|{info['shape']}|".encode())
        begin, end = info["data_offsets"]
        with path.open("rb") as handle:
            handle.seek(start + begin)
            remaining = end - begin
            while remaining:
                chunk = handle.read(min(remaining, 1 << 24))
                if not chunk:
                    raise ValueError(f"{path}: tensor {name} is cut short")
                digest.update(chunk)
                remaining -= len(chunk)
    return digest.hexdigest()


def recorded_weights(run_dir: str | Path) -> dict:
    path = Path(run_dir, WEIGHTS_FILE)
    return json.loads(path.read_text()) if path.is_file() else {}


def made_on() -> dict:
    """What made a checkpoint, for a mismatch to be explained: the CPU model, its flags' digest and
    the torch version (None where torch is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    cpu: dict[str, str] = {}
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            cpu.setdefault(key.strip(), value.strip())
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = None
    flags = cpu.get("flags", "")
    return {
        "cpu": cpu.get("model name"),
        "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:12],
        "torch": torch,
    }


def record_weights(run_dir: str | Path, checkpoint: str, **facts) -> str:
    """Record the digest of the checkpoint at `checkpoint` (relative to the run directory), with
    `facts` (e.g. the RL steps it holds) and what made it. Returns the digest."""
    digest = checkpoint_digest(Path(run_dir, checkpoint))
    weights = recorded_weights(run_dir)
    weights[checkpoint] = {"sha256": digest, **facts, "made_on": made_on()}
    _write_bytes(Path(run_dir, WEIGHTS_FILE), (json.dumps(weights, indent=1, sort_keys=True) + "\n").encode())
    return digest


def check_rebuilt(run_dir: str | Path, checkpoint: str, **facts) -> str:
    """Check a rebuilt checkpoint against its recorded digest; a mismatch removes it and raises
    RebuildMismatch. A checkpoint never recorded (or recorded for other `facts`) is recorded now."""
    recorded = recorded_weights(run_dir).get(checkpoint)
    if not recorded or any(recorded.get(k) != v for k, v in facts.items()):
        return record_weights(run_dir, checkpoint, **facts)
    digest = checkpoint_digest(Path(run_dir, checkpoint))
    if digest != recorded["sha256"]:
        shutil.rmtree(Path(run_dir, checkpoint), ignore_errors=True)
        raise RebuildMismatch(
            f"{checkpoint} rebuilt from the run's records has weights {digest[:12]}, not the recorded "
            f"{recorded['sha256'][:12]} ({Path(run_dir, WEIGHTS_FILE)}): this machine ({made_on()}) or the "
            f"training code differs from what made it ({recorded.get('made_on')}). The run cannot go on with "
            "the same checkpoints here; start a new run directory (and say so in its report)"
        )
    return digest


# ---------------------------------------------------------------------------------------------
# Pack and restore


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def slim_record(record: dict, *, keep_training: bool) -> dict:
    """A stored rollout without its token arrays and tool schemas (see the module docstring)."""
    slim = {k: v for k, v in record.items() if k != "tools"}
    if isinstance(record.get("turns"), list):
        slim["turns"] = [
            {k: v for k, v in turn.items() if k not in _TURN_ARRAYS} if isinstance(turn, dict) else turn
            for turn in record["turns"]
        ]
    training = record.get("training")
    if not keep_training and isinstance(training, dict):
        slim["training"] = {
            **{k: v for k, v in training.items() if k != "segments"},
            "segments": [{"length": len(s.get("token_ids") or [])} for s in training.get("segments") or []],
        }
    return slim


def _is_checkpoint(directory: Path) -> bool:
    return (directory / "model.safetensors").is_file() or any(directory.glob("model-*.safetensors"))


def _is_rl_step_store(relative: Path) -> bool:
    return len(relative.parts) >= 2 and relative.parts[0].startswith("rl") and relative.parts[1].startswith("step_")


def _record_if_new(run_dir: Path, checkpoint: Path) -> None:
    """Record the digest of a checkpoint made before digests were recorded (with the RL steps it
    holds: a curve's checkpoint_K holds K, an arm's policy the steps in its steps.jsonl)."""
    if str(checkpoint) in recorded_weights(run_dir):
        return
    facts = {}
    if checkpoint.name.startswith("checkpoint_"):
        facts["steps"] = int(checkpoint.name.removeprefix("checkpoint_"))
    elif Path(run_dir, checkpoint.parent, "steps.jsonl").is_file():
        steps = Path(run_dir, checkpoint.parent, "steps.jsonl").read_text().splitlines()
        facts["steps"] = sum(1 for line in steps if line.strip())
    record_weights(run_dir, str(checkpoint), **facts)


def pack(run_dir: str | Path, state_dir: str | Path) -> dict:
    """Write the run's state into `state_dir` (see the module docstring), first recording in the
    run's weights.json the digest of any checkpoint it lacks. A file already there is
    replaced, never removed: packing a wrong or empty run directory loses nothing. Gzip headers
    carry no time: the same records pack to the same bytes, so an unchanged state is no change
    to commit. Returns counts and bytes."""
    run_dir, state_dir = Path(run_dir), Path(state_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no run directory to pack")
    stores = files = size = 0
    for root, dirs, _ in os.walk(run_dir):  # first, so weights.json is packed with every digest
        for checkpoint in sorted(d for d in dirs if _is_checkpoint(Path(root, d))):
            _record_if_new(run_dir, Path(root, checkpoint).relative_to(run_dir))
    for root, dirs, names in os.walk(run_dir):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if not _is_checkpoint(here / d))
        for name in sorted(names):
            source = here / name
            relative = source.relative_to(run_dir)
            if name.endswith(_LEFT_OUT) or relative.parts[0] == "logs" or source.is_symlink():
                continue
            if name in STORE_FILES:
                keep = _is_rl_step_store(relative)
                lines = [
                    json.dumps(slim_record(json.loads(line), keep_training=keep), sort_keys=True)
                    for line in source.read_text().splitlines()
                    if line.strip()
                ]
                target = state_dir / relative.with_name(name + ".gz")
                data = gzip.compress("".join(line + "\n" for line in lines).encode(), mtime=0)
                stores += 1
            else:
                target = state_dir / relative
                data = source.read_bytes()
                files += 1
            if not (target.is_file() and target.read_bytes() == data):
                _write_bytes(target, data)
            size += len(data)
    return {"state_dir": str(state_dir), "files": files, "stores": stores, "bytes": size}


def restore(state_dir: str | Path, run_dir: str | Path) -> dict:
    """Put the state into `run_dir`: each file it lacks (gzipped stores unpacked). Returns what
    was restored."""
    state_dir, run_dir = Path(state_dir), Path(run_dir)
    if not state_dir.is_dir():
        return {"restored": 0}
    restored = 0
    for source in sorted(p for p in state_dir.rglob("*") if p.is_file()):
        relative = source.relative_to(state_dir)
        if relative.name.endswith(".gz") and relative.name[: -len(".gz")] in STORE_FILES:
            target = run_dir / relative.with_name(relative.name[: -len(".gz")])
        else:
            target = run_dir / relative
        data = gzip.decompress(source.read_bytes()) if source.name.endswith(".gz") else source.read_bytes()
        if target.exists():
            if not _is_log(target) or target.read_bytes().startswith(data):
                continue
            # An append-only log this machine has begun (the run's first lines here): the carried
            # lines go in front, so the log stays whole. Written in place: a writer holding it
            # open (O_APPEND) goes on appending to the same file.
            with target.open("r+b") as handle:
                begun = handle.read()
                handle.seek(0)
                handle.write(data + begun)
        else:
            _write_bytes(target, data)
        restored += 1
    return {"restored": restored}


def _is_log(path: Path) -> bool:
    return path.suffix == ".log" or path.name == "runs_started.txt"
