"""Coding task families for Pi rollouts: `PiTask`s with files, verify commands (some of them
hidden tests staged through `verify_files`) and an oracle `solution`, generated
deterministically from (split, seed, index) like the workspace families, with which they share
the rng keying, the word generator and the split check.

Every check that runs the agent's code is hidden (`verify_files`) and runs it through pi-env's
`pi_env_check` (sealed check, confined child: docs/tasks.md, "Writing tasks safely").

Families (each needs several tool calls; most rewards are a pass rate over several checks, so a
half-right answer scores between 0 and 1):

- `write_file`: create a file in a subdirectory holding two given lines.
- `implement_function`: fill in a stub that hidden tests check on inputs the agent never sees.
- `fix_bug`: a visible test fails; the bug is one line of the module it tests (hidden tests
  check the fix on the visible input and others, so editing the test does not pass).
- `rename_symbol`: rename a function across a package module and the script that calls it.
- `data_program`: a workspace data problem (`pi_env.workspace.tasks.FAMILIES`) answered by
  writing and running `solution.py` that prints the number.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Collection, Sequence

from pi_env.task import PiTask
from pi_env.workspace.tasks import FAMILIES as DATA_FAMILIES
from pi_env.workspace.tasks import WorkspaceTask, _word, check_disjoint, task_rng

NAMESPACE = "pi-env-coding"


def _name(rng: random.Random, taken: Sequence[str] = ()) -> str:
    """A lowercase identifier that is not a Python keyword/builtin clash and not in `taken`."""
    while True:
        name = _word(rng) + _word(rng)
        if len(name) >= 4 and name not in taken and name not in {"def", "for", "if", "in", "is", "not", "and", "or"}:
            return name


def _write_file(rng: random.Random, split: str) -> dict:
    folder, name, first, second = _name(rng), _name(rng), _name(rng), _name(rng)
    path = f"{folder}/{name}.txt"
    return dict(
        instruction=f"Create the file `{path}` containing exactly two lines: `{first}` on the first line "
        f"and `{second}` on the second.",
        verify=[f"test -f {path}", f'test "$(cat {path})" = "$(printf \'{first}\\n{second}\')"'],
        solution=[
            {"tool": "write", "path": path, "content": f"{first}\n{second}\n"},
            {"tool": "bash", "command": f"cat {path}"},
        ],
    )


# implement_function: (description, argument kind, body, reference). Bodies and references
# are formatted with the drawn parameters.
_SPECS: list[tuple[str, str, str, Callable]] = [
    (
        "return `x * {k} + {c}` for an integer `x`",
        "int",
        "return x * {k} + {c}",
        lambda p: lambda x: x * p["k"] + p["c"],
    ),
    (
        "return the items of the list `xs` that are greater than {t}, in their order",
        "list",
        "return [v for v in xs if v > {t}]",
        lambda p: lambda xs: [v for v in xs if v > p["t"]],
    ),
    (
        "return how many times the letter `{ch}` occurs in the string `s`",
        "str",
        "return s.count({ch!r})",
        lambda p: lambda s: s.count(p["ch"]),
    ),
    (
        "return the string `s` repeated {k} times, joined by `{sep}`",
        "str",
        "return {sep!r}.join([s] * {k})",
        lambda p: lambda s: p["sep"].join([s] * p["k"]),
    ),
    (
        "return the sum of the even numbers in the list `xs`, plus {c}",
        "list",
        "return sum(v for v in xs if v % 2 == 0) + {c}",
        lambda p: lambda xs: sum(v for v in xs if v % 2 == 0) + p["c"],
    ),
    (
        "return `x` limited to the range {lo}..{hi}: below {lo} gives {lo}, above {hi} gives {hi}",
        "int",
        "return max({lo}, min({hi}, x))",
        lambda p: lambda x: max(p["lo"], min(p["hi"], x)),
    ),
]
_ARGUMENT = {"int": "x", "list": "xs", "str": "s"}


def _spec_params(rng: random.Random) -> dict:
    lo = rng.randint(-5, 5)
    return {
        "k": rng.randint(2, 9),
        "c": rng.randint(1, 30),
        "t": rng.randint(-3, 12),
        "ch": rng.choice("aeiou"),
        "sep": rng.choice(["-", "+", ":", "/"]),
        "lo": lo,
        "hi": lo + rng.randint(3, 15),
    }


def _spec_input(rng: random.Random, kind: str) -> int | list[int] | str:
    if kind == "int":
        return rng.randint(-20, 25)
    if kind == "list":
        return [rng.randint(-10, 20) for _ in range(rng.randint(3, 7))]
    return "".join(_word(rng) for _ in range(rng.randint(1, 3)))


def _hidden_check(module: str, function: str, cases: list) -> str:
    """A hidden test: `python3 tests/check_M.py I` checks case I (one verify command per case,
    so the reward is the fraction of cases passed). The agent's function runs in a sealed child
    (pi_env_check, docs/tasks.md): its exit, prints and leftovers decide nothing."""
    return (
        f"import sys\n\nimport pi_env_check as check\n\n"
        f"CASES = {json.dumps(cases)}\n"
        f"args, want = CASES[int(sys.argv[1])]\n"
        f"check.seal(__file__)\n"
        f"got = check.call({module!r}, {function!r}, args)\n"
        f"assert got == want, f'{function}({{args!r}}) returned {{got!r}}, expected {{want!r}}'\n"
    )


def _program_check(argv: list[str], want: str) -> str:
    """A hidden test: the agent's program run in a sealed child (pi_env_check) must exit 0 and
    print `want`. Its verify command comes last: whatever the program does to the files cannot
    change an earlier command's verdict."""
    return (
        f"import sys\n\nimport pi_env_check as check\n\n"
        f"WANT = {want!r}\n"
        f"check.seal(__file__)\n"
        f"ran = check.run({argv!r})\n"
        f"print(f'expected {{WANT}}, got {{ran.stdout.strip()[-200:]!r}}')\n"
        f"sys.exit(0 if ran.ok and ran.stdout.strip() == WANT else 1)\n"
    )


def _implement_function(rng: random.Random, split: str) -> dict:
    description, kind, body, reference = rng.choice(_SPECS)
    params = _spec_params(rng)
    module, function = _name(rng), _name(rng)
    argument = _ARGUMENT[kind]
    run = reference(params)
    inputs = [_spec_input(rng, kind) for _ in range(4)]
    cases = [[value, run(value)] for value in inputs]
    stub = f"def {function}({argument}):\n    raise NotImplementedError\n"
    check = f"tests/check_{module}.py"
    return dict(
        instruction=f"Implement `{function}({argument})` in `{module}.py`: {description.format(**params)}. "
        f"Hidden tests will call it.",
        files={f"{module}.py": stub},
        verify_files={check: _hidden_check(module, function, cases)},
        verify=[f"python3 {check} {i}" for i in range(len(cases))],
        solution=[
            {"tool": "read", "path": f"{module}.py"},
            {
                "tool": "write",
                "path": f"{module}.py",
                "content": f"def {function}({argument}):\n    {body.format(**params)}\n",
            },
            {
                "tool": "bash",
                "command": f"python3 -c 'from {module} import {function}; print({function}({json.dumps(inputs[0])}))'",
            },
        ],
    )


# fix_bug: (module source with {bug} standing for the line, good line, bad line, reference).
_BUGGY: list[tuple[str, str, str, str, Callable]] = [
    (
        "def {f}(xs):\n    total = 0\n    for v in xs:\n{line}\n    return total\n",
        "        total += v * {k}",
        "        total += v + {k}",
        "list",
        lambda p: lambda xs: sum(v * p["k"] for v in xs),
    ),
    (
        "def {f}(xs):\n    n = 0\n    for v in xs:\n{line}\n            n += 1\n    return n\n",
        "        if v > {t}:",
        "        if v < {t}:",
        "list",
        lambda p: lambda xs: sum(1 for v in xs if v > p["t"]),
    ),
    (
        "def {f}(n):\n{line}\n",
        "    return sum(range({a}, n + 1))",
        "    return sum(range({a}, n))",
        "int",
        lambda p: lambda n: sum(range(p["a"], n + 1)),
    ),
    (
        "def {f}(s):\n{line}\n",
        "    return s.upper() + {suffix!r}",
        "    return s.lower() + {suffix!r}",
        "str",
        lambda p: lambda s: s.upper() + p["suffix"],
    ),
    (
        "def {f}(xs):\n    best = xs[0]\n    for v in xs:\n{line}\n            best = v\n    return best - {c}\n",
        "        if v > best:",
        "        if v < best:",
        "list",
        lambda p: lambda xs: max(xs) - p["c"],
    ),
]


def _fix_bug(rng: random.Random, split: str) -> dict:
    template, good, bad, kind, reference = rng.choice(_BUGGY)
    module, function = _name(rng), _name(rng)
    params = {
        "f": function,
        "k": rng.randint(2, 9),
        "t": rng.randint(0, 9),
        "a": rng.randint(0, 4),
        "suffix": rng.choice(["!", "?", "..", "#"]),
        "c": rng.randint(1, 9),
    }
    good, bad = good.format(**params), bad.format(**params)
    run = reference(params)
    while True:  # a visible case the bug gets wrong, so the test really fails
        visible = _spec_input(rng, kind) if kind != "int" else rng.randint(5, 15)
        if isinstance(visible, str):  # kind "str" (the others are ints and lists)
            visible = visible.capitalize()
        buggy_scope: dict = {}
        exec(template.format(line=bad, **params), buggy_scope)
        if buggy_scope[function](visible) != run(visible):
            break
    hidden = [_spec_input(rng, kind) if kind != "int" else rng.randint(5, 30) for _ in range(2)]
    hidden = [h.capitalize() if isinstance(h, str) else h for h in hidden]
    test_file = f"test_{module}.py"
    test = (
        f"from {module} import {function}\n\n"
        f"ARGS = {visible!r}\nWANT = {run(visible)!r}\n"
        f"got = {function}(ARGS)\n"
        f'assert got == WANT, f"{function}({{ARGS!r}}) returned {{got!r}}, expected {{WANT!r}}"\n'
        f"print('ok')\n"
    )
    check = f"tests/check_{module}.py"
    cases = [[case, run(case)] for case in [visible, *hidden]]  # the visible test's case too, run sealed
    return dict(
        instruction=f"`python3 {test_file}` fails. Find the bug in `{module}.py` and fix it so that the test "
        f"passes; do not change the test.",
        files={f"{module}.py": template.format(line=bad, **params), test_file: test},
        verify_files={check: _hidden_check(module, function, cases)},
        verify=[f"python3 {check} {i}" for i in range(len(cases))],
        solution=[
            {"tool": "bash", "command": f"python3 {test_file}"},
            {"tool": "read", "path": f"{module}.py"},
            {"tool": "edit", "path": f"{module}.py", "old": bad, "new": good},
            {"tool": "bash", "command": f"python3 {test_file}"},
        ],
    )


def _rename_symbol(rng: random.Random, split: str) -> dict:
    package, old = _name(rng), _name(rng)
    new = _name(rng, taken=[old, package])
    op, c, x, y = rng.choice(["+", "*", "-"]), rng.randint(1, 20), rng.randint(2, 12), rng.randint(2, 12)
    out = eval(f"{x} {op} {y} + {c}")
    helpers = f"{package}/helpers.py"
    return dict(
        instruction=f"Rename the function `{old}` to `{new}` everywhere: its definition in `{helpers}` and its "
        f"uses in `main.py`. `python3 main.py` must still print {out}.",
        files={
            f"{package}/__init__.py": "",
            helpers: f"def {old}(a, b):\n    return a {op} b + {c}\n",
            "main.py": f"from {package}.helpers import {old}\n\nprint({old}({x}, {y}))\n",
        },
        verify=[
            f"! grep -rnw --include=*.py {old} .",
            f"grep -q 'def {new}(' {helpers}",
            "python3 tests/check_main.py",
        ],
        verify_files={"tests/check_main.py": _program_check(["python3", "main.py"], str(out))},
        solution=[
            {"tool": "edit", "path": helpers, "old": f"def {old}(", "new": f"def {new}("},
            {"tool": "edit", "path": "main.py", "old": f"import {old}", "new": f"import {new}"},
            {"tool": "edit", "path": "main.py", "old": f"print({old}(", "new": f"print({new}("},
            {"tool": "bash", "command": "python3 main.py"},
        ],
    )


def _data_program(rng: random.Random, split: str) -> dict:
    from pi_env.workspace.oracle import reference_program

    family = rng.choice(sorted(DATA_FAMILIES))
    files, question, answer, params = DATA_FAMILIES[family](rng)
    while answer == 0:  # a program printing 0 must not pass by luck
        files, question, answer, params = DATA_FAMILIES[family](rng)
    problem = WorkspaceTask(
        task_id="",
        family=family,
        language="python",
        question=question,
        files=files,
        program="solution.py",
        expected=answer,
        split=split,
        metadata=params,
    )
    return dict(
        instruction=f"{question} Write a Python program `solution.py` that computes it from the file and prints "
        f"only the number, then run it with `python3 solution.py`.",
        files=files,
        verify=["python3 tests/check_program.py"],
        verify_files={"tests/check_program.py": _program_check(["python3", "solution.py"], str(answer))},
        solution=[
            {"tool": "write", "path": "solution.py", "content": reference_program(problem)},
            {"tool": "bash", "command": "python3 solution.py"},
        ],
    )


CODING_FAMILIES: dict[str, Callable[[random.Random, str], dict]] = {
    "write_file": _write_file,
    "implement_function": _implement_function,
    "fix_bug": _fix_bug,
    "rename_symbol": _rename_symbol,
    "data_program": _data_program,
}


def generate_coding_tasks(
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    families: Sequence[str] | None = None,
    exclude: Collection[str] = frozenset(),
) -> list[PiTask]:
    """`n` distinct PiTasks, the same for the same arguments on every machine; families take
    turns. `exclude`: task digests never to produce (another split's)."""
    families = list(families or CODING_FAMILIES)
    for name in families:
        if name not in CODING_FAMILIES:
            raise ValueError(f"families: {name!r} is not one of {', '.join(CODING_FAMILIES)}")
    if n < 0:
        raise ValueError(f"n: {n} tasks; give a count >= 0")
    tasks: list[PiTask] = []
    seen = set(exclude)
    index = 0
    while len(tasks) < n:
        if index > 10 * n + 100:
            raise ValueError(f"could not draw {n} distinct tasks from families {families}")
        family = families[index % len(families)]
        fields = CODING_FAMILIES[family](task_rng(split, seed, index, NAMESPACE), split)
        task = PiTask(
            task_id=f"{split}-{seed}-{index}-{family}",
            **fields,
            metadata={"family": family, "split": split, "seed": seed, "index": index},
            setup_network=False,
        )
        index += 1
        if task.digest() in seen:
            continue
        seen.add(task.digest())
        tasks.append(task)
    return tasks


def make_coding_splits(
    n_train: int, n_eval: int, *, seed: int = 0, families: Sequence[str] | None = None
) -> tuple[list[PiTask], list[PiTask]]:
    """Train and eval PiTasks; eval never holds a train task (checked: SplitOverlapError)."""
    train = generate_coding_tasks(n_train, split="train", seed=seed, families=families)
    evaluation = generate_coding_tasks(
        n_eval, split="eval", seed=seed, families=families, exclude={task.digest() for task in train}
    )
    check_disjoint(train=train, eval=evaluation)
    return train, evaluation
