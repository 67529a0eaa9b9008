"""The house's figures (issue 45), printed for one checkout: the largest modules, the classes with
the most methods, exception classes outside the error tree, PiConfig's top-level fields, mode names
written as string literals, and what `import pi_env` loads.

    python scripts/house_figures.py [SRC_DIR]     # default: src/ beside this script

Run it on two checkouts (e.g. a `git worktree` of the commit before) to compare them side by side.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

MODES = ("black_box", "transparent_proxy", "interception_gate")
BUILTIN_ERRORS = {"Exception", "ValueError", "RuntimeError", "OSError", "TypeError", "KeyError", "LookupError"}


def python(src: Path, code: str) -> str:
    """What `code` prints, run in a fresh interpreter that sees only `src`'s pi_env."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout


def figures(src: Path) -> dict:
    package = src / "pi_env"
    modules = sorted(package.rglob("*.py"))
    lines = {str(m.relative_to(src)): len(m.read_text().splitlines()) for m in modules}
    classes: dict[str, tuple[list[str], int]] = {}  # name -> (bases, methods)
    mode_literals = 0
    for module in modules:
        tree = ast.parse(module.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                classes[f"{module.relative_to(src)}:{node.name}"] = (bases, methods)
            elif isinstance(node, ast.Constant) and node.value in MODES:
                mode_literals += 1
    by_name = {key.split(":")[1]: bases for key, (bases, _) in classes.items()}

    def reaches(name: str, roots: set[str], seen: frozenset = frozenset()) -> bool:
        """`name` is one of `roots` or has one among its bases, however deep."""
        if name in roots:
            return True
        return name not in seen and any(reaches(b, roots, seen | {name}) for b in by_name.get(name, []))

    has_base = "pi_env/errors.py:PiEnvError" in classes  # the error tree's root (issue 45)

    def is_error(name: str) -> bool:
        return reaches(name, BUILTIN_ERRORS)

    def under_base(name: str) -> bool:
        return has_base and reaches(name, {"PiEnvError"})

    errors = [k for k in classes if is_error(k.split(":")[1]) and not k.startswith("pi_env/testing")]
    outside = [k for k in errors if not under_base(k.split(":")[1])]
    loaded = python(src, "import sys, pi_env; print(sorted(m for m in sys.modules if m.startswith('pi_env')))")
    config_fields = python(src, "from pi_env.config import PiConfig; print(len(PiConfig.model_fields))").strip()
    most_methods = sorted(classes.items(), key=lambda kv: -kv[1][1])[:8]
    return {
        "modules": len(modules),
        "lines": sum(lines.values()),
        "largest_modules": sorted(lines.items(), key=lambda kv: -kv[1])[:8],
        "most_methods": [(k, m) for k, (_, m) in most_methods],
        "exception_classes": len(errors),
        "exception_classes_outside_the_base": len(outside),
        "config_top_level_fields": int(config_fields),
        "mode_string_literals": mode_literals,
        "import_pi_env_loads": len(ast.literal_eval(loaded)),
    }


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "src"
    print("\n".join(f"{key}: {json.dumps(value)}" for key, value in figures(src).items()))
