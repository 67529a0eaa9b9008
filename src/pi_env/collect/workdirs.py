"""Kept work dirs beside a dataset: `DIR/workdirs/<key>.tar.gz`, one per record (`pi-env collect
--keep-workdir`, read by `pi-env reverify`).

The file's name is a hash of the record id (a task id may hold any character), never taken from
the record; the record's `workdir` says whether it was kept, its size and sha256 (reverify checks
both before reading it), or why it was not. The archive is written (fsync, atomic rename) before
its record is appended, so a stored record's archive is on disk; one left by a run killed in
between is rewritten when the rollout is run again.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

from ..results import RolloutResult

WORKDIRS = "workdirs"


def workdir_file(record_id: str) -> str:
    """The kept work dir of a record, relative to the dataset directory."""
    return f"{WORKDIRS}/{hashlib.sha256(record_id.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}.tar.gz"


def store_workdir(out_dir: Path, record_id: str, result: RolloutResult) -> dict[str, Any]:
    """Write the rollout's kept work dir (if any) and return the record's `workdir` entry."""
    if result.workdir_archive is None:
        reason = result.workdir_not_kept or (
            f"the rollout ended before verify ({result.error_kind or 'no agent'}): no work dir to keep"
        )
        return {"kept": False, "file": None, "bytes": None, "sha256": None, "reason": reason}
    data = base64.b64decode(result.workdir_archive)
    relative = workdir_file(record_id)
    path = out_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return {
        "kept": True,
        "file": relative,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "reason": None,
    }
