"""What a collect run shows: a live progress view (rich, on a terminal; a line every few
seconds otherwise), the final summary table, and `report.png` (matplotlib)."""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from pathlib import Path


class _Stats:
    def __init__(self, total: int, done: int):
        self.total, self.done, self.started = total, done, time.monotonic()
        self.ran = 0
        self.rewards: list[float] = []
        self.errors: Counter[str] = Counter()

    def add(self, record: dict) -> None:
        self.done += 1
        self.ran += 1
        if record.get("reward") is not None:
            self.rewards.append(record["reward"])
        if record.get("error_kind"):
            self.errors[record["error_kind"]] += 1

    def line(self) -> str:
        minutes = (time.monotonic() - self.started) / 60
        rate = self.ran / minutes if minutes > 0 else 0.0
        left = self.total - self.done
        eta = f"{left / rate:.1f} min" if rate > 0 else "?"
        mean = f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "n/a"
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return f"{self.done}/{self.total}  mean reward {mean}  errors: {errors}  {rate:.1f} rollouts/min  ETA {eta}"


class _Quiet:
    def update(self, record: dict) -> None: ...

    def close(self) -> None: ...


class _Callback(_Quiet):
    def __init__(self, callback, total: int, done: int):
        self.callback, self.stats = callback, _Stats(total, done)

    def update(self, record: dict) -> None:
        self.stats.add(record)
        self.callback(record, self.stats)


class _Lines(_Quiet):
    """Not a terminal (a log file, CI): one status line at most every `every_s` seconds."""

    def __init__(self, total: int, done: int, every_s: float = 10.0):
        self.stats, self.every_s, self.last = _Stats(total, done), every_s, 0.0

    def update(self, record: dict) -> None:
        self.stats.add(record)
        if time.monotonic() - self.last >= self.every_s or self.stats.done == self.stats.total:
            self.last = time.monotonic()
            print(f"[collect] {self.stats.line()}", file=sys.stderr, flush=True)


class _Rich(_Quiet):
    def __init__(self, total: int, done: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.stats = _Stats(total, done)
        self.progress = Progress(
            TextColumn("collect"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.progress.start()
        self.bar = self.progress.add_task("collect", total=total, completed=done, info="")

    def update(self, record: dict) -> None:
        self.stats.add(record)
        info = self.stats.line().split("  ", 1)[1].rsplit("  ETA", 1)[0]
        self.progress.update(self.bar, completed=self.stats.done, info=info)

    def close(self) -> None:
        self.progress.stop()


def progress_view(progress, *, total: int, done: int):
    """`progress`: False (nothing), True (rich on a terminal, plain lines otherwise), or a
    callable `(record, stats)` called after each stored record."""
    if callable(progress):
        return _Callback(progress, total, done)
    if not progress:
        return _Quiet()
    return _Rich(total, done) if sys.stderr.isatty() else _Lines(total, done)


def print_summary(summary) -> None:
    """The final table (rich), on stdout."""
    from rich.console import Console
    from rich.table import Table

    counts = summary.counts
    table = Table(title=f"pi-env collect: {summary.out_dir}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    mean = counts.get("mean_reward")
    rows = [
        ("planned (task x group)", summary.planned),
        ("already stored", summary.already_stored),
        ("stored by this run", summary.ran),
        ("infra retries", summary.retried),
        ("records in the store", counts.get("records")),
        ("kept in results.jsonl", counts.get("kept")),
        ("scored", counts.get("scored")),
        ("mean reward", "n/a" if mean is None else f"{mean:.3f}"),
        ("solved (reward >= 1)", counts.get("solved")),
        ("unscored by kind", ", ".join(f"{k} {v}" for k, v in counts.get("errors", {}).items()) or "none"),
        ("skipped tasks", len(summary.skipped_tasks)),
        ("elapsed", f"{summary.elapsed_s:.1f} s"),
        ("torn tail repaired", ", ".join(f"{k} ({v} bytes)" for k, v in summary.repaired.items()) or "no"),
    ]
    for what, value in rows:
        table.add_row(what, str(value))
    console = Console()
    console.print(table)
    internal = counts.get("errors", {}).get("internal")
    if internal:
        console.print(
            f"[red]internal {internal}[/red]: a bug in pi-env, neither the agent nor the infrastructure "
            "(not retried; each record's error holds the traceback): please report it",
            highlight=False,
        )
    for task_id, why in summary.skipped_tasks.items():
        console.print(f"[yellow]skipped[/yellow] {task_id}: {'; '.join(why)}", highlight=False)


def write_report(records: list[dict], path: Path) -> Path | None:
    """report.png: reward histogram, pass rate per task, wall-time distribution."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    per_task: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.get("reward") is not None:
            per_task[r["task_id"]].append(1.0 if r["reward"] >= 1.0 else 0.0)
    walls = [r.get("wall_s") or 0.0 for r in records]
    unscored = len(records) - len(rewards)

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    left.hist(rewards, bins=20, range=(min(0.0, *rewards), max(1.0, *rewards)) if rewards else (0, 1), color="#4c72b0")
    left.set_title(f"reward ({len(rewards)} scored, {unscored} unscored)")
    left.set_xlabel("reward")
    left.set_ylabel("rollouts")
    shown = sorted(per_task.items(), key=lambda item: sum(item[1]) / len(item[1]))[:40]
    middle.barh([task for task, _ in shown], [sum(v) / len(v) for _, v in shown], color="#55a868")
    middle.set_xlim(0, 1)
    middle.set_title(f"pass rate per task ({len(shown)} of {len(per_task)} shown, lowest first)")
    middle.tick_params(axis="y", labelsize=7)
    right.hist(walls, bins=30, color="#c44e52")
    right.set_title("wall time per rollout")
    right.set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path
