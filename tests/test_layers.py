"""Dependencies point one way: no room of src/pi_env imports a room above it. The layers are read
from docs/architecture.md (the map), so the map and the code cannot drift apart."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pi_env"


def layers() -> dict[str, int]:
    """room -> layer, from the fenced block under "Dependencies point one way" (top layer first)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## Dependencies point one way.*?```\n(.*?)```", text, re.S).group(1)
    found = {}
    for line in block.splitlines():
        number, rooms = re.match(r"\s*(\d+)\s+(.*?)\s*(?:#.*)?$", line).groups()
        for room in re.split(r"[,\s]+", rooms.strip()):
            found[room] = int(number)
    return found


def rooms() -> list[str]:
    """Every room: a subpackage or a module of pi_env (the package itself is `pi_env`)."""
    names = [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
    names += [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    return sorted(names + ["pi_env"])


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pi_env"


def imported_modules(path: Path) -> set[str]:
    """Every pi_env module `path` imports, at the top or inside a function."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + [node.module] if node.module else base)
            # `from pi_env import x` names a room when x is one
            found |= {f"{target}.{alias.name}" if target == "pi_env" and alias.name in rooms() else target
                      for alias in node.names}
    return {name for name in found if name == "pi_env" or name.startswith("pi_env.")}


def test_every_room_is_on_the_map():
    assert sorted(layers()) == rooms(), "docs/architecture.md's layers and the rooms of src/pi_env differ"


def test_no_import_points_up():
    layer = layers()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        room = room_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"))
        for target in imported_modules(path):
            if layer[room_of(target)] > layer[room]:
                upward.append(f"{path.relative_to(ROOT)} ({room}, layer {layer[room]}) imports {target} "
                              f"(layer {layer[room_of(target)]})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("room", [room for room in rooms() if room != "pi_env"])
def test_importing_a_room_pulls_in_no_room_above_it(room):
    # A fresh interpreter: what `import pi_env.ROOM` loads beyond what `import pi_env` itself loads
    # (the value types every room may use) must all be at or below the room's layer.
    code = ("import json, sys; import pi_env; base = set(sys.modules); "
            f"import pi_env.{room}; print(json.dumps(sorted(m for m in set(sys.modules) - base "
            "if m.startswith('pi_env.'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    layer = layers()
    above = [m for m in json.loads(done.stdout) if layer[room_of(m)] > layer[room]]
    assert not above, f"importing pi_env.{room} (layer {layer[room]}) loads {above}"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> the pi_env modules it imports (at the top, inside functions, under
    TYPE_CHECKING: every import statement counts). `from package import name` is an edge to the
    module package.name when there is one, else to the package; a package's own __init__ is
    the package's name. Importing a submodule runs its packages' __init__ first, but that is
    Python's doing, not an edge: only what a module's own statements name counts."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
                target = ".".join(part for part in (base, node.module or "") if part)
                found |= {f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                          for alias in node.names}
        graph[module] = {name for name in found if name in modules and name != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], set[str]]]:
    """Per strongly connected component of more than one module (Tarjan): a shortest cycle
    through its first module (the modules along it, the first repeated at the end) and the
    whole component (a tangle may hold more modules than one cycle shows)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    cycles = []
    for component in components:  # a shortest way back to the component's first module
        start = min(component)
        paths, seen, cycle = [[start]], {start}, None
        while paths and cycle is None:
            path = paths.pop(0)
            for target in sorted(graph[path[-1]] & component):
                if target == start:
                    cycle = path + [start]
                    break
                if target not in seen:
                    seen.add(target)
                    paths.append(path + [target])
        cycles.append((cycle, component))
    return sorted(cycles, key=lambda found: found[0])


def test_no_import_cycle_between_modules():
    """No pi_env module imports, however indirectly or lazily, a module that imports it back:
    the base a module builds on is always below it, so each can be read (and loaded) alone."""
    cycles = import_cycles(import_graph())
    shown = [" -> ".join(cycle) + (f"  (one tangle with {', '.join(sorted(set(component) - set(cycle)))})"
                                   if len(component) > len(cycle) - 1 else "")
             for cycle, component in cycles]
    assert not cycles, ("import cycles between pi_env modules (break each: what both need goes in a module "
                        "that imports neither):\n  " + "\n  ".join(shown))


def test_the_cycle_check_sees_a_cycle_however_it_is_imported(tmp_path, monkeypatch):
    """The check itself: a lazy relative import and a TYPE_CHECKING one each close a cycle."""
    package = tmp_path / "pi_env"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "low.py").write_text("def f():\n    from . import high\n")
    (package / "sub" / "high.py").write_text("from pi_env.sub.low import f\n")
    (package / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pi_env import plain\n")
    (package / "plain.py").write_text("import pi_env.typed\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert [cycle for cycle, _ in import_cycles(import_graph())] == [
        ["pi_env.plain", "pi_env.typed", "pi_env.plain"],
        ["pi_env.sub.high", "pi_env.sub.low", "pi_env.sub.high"],
    ]
