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

Two template pools per family (docs/learning_protocol.md): every split draws from the `train`
pool (the bug kinds, function specs, file and rename shapes and data problems SFT and RL learn
from) except the `unseen` split (`UNSEEN_SPLITS`), which draws only from the `unseen` pool,
whose templates no other split ever uses. Each task's metadata names its `pool`, its `template`
(`family/kind`) and the `constants` it was drawn with (identifiers excluded), so a run can prove
that an unseen task shares no template with anything trained on. `RL_EXCLUDED_FAMILY` is the
family the RL stage never trains (SFT does, on its train templates): the eval measures transfer
to it.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Collection, Sequence

from pi_env.errors import BadInputError
from pi_env.task import PiTask
from pi_env.workspace.tasks import FAMILIES as DATA_FAMILIES
from pi_env.workspace.tasks import WorkspaceTask, _word, check_disjoint, task_rng

NAMESPACE = "pi-env-coding"
POOLS = ("train", "unseen")
UNSEEN_SPLITS = frozenset({"unseen"})  # the splits drawn from the unseen template pool
RL_EXCLUDED_FAMILY = "rename_symbol"  # the family the RL stage never trains (its split excludes it)


def template_pool(split: str) -> str:
    """The template pool a split draws from: `unseen` for the unseen split, `train` for the others."""
    return "unseen" if split in UNSEEN_SPLITS else "train"


def _used(params: dict, *texts: str) -> dict:
    """The drawn constants a template's texts use (`{name}` fields; the function name `f` and the
    `line` slot are identifiers, not constants)."""
    names = {m for text in texts for m in re.findall(r"\{(\w+)", text)} - {"f", "line"}
    return {name: params[name] for name in sorted(names) if name in params}


def _name(rng: random.Random, taken: Sequence[str] = ()) -> str:
    """A lowercase identifier that is not a Python keyword/builtin clash and not in `taken`."""
    while True:
        name = _word(rng) + _word(rng)
        if len(name) >= 4 and name not in taken and name not in {"def", "for", "if", "in", "is", "not", "and", "or"}:
            return name


def _write_file(rng: random.Random, split: str) -> dict:
    if template_pool(split) == "unseen":
        return _write_file_unseen(rng)
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
        template="write_file/two_lines_in_dir",
        constants={},
    )


def _write_file_unseen(rng: random.Random) -> dict:
    """Shapes no other split uses: three lines two directories deep, or a JSON object."""
    shape = rng.choice(["three_lines_nested", "json_object"])
    if shape == "three_lines_nested":
        outer, inner, name = _name(rng), _name(rng), _name(rng)
        lines = [_name(rng) for _ in range(3)]
        path = f"{outer}/{inner}/{name}.txt"
        printf = "\\n".join(lines)  # printf's escape, backslash and n
        return dict(
            instruction=f"Create the file `{path}` containing exactly three lines, in this order: "
            + ", ".join(f"`{line}`" for line in lines)
            + ".",
            verify=[f"test -f {path}", f'test "$(cat {path})" = "$(printf \'{printf}\')"'],
            solution=[
                {"tool": "write", "path": path, "content": "\n".join(lines) + "\n"},
                {"tool": "bash", "command": f"cat {path}"},
            ],
            template="write_file/three_lines_nested",
            constants={},
        )
    name, key = _name(rng), _name(rng)
    other = _name(rng, taken=[key])
    value, count = rng.randint(2, 99), rng.randint(2, 9)
    want = {key: value, other: [other] * count}
    path = f"{name}.json"
    check = f"import json, sys; sys.exit(0 if json.load(open('{path}')) == {want!r} else 1)"
    return dict(
        instruction=f"Create the file `{path}` holding one JSON object with two keys: `{key}` mapped to the "
        f"number {value}, and `{other}` mapped to a list of {count} copies of the string `{other}`.",
        verify=[f"test -f {path}", f'python3 -c "{check}"'],
        solution=[
            {"tool": "write", "path": path, "content": json.dumps(want) + "\n"},
            {"tool": "bash", "command": f"cat {path}"},
        ],
        template="write_file/json_object",
        constants={"count": count, "value": value},
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
_SPEC_NAMES = ["affine", "filter_greater", "count_letter", "repeat_join", "sum_evens_plus", "clamp"]
# Specs of the unseen pool only (no other split draws them): the same drawn parameters.
_SPECS_UNSEEN: list[tuple[str, str, str, Callable]] = [
    (
        "return the largest item of the non-empty list `xs` minus its smallest item, times {k}",
        "list",
        "return (max(xs) - min(xs)) * {k}",
        lambda p: lambda xs: (max(xs) - min(xs)) * p["k"],
    ),
    (
        "return the string `s` reversed, then `{sep}`, then the length of `s`",
        "str",
        "return s[::-1] + {sep!r} + str(len(s))",
        lambda p: lambda s: s[::-1] + p["sep"] + str(len(s)),
    ),
    (
        "return how many of the integers 1, 2, ..., `x` are divisible by {k} (0 when `x` < 1)",
        "int",
        "return max(0, x) // {k}",
        lambda p: lambda x: max(0, x) // p["k"],
    ),
]
_SPEC_NAMES_UNSEEN = ["range_spread_times", "reverse_with_length", "count_multiples"]
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
    specs, names = (_SPECS_UNSEEN, _SPEC_NAMES_UNSEEN) if template_pool(split) == "unseen" else (_SPECS, _SPEC_NAMES)
    choice = rng.randrange(len(specs))  # what rng.choice(specs) draws
    description, kind, body, reference = specs[choice]
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
        template=f"implement_function/{names[choice]}",
        constants=_used(params, description, body),
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


_BUG_NAMES = ["scale_sum_operator", "count_comparison", "range_end", "case_method", "max_comparison"]
# Bug kinds of the unseen pool only: a wrong slice start, a wrong variable, a wrong index.
_BUGGY_UNSEEN: list[tuple[str, str, str, str, Callable]] = [
    (
        "def {f}(xs):\n{line}\n",
        "    return xs[:{w}]",
        "    return xs[1:{w}]",
        "list",
        lambda p: lambda xs: xs[: p["w"]],
    ),
    (
        "def {f}(xs):\n    evens = [v for v in xs if v % 2 == 0]\n{line}\n",
        "    return len(evens) * {k}",
        "    return len(xs) * {k}",
        "list",
        lambda p: lambda xs: len([v for v in xs if v % 2 == 0]) * p["k"],
    ),
    (
        "def {f}(n):\n    values = [i * {k} + {c} for i in range(n)]\n{line}\n",
        "    return values[-1]",
        "    return values[0]",
        "int",
        lambda p: lambda n: (n - 1) * p["k"] + p["c"],
    ),
]
_BUG_NAMES_UNSEEN = ["slice_start", "wrong_variable", "first_for_last_index"]


def _fix_bug(rng: random.Random, split: str) -> dict:
    unseen = template_pool(split) == "unseen"
    kinds, names = (_BUGGY_UNSEEN, _BUG_NAMES_UNSEEN) if unseen else (_BUGGY, _BUG_NAMES)
    choice = rng.randrange(len(kinds))  # what rng.choice(kinds) draws
    template, good, bad, kind, reference = kinds[choice]
    module, function = _name(rng), _name(rng)
    params = {
        "f": function,
        "k": rng.randint(2, 9),
        "t": rng.randint(0, 9),
        "a": rng.randint(0, 4),
        "suffix": rng.choice(["!", "?", "..", "#"]),
        "c": rng.randint(1, 9),
    }
    if unseen:  # drawn only here, so the train pool's tasks stay what they were
        params["w"] = rng.randint(2, 4)
    constants = _used(params, template, good, bad)
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
        template=f"fix_bug/{names[choice]}",
        constants=constants,
    )


def _rename_symbol(rng: random.Random, split: str) -> dict:
    if template_pool(split) == "unseen":
        return _rename_symbol_unseen(rng)
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
        template="rename_symbol/function_in_helpers",
        constants={"c": c, "op": op, "x": x, "y": y},
    )


def _rename_symbol_unseen(rng: random.Random) -> dict:
    """Shapes no other split uses: a class (definition and use), or a function used from two
    modules (a relative import inside the package and the script)."""
    shape = rng.choice(["class_in_models", "function_two_callers"])
    package, old = _name(rng), _name(rng, taken=["core"])  # `core` is a module name here
    new = _name(rng, taken=[old, package])
    op, c, x, y = rng.choice(["+", "*", "-"]), rng.randint(1, 20), rng.randint(2, 12), rng.randint(2, 12)
    constants = {"c": c, "op": op, "x": x, "y": y}
    if shape == "class_in_models":
        module = f"{package}/models.py"
        out = str(eval(f"{x} {op} {c}"))
        files = {
            f"{package}/__init__.py": "",
            module: f"class {old}:\n    def __init__(self, v):\n        self.v = v\n\n"
            f"    def total(self):\n        return self.v {op} {c}\n",
            "main.py": f"from {package}.models import {old}\n\nprint({old}({x}).total())\n",
        }
        edits = [
            (module, f"class {old}:", f"class {new}:"),
            ("main.py", f"import {old}", f"import {new}"),
            ("main.py", f"print({old}(", f"print({new}("),
        ]
        what, definition = "class", f"class {new}:"
    else:
        module = f"{package}/core.py"
        out = f"{eval(f'{x} {op} {c}')} {2 * eval(f'{y} {op} {c}')}"
        files = {
            f"{package}/__init__.py": "",
            module: f"def {old}(a):\n    return a {op} {c}\n",
            f"{package}/report.py": f"from .core import {old}\n\n\ndef summary(v):\n    return {old}(v) * 2\n",
            "main.py": f"from {package}.core import {old}\nfrom {package}.report import summary\n\n"
            f"print({old}({x}), summary({y}))\n",
        }
        edits = [
            (module, f"def {old}(", f"def {new}("),
            (f"{package}/report.py", f"import {old}", f"import {new}"),
            (f"{package}/report.py", f"return {old}(", f"return {new}("),
            ("main.py", f"import {old}", f"import {new}"),
            ("main.py", f"print({old}(", f"print({new}("),
        ]
        what, definition = "function", f"def {new}("
    return dict(
        instruction=f"Rename the {what} `{old}` to `{new}` everywhere in the project: its definition in "
        f"`{module}` and every use. `python3 main.py` must still print {out}.",
        files=files,
        verify=[
            f"! grep -rnw --include=*.py {old} .",
            f"grep -qF '{definition}' {module}",
            "python3 tests/check_main.py",
        ],
        verify_files={"tests/check_main.py": _program_check(["python3", "main.py"], out)},
        solution=[
            *({"tool": "edit", "path": path, "old": before, "new": after} for path, before, after in edits),
            {"tool": "bash", "command": "python3 main.py"},
        ],
        template=f"rename_symbol/{shape}",
        constants=constants,
    )


def _team_spread(rng: random.Random) -> tuple[dict[str, str], str, int, str]:
    """scores.csv: the spread (max - min) of one team's points."""
    teams = ["red", "blue", "green", "gold"]
    rows = [(_name(rng), rng.choice(teams), rng.randint(0, 90)) for _ in range(rng.randint(15, 30))]
    team = rng.choice([row[1] for row in rows])
    points = [p for _, t, p in rows if t == team]
    text = "player,team,points\n" + "".join(f"{n},{t},{p}\n" for n, t, p in rows)
    question = (
        f"In `scores.csv`, take the rows whose `team` is `{team}`: what is their largest `points` value "
        f"minus their smallest?"
    )
    program = (
        "import csv\n\n"
        f"points = [int(r['points']) for r in csv.DictReader(open('scores.csv')) if r['team'] == {team!r}]\n"
        "print(max(points) - min(points))\n"
    )
    return {"scores.csv": text}, question, max(points) - min(points), program


def _lines_with_word(rng: random.Random) -> tuple[dict[str, str], str, int, str]:
    """notes.txt: how many lines hold a given word (whole words, case-sensitive)."""
    vocabulary = [_word(rng) for _ in range(12)]
    lines = [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(3, 8))) for _ in range(rng.randint(20, 40))]
    word = rng.choice(vocabulary)
    question = (
        f"How many lines of `notes.txt` contain the word `{word}` at least once (words are separated "
        f"by spaces; compare whole words)?"
    )
    program = f"print(sum(1 for line in open('notes.txt') if {word!r} in line.split()))\n"
    return {"notes.txt": "\n".join(lines) + "\n"}, question, sum(word in line.split() for line in lines), program


# Data problems of the unseen pool only (the train pool is the workspace's FAMILIES).
_DATA_UNSEEN = {"team_spread": _team_spread, "lines_with_word": _lines_with_word}


def _data_program_unseen(rng: random.Random) -> dict:
    problem = rng.choice(sorted(_DATA_UNSEEN))
    files, question, answer, program = _DATA_UNSEEN[problem](rng)
    while answer == 0:  # a program printing 0 must not pass by luck
        files, question, answer, program = _DATA_UNSEEN[problem](rng)
    return dict(
        instruction=f"{question} Write a Python program `solution.py` that computes it from the file and prints "
        f"only the number, then run it with `python3 solution.py`.",
        files=files,
        verify=["python3 tests/check_program.py"],
        verify_files={"tests/check_program.py": _program_check(["python3", "solution.py"], str(answer))},
        solution=[
            {"tool": "write", "path": "solution.py", "content": program},
            {"tool": "bash", "command": "python3 solution.py"},
        ],
        template=f"data_program/{problem}",
        constants={},
    )


def _data_program(rng: random.Random, split: str) -> dict:
    from pi_env.workspace.oracle import reference_program

    if template_pool(split) == "unseen":
        return _data_program_unseen(rng)
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
        template=f"data_program/{family}",
        constants={},
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
        template, constants = fields.pop("template"), fields.pop("constants")
        task = PiTask(
            task_id=f"{split}-{seed}-{index}-{family}",
            **fields,
            metadata={
                "family": family,
                "split": split,
                "seed": seed,
                "index": index,
                "pool": template_pool(split),
                "template": template,
                "constants": constants,
            },
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


class TemplateLeakError(BadInputError, ValueError):
    """An unseen-pool task shares a template with a task of another pool."""


def template_key(task: PiTask) -> tuple[str, str]:
    """(template id, its constants as canonical JSON): what a task is apart from its identifiers."""
    return task.metadata["template"], json.dumps(task.metadata.get("constants") or {}, sort_keys=True)


def check_unseen_templates(unseen: Sequence[PiTask], others: Sequence[PiTask]) -> None:
    """Raise TemplateLeakError if an unseen task's template id is used by any other task (train,
    eval, RL, held-out splits), or if any of `unseen` is not from the unseen pool."""
    wrong = [t.task_id for t in unseen if t.metadata.get("pool") != "unseen"]
    if wrong:
        raise TemplateLeakError(f"not unseen-pool tasks: {wrong[:5]}")
    used = {t.metadata.get("template"): t.task_id for t in others}
    for task in unseen:
        if task.metadata["template"] in used:
            raise TemplateLeakError(
                f"unseen task {task.task_id!r} uses template {task.metadata['template']!r}, as "
                f"{used[task.metadata['template']]!r} does"
            )
