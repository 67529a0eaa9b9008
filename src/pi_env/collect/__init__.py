"""`pi-env collect` / `pi-env export`: task sets in, training datasets out.

`CollectRunner` (runner.py) plans (task, group index) pairs and hands them to an executor
(executors.py: threads here, or Ray tasks across machines); the driver alone appends each
finished rollout to the store (store.py) as a record (records.py). Around the store: the
dataset card and Hub push (card.py), the progress view and report (report.py), and the
exports (export.py); `reverify` (reverify.py) scores a dataset again on the work dirs collect
kept (workdirs.py), without running any agent. Heavy parts (rich, matplotlib, ray, huggingface_hub) load where used.
"""

from .reverify import ReverifySummary, reverify
from .runner import CollectError, CollectRunner, CollectSummary, KeepFilter

__all__ = ["CollectRunner", "CollectSummary", "CollectError", "KeepFilter", "reverify", "ReverifySummary"]
