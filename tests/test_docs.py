"""The README and the documentation site stay true: the README's set-up commands and Python
example, its links, and `mkdocs build --strict` (broken links and anchors, pages missing from the
nav, API objects mkdocstrings cannot find) with every public API object documented."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")

# The public API the site must document (issue 19), as module path and name.
REQUIRED_API = [
    "pi_env.task.PiTask", "pi_env.config.PiConfig", "pi_env.rollout.PiSessionFactory",
    "pi_env.rollout.PiSession", "pi_env.results.RolloutResult", "pi_env.rollout.run_rollout",
    "pi_env.harness", "pi_env.workspace.WorkspaceEnv",
]


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def test_readme_is_short_and_starts_with_the_two_set_up_commands():
    text = README.read_text()
    assert len(text.encode()) <= 10 * 1024, f"README.md is {len(text.encode())} bytes; the limit is 10 KB"
    first_commands = [line.split("#")[0].strip() for line in blocks(text, "bash")[0].splitlines()]
    assert first_commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert (ROOT / "scripts/demo.sh").is_file() and (ROOT / "scripts/test.sh").is_file()


def test_readme_python_example_is_about_ten_lines():
    (example,) = blocks(README.read_text(), "python")
    assert len([line for line in example.splitlines() if line.strip()]) <= 10


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(page: Path):
    # mkdocs checks the site's links; this also covers the README, which is not part of it.
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_once():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")), \
        "docs/**/*.md and mkdocs.yml's nav differ"
    assert len(pages) == len(set(pages))


def documented_objects() -> set[str]:
    return set(re.findall(r"^::: ([\w.]+)", (DOCS / "api.md").read_text(), re.M))


def test_the_public_api_is_on_the_api_page_with_docstrings():
    documented = documented_objects()
    assert not set(REQUIRED_API) - documented, f"docs/api.md lacks {sorted(set(REQUIRED_API) - documented)}"
    for identifier in sorted(documented):
        assert docstring_of(identifier), f"{identifier} has no docstring: the API page would be empty for it"


def docstring_of(identifier: str) -> str | None:
    """The docstring of a module, or of a class/function defined in (or re-exported by) one,
    read from the source: the optional extras (openenv, tinker) need not be installed."""
    parts = identifier.split(".")
    for split in range(len(parts), 0, -1):
        module = ROOT / "src" / Path(*parts[:split])
        source = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
        if source.is_file():
            break
    tree = ast.parse(source.read_text())
    if split == len(parts):
        return ast.get_docstring(tree)
    name = parts[split]
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return ast.get_docstring(node)
        if isinstance(node, ast.ImportFrom) and any(alias.name == name for alias in node.names):
            # a relative import counts from the module's package (the package itself for __init__)
            package = parts[:split] if source.name == "__init__.py" else parts[: split - 1]
            base = package[: len(package) - node.level + 1] if node.level else []
            return docstring_of(".".join([*base, *([node.module] if node.module else [])] + [name]))
    return None


def test_mkdocs_build_strict(tmp_path):
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                           cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-4000:]
    api = (tmp_path / "site/api/index.html").read_text()
    for identifier in documented_objects():
        assert f'id="{identifier}"' in api, f"mkdocstrings rendered no section for {identifier}"


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_readme_python_example_runs(tmp_path):
    (example,) = blocks(README.read_text(), "python")
    run = subprocess.run([sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    first, second = run.stdout.splitlines()[:2]
    assert first.split()[:2] == ["1.0", "None"], run.stdout  # the oracle's reward, no error kind
    assert second.startswith("1.0 [") and second != "1.0 []", run.stdout  # token ids were captured


def test_the_site_front_page_is_the_readme():
    # One text, two homes would drift: docs/index.md is the README with site-relative links.
    readme = README.read_text().replace("](docs/", "](").replace(
        "[documentation site](index.md) is built from `docs/` with MkDocs",
        "documentation site (this site) is built from `docs/` with MkDocs")
    assert (DOCS / "index.md").read_text() == readme, "docs/index.md differs from README.md: copy it over"
