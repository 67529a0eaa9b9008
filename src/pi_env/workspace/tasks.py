"""Workspace tasks: a few data files, a question whose answer is one integer computed from them,
and the program the model must write (in the task's language) to compute it.

Tasks are generated, deterministically from (split, seed, index), by families of small data
problems. A task's digest covers what defines the problem (family, question, files), not its
language: the same data asked in Python and in JavaScript is one problem, so train and eval
never share one in any language.
"""

from __future__ import annotations

import datetime
import hashlib
import heapq
import json
import os
import random
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from pi_env.errors import BadInputError

# Where the sandbox finds runtimes: it sees the host's /usr (and /bin through it), nothing else.
SANDBOX_BIN_DIRS = ("/usr/local/bin", "/usr/bin", "/bin")


@dataclass(frozen=True)
class Language:
    name: str
    extension: str
    commands: tuple[str, ...]  # what the model may type as `<runtime>` in bash
    binary: str  # looked up in SANDBOX_BIN_DIRS

    def runtime_path(self) -> str | None:
        """The runtime's absolute path as the sandbox sees it, or None if not installed."""
        for directory in SANDBOX_BIN_DIRS:
            path = os.path.join(directory, self.binary)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
        return None


LANGUAGES: dict[str, Language] = {
    "python": Language("python", ".py", ("python3", "python"), "python3"),
    "javascript": Language("javascript", ".js", ("node",), "node"),
    "julia": Language("julia", ".jl", ("julia",), "julia"),
}
DEFAULT_LANGUAGES = ("python", "javascript")


def available_languages() -> list[str]:
    """The languages whose runtime is installed where the sandbox can see it."""
    return [name for name, lang in LANGUAGES.items() if lang.runtime_path() is not None]


@dataclass(frozen=True)
class WorkspaceTask:
    """One workspace task. `files` are the starting files; `program` is the file the model
    writes and runs; `expected` is the answer."""

    task_id: str
    family: str
    language: str
    question: str
    files: dict[str, str]
    program: str
    expected: int
    split: str = "train"
    seed: int = 0
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.language not in LANGUAGES:
            raise ValueError(f"language: {self.language!r} is not one of {', '.join(LANGUAGES)}")

    @property
    def lang(self) -> Language:
        return LANGUAGES[self.language]

    @property
    def command(self) -> str:
        """The exact command that runs the program."""
        return f"{self.lang.commands[0]} {self.program}"

    def digest(self) -> str:
        payload = {"family": self.family, "question": self.question, "files": self.files}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> WorkspaceTask:
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# Families: rng -> (files, question, answer)

# files, question, answer, and the parameters of the question (for reference solutions)
Problem = tuple[dict[str, str], str, int, dict[str, str]]


def _csv_filter_sum(rng: random.Random) -> Problem:
    regions = ["north", "south", "east", "west"]
    items = ["apple", "bolt", "cable", "drill", "easel", "flute", "gear", "hinge"]
    rows = [
        (rng.choice(regions), rng.choice(items), rng.randint(1, 50), rng.randint(1, 200))
        for _ in range(rng.randint(20, 40))
    ]
    region = rng.choice([row[0] for row in rows])
    # A threshold some rows of that region meet, so the answer is never trivially 0.
    threshold = rng.choice([row[3] for row in rows if row[0] == region])
    answer = sum(qty for reg, _, qty, price in rows if reg == region and price >= threshold)
    text = "region,item,qty,price\n" + "".join(f"{r},{i},{q},{p}\n" for r, i, q, p in rows)
    question = (
        f"In `sales.csv`, add up the `qty` column over the rows whose `region` is "
        f"`{region}` and whose `price` is at least {threshold}."
    )
    return {"sales.csv": text}, question, answer, {"region": region, "threshold": str(threshold)}


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 4)))


def _count_words(rng: random.Random) -> Problem:
    words = [_word(rng) for _ in range(rng.randint(60, 120))]
    letter = rng.choice(sorted({w[0] for w in words}))
    min_len = rng.randint(3, 6)
    answer = sum(1 for w in words if w[0] == letter and len(w) >= min_len)
    decorated = [
        (w.capitalize() if rng.random() < 0.2 else w) + rng.choice(["", "", "", ",", ".", "!", "?", ";"]) for w in words
    ]
    lines = [" ".join(decorated[i : i + 12]) for i in range(0, len(decorated), 12)]
    question = (
        f"Count the words in `words.txt` (split on whitespace, strip the punctuation "
        f"characters `.,;:!?` from each word, compare case-insensitively) that start "
        f"with the letter `{letter}` and have at least {min_len} letters."
    )
    return {"words.txt": "\n".join(lines) + "\n"}, question, answer, {"letter": letter, "min_len": str(min_len)}


def _edge(a: str, b: str) -> tuple[str, str]:
    """An undirected edge's key: its two ends in order."""
    return (a, b) if a <= b else (b, a)


def _shortest_path(rng: random.Random) -> Problem:
    n = rng.randint(6, 10)
    nodes = [f"n{i}" for i in range(n)]
    order = nodes[:]
    rng.shuffle(order)
    edges: dict[tuple[str, str], int] = {}
    for i in range(1, n):  # a random spanning tree keeps the graph connected
        a, b = order[i], order[rng.randrange(i)]
        edges[_edge(a, b)] = rng.randint(1, 20)
    for _ in range(rng.randint(n // 2, n + 2)):
        a, b = rng.sample(nodes, 2)
        edges.setdefault(_edge(a, b), rng.randint(1, 20))
    source, target = rng.sample(nodes, 2)
    graph: dict[str, list[tuple[str, int]]] = {v: [] for v in nodes}
    for (a, b), w in edges.items():
        graph[a].append((b, w))
        graph[b].append((a, w))
    dist = {source: 0}
    heap = [(0, source)]
    while heap:
        d, v = heapq.heappop(heap)
        if d > dist[v]:
            continue
        for u, w in graph[v]:
            if d + w < dist.get(u, 1 << 60):
                dist[u] = d + w
                heapq.heappush(heap, (d + w, u))
    lines = [f"{a} {b} {w}" for (a, b), w in edges.items()]
    rng.shuffle(lines)
    question = (
        f"`edges.txt` lists undirected weighted edges, one per line as `u v weight`. "
        f"What is the total weight of the shortest path from `{source}` to `{target}`?"
    )
    return {"edges.txt": "\n".join(lines) + "\n"}, question, dist[target], {"source": source, "target": target}


def _date_union(rng: random.Random) -> Problem:
    year = rng.randint(2019, 2026)
    start = datetime.date(year, 1, 1)
    ranges = []
    for _ in range(rng.randint(5, 10)):
        first = start + datetime.timedelta(days=rng.randint(0, 330))
        ranges.append((first, first + datetime.timedelta(days=rng.randint(0, 40))))
    covered: set[datetime.date] = set()
    for first, last in ranges:
        covered.update(first + datetime.timedelta(days=k) for k in range((last - first).days + 1))
    text = "".join(f"{a.isoformat()} {b.isoformat()}\n" for a, b in ranges)
    question = (
        "`intervals.txt` holds inclusive date ranges, one per line as `start end` "
        "(YYYY-MM-DD). How many distinct calendar days lie in at least one range?"
    )
    return {"intervals.txt": text}, question, len(covered), {}


def _log_errors(rng: random.Random) -> Problem:
    services = ["api", "auth", "db", "queue", "web"]
    levels = ["INFO", "INFO", "WARN", "ERROR"]
    lines, answer = [], 0
    service = rng.choice(services)
    hour_from, hour_to = sorted(rng.sample(range(24), 2))
    for _ in range(rng.randint(30, 60)):
        hour, minute = rng.randrange(24), rng.randrange(60)
        svc, level = rng.choice(services), rng.choice(levels)
        msg = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))
        lines.append(f"{hour:02d}:{minute:02d} {level} {svc} {msg}")
        answer += svc == service and level == "ERROR" and hour_from <= hour < hour_to
    question = (
        f"Each line of `app.log` is `HH:MM LEVEL service message`. How many `ERROR` "
        f"lines of service `{service}` have an hour HH with {hour_from} <= HH < {hour_to}?"
    )
    return (
        {"app.log": "\n".join(lines) + "\n"},
        question,
        answer,
        {"service": service, "hour_from": str(hour_from), "hour_to": str(hour_to)},
    )


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "csv_filter_sum": _csv_filter_sum,
    "count_words": _count_words,
    "shortest_path": _shortest_path,
    "date_union": _date_union,
    "log_errors": _log_errors,
}


# ---------------------------------------------------------------------------------------------
# Generation and splits


class SplitOverlapError(BadInputError, ValueError):
    """A task appears in two splits that must be disjoint."""


def _check_languages(languages: Sequence[str], require_runtimes: bool) -> None:
    for name in languages:
        if name not in LANGUAGES:
            raise ValueError(f"languages: {name!r} is not one of {', '.join(LANGUAGES)}")
        if require_runtimes and LANGUAGES[name].runtime_path() is None:
            raise ValueError(
                f"languages: {name!r} needs a `{LANGUAGES[name].binary}` binary in "
                f"{', '.join(SANDBOX_BIN_DIRS)} (what the sandbox sees), and this machine has none; "
                f"installed here: {', '.join(available_languages()) or 'none'}. Install it, drop "
                f"{name!r}, or pass require_runtimes=False to generate tasks to run elsewhere."
            )


def task_rng(split: str, seed: int, index: int, namespace: str = "pi-env-workspace") -> random.Random:
    """The rng of one generated task: keyed by (split, seed, index), the same on every machine
    (str seeds hash stably, unlike tuples)."""
    return random.Random(f"{namespace}/{split}/{seed}/{index}")


def generate_tasks(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    families: Sequence[str] | None = None,
    languages: Sequence[str] = DEFAULT_LANGUAGES,
    require_runtimes: bool = True,
) -> list[WorkspaceTask]:
    """`n` distinct tasks, the same for the same arguments on every machine. Families and
    languages take turns; each task's data comes from its own rng keyed by (split, seed, index)."""
    families = list(families or FAMILIES)
    for name in families:
        if name not in FAMILIES:
            raise ValueError(f"families: {name!r} is not one of {', '.join(FAMILIES)}")
    if not languages:
        raise ValueError("languages: give at least one language")
    _check_languages(languages, require_runtimes)
    if n < 0:
        raise ValueError(f"n: {n} tasks; give a count >= 0")
    tasks: list[WorkspaceTask] = []
    seen: set[str] = set()
    index = 0
    while len(tasks) < n:
        if index > 10 * n + 100:
            raise ValueError(f"could not draw {n} distinct tasks from families {families}")
        family = families[index % len(families)]
        language = LANGUAGES[languages[(index // len(families)) % len(languages)]]
        rng = task_rng(split, seed, index)
        files, question, answer, params = FAMILIES[family](rng)
        task = WorkspaceTask(
            task_id=f"{split}-{seed}-{index}-{family}-{language.name}",
            family=family,
            language=language.name,
            question=question,
            files=files,
            program="solution" + language.extension,
            expected=answer,
            split=split,
            seed=seed,
            metadata=params,
        )
        index += 1
        if task.digest() in seen:
            continue
        seen.add(task.digest())
        tasks.append(task)
    return tasks


def check_disjoint(**splits: Iterable) -> None:
    """Raise SplitOverlapError if any task digest appears in two of the named splits (any task
    with `task_id` and `digest()`: WorkspaceTask, PiTask)."""
    owner: dict[str, tuple[str, str]] = {}
    for name, tasks in splits.items():
        for task in tasks:
            digest = task.digest()
            if digest in owner and owner[digest][0] != name:
                other, other_id = owner[digest]
                raise SplitOverlapError(
                    f"task {task.task_id!r} ({name}) and {other_id!r} ({other}) are the same "
                    f"problem (digest {digest[:12]}); splits must not share tasks"
                )
            owner.setdefault(digest, (name, task.task_id))


def make_splits(
    n_train: int, n_eval: int, *, seed: int = 0, **options
) -> tuple[list[WorkspaceTask], list[WorkspaceTask]]:
    """Train and eval tasks, checked disjoint (SplitOverlapError otherwise)."""
    train = generate_tasks(n_train, split="train", seed=seed, **options)
    evaluation = generate_tasks(n_eval, split="eval", seed=seed, **options)
    check_disjoint(train=train, eval=evaluation)
    return train, evaluation
