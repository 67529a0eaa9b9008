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
