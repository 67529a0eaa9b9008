"""The error model (pi_env.errors): every exception pi-env defines is under `PiEnvError`, carries
the error kind and exit code its place in the tree gives it, and an exception maps to an
unscored result in one place; `import pi_env` loads nothing else."""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pi_env.errors import (
    ERROR_CLASSES,
    EXIT_BAD_INPUT,
    EXIT_INFRA,
    EXIT_INFRA_ERROR_KINDS,
    AgentFailure,
    BadInputError,
    ErrorKind,
    InfraError,
    InternalError,
    PiEnvError,
    ServerCallError,
    TaskFailure,
    exit_code_for,
    exit_code_of,
    unscored,
)
from pi_env.results import unscored_result

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pi_env"
# Runs inside sandboxes on the standard library alone: may not import pi_env (its docstring says).
STANDALONE = {"pi_env.verify.startup.pi_env_check", "pi_env.verify.startup.sitecustomize"}
# Control flow, not errors: SIGTERM unwinding like Ctrl-C.
NOT_ERRORS = {"pi_env.cli.Terminated"}
# `import pi_env` in a fresh interpreter loads these pi_env modules and no others.
IMPORT_ALLOWLIST = {"pi_env"}


def defined_exceptions(unimportable: dict[str, list[ast.ClassDef]] | None = None) -> list[type[BaseException]]:
    """Every exception class defined in src/pi_env (found by reading the source, then imported).
    A module whose optional dependency is missing goes into `unimportable` with its classes."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module_name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        if module_name in STANDALONE:
            continue
        classes = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                   and node.bases]
        if not classes:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an optional extra (tinker, ...) not installed here
            if unimportable is not None:
                unimportable[module_name] = classes
            continue
        for name in (node.name for node in classes):
            value = getattr(module, name, None)
            if (isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module_name
                    and f"{module_name}.{name}" not in NOT_ERRORS):
                found.append(value)
    return found


def test_every_exception_class_of_pi_env_is_under_the_base():
    unimportable: dict[str, list[ast.ClassDef]] = {}
    classes = defined_exceptions(unimportable)
    assert len(classes) >= 30, [c.__qualname__ for c in classes]  # the search itself works
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, PiEnvError)]
    # What cannot be imported here is read: a class based on a builtin exception only is outside.
    builtin = {name for name, value in vars(builtins).items()
               if isinstance(value, type) and issubclass(value, BaseException)}
    ours = {c.__name__ for c in classes} | {c.__name__ for c in vars(sys.modules["pi_env.errors"]).values()
                                             if isinstance(c, type) and issubclass(c, PiEnvError)}
    for module, nodes in unimportable.items():
        for node in nodes:
            bases = {base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases}
            if bases & builtin and not bases & ours:
                outside.append(f"{module}.{node.name}")
    assert not outside, f"exception classes outside pi_env.errors.PiEnvError: {outside}"


def test_the_standalone_check_helpers_import_no_pi_env():
    for module in STANDALONE:
        path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
        imported = {alias.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.ImportFrom)}
        assert not any(name.startswith("pi_env") for name in imported), module


def test_each_class_carries_the_kind_and_exit_code_of_its_place_in_the_tree():
    for cls in defined_exceptions() + list(ERROR_CLASSES.values()):
        where = f"{cls.__module__}.{cls.__qualname__}"
        if issubclass(cls, BadInputError):
            assert (cls.error_kind, cls.exit_code) == (None, EXIT_BAD_INPUT), where
        elif issubclass(cls, ServerCallError):
            assert (cls.error_kind, cls.exit_code) == (None, EXIT_INFRA), where
        else:
            assert cls.error_kind is not None, where
            assert cls.exit_code == exit_code_for(cls.error_kind), where
            if issubclass(cls, (AgentFailure, TaskFailure)):
                assert cls.exit_code == 0, where  # the run went fine; the rollout is the agent's or task's


def test_builtin_bases_are_kept_where_callers_catch_them():
    from pi_env.endpoints import EndpointError
    from pi_env.proxy.gate import CompletionInvalid, RequestNotPending
    from pi_env.sandbox import SandboxError
    from pi_env.task import TaskError
    from pi_env.verify.room import RoomError

    assert issubclass(TaskError, ValueError) and issubclass(EndpointError, ValueError)
    assert issubclass(SandboxError, RuntimeError) and issubclass(SandboxError, InfraError)
    assert issubclass(CompletionInvalid, ValueError) and issubclass(RequestNotPending, LookupError)
    room = RoomError("no room", agents=True)
    assert isinstance(room, OSError) and isinstance(room, InfraError) and room.agents and str(room) == "no room"

    class Both(PiEnvError, OSError):  # the base adds no state: it mixes with any builtin
        pass

    assert Both(13, "denied").strerror == "denied"


@pytest.mark.parametrize("kind", sorted(set(ErrorKind.__args__) - {"invalid_reward"}))
def test_each_kind_maps_from_its_exception_to_an_unscored_result(kind):
    from pi_env.sandbox.base import EnvironmentBuildError, EnvironmentUnsupported

    cls = {**ERROR_CLASSES, "environment_unsupported": EnvironmentUnsupported,
           "environment_build_failed": EnvironmentBuildError}[kind]
    try:
        raise cls("boom")
    except PiEnvError as error:
        got_kind, message = unscored(error)
        result = unscored_result("t", error)
    assert got_kind == kind and (result.error_kind, result.reward, result.task_id) == (kind, None, "t")
    # infrastructure names the exception's type, a bug also its traceback; the other kinds say their cause
    expected = {"infra": f"{cls.__name__}: boom"}.get(kind, "boom")
    if kind == "internal":
        assert message.startswith("InternalError: boom\n") and "Traceback" in message
    else:
        assert message == result.error == expected
    assert exit_code_for(kind) == (EXIT_INFRA if kind in EXIT_INFRA_ERROR_KINDS else 0)


def test_what_is_not_a_kind_of_ours_is_infra_for_the_os_else_internal():
    from pi_env.task import TaskError

    for error, kind in [(OSError(24, "Too many open files"), "infra"), (KeyError("turns"), "internal"),
                        (TaskError("bad task"), "internal")]:  # input refused mid-rollout: a bug of ours
        try:
            raise error
        except Exception as raised:
            assert unscored(raised)[0] == kind, error
    assert unscored(OSError("gone"), "could not give verify a clean room") == (
        "infra", "could not give verify a clean room: OSError: gone")


def test_a_commands_exit_code_for_an_error():
    from pi_env.sandbox import SandboxUnavailable
    from pi_env.task import TaskError

    assert exit_code_of(TaskError("x")) == EXIT_BAD_INPUT
    assert exit_code_of(ValueError("x")) == EXIT_BAD_INPUT  # what commands catch besides ours
    assert exit_code_of(SandboxUnavailable("no bwrap")) == EXIT_INFRA
    assert exit_code_of(InternalError("x")) == EXIT_INFRA


def test_old_import_paths_still_work():
    from pi_env.arguments import EXIT_BAD_INPUT as old_bad_input
    from pi_env.collect.executors import BadInput, EndpointUnusable
    from pi_env.results import EXIT_INFRA_ERROR_KINDS as old_kinds
    from pi_env.results import ErrorKind as OldErrorKind
    from pi_env.rollout import unscored_by
    from pi_env.server.client import PiEnvError as ClientError
    from pi_env.training import TrainingSegment, TrainingTrace, TurnAlignment

    assert old_bad_input == EXIT_BAD_INPUT and old_kinds is EXIT_INFRA_ERROR_KINDS and OldErrorKind is ErrorKind
    assert BadInput is EndpointUnusable and ClientError is ServerCallError
    assert unscored_by("t", OSError("x")).error_kind == "infra"
    from pi_env import results

    assert (TrainingSegment, TrainingTrace, TurnAlignment) == (
        results.TrainingSegment, results.TrainingTrace, results.TurnAlignment)


def loaded_by_import_pi_env() -> list[str]:
    code = "import json, sys; import pi_env; print(json.dumps(sorted(m for m in sys.modules if m.startswith('pi_env'))))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_import_pi_env_has_no_side_effects():
    """A fresh `import pi_env` loads no pi_env module beyond the allowlist (it used to load 13,
    Harbor's registration among them); every public name still comes from `pi_env`."""
    loaded = loaded_by_import_pi_env()
    assert set(loaded) <= IMPORT_ALLOWLIST, f"import pi_env loaded {sorted(set(loaded) - IMPORT_ALLOWLIST)}"
    import pi_env

    for name in pi_env.__all__:
        if name != "PiEnv":  # the server extra
            assert getattr(pi_env, name) is not None, name


def test_task_formats_are_found_when_a_task_needs_one(tmp_path):
    """Harbor is no longer imported by `import pi_env`: load_tasks and a task's metadata["harbor"]
    check still find it (a fresh interpreter, so nothing imported it before)."""
    task_dir = tmp_path / "hello"
    (task_dir / "tests").mkdir(parents=True)
    (task_dir / "instruction.md").write_text("say hello\n")
    (task_dir / "task.toml").write_text('version = "1.0"\n')
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    code = ("import sys; from pi_env import load_tasks; tasks = load_tasks(sys.argv[1]); "
            "print(tasks[0].task_id, 'harbor' in tasks[0].metadata, 'pi_env.harbor' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["hello", "True", "True"]
    code = ("from pi_env import PiTask\ntry:\n    PiTask(instruction='x', metadata={'harbor': 7})\n"
            "except ValueError as error:\n    print('refused', 'harbor' in str(error))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["refused", "True"], done.stderr[-2000:]


# -- rollouts that fail end unscored with the kind they always had ----------------------------


@pytest.mark.needs_bwrap
@pytest.mark.slow
def test_a_rollout_failing_in_setup_with_a_dead_endpoint_or_a_sandbox_error_keeps_its_kind(monkeypatch):
    import socket

    from pi_env import PiConfig, PiTask, run_rollout
    from pi_env.rollout import phases
    from pi_env.sandbox import SandboxError
    from pi_env.sandbox.base import EnvironmentBuildError

    setup = PiTask(task_id="setup-fails", instruction="x", setup=["exit 3"], verify=["true"],
                   solution=[{"tool": "bash", "command": "true"}])
    result = run_rollout(setup)
    assert (result.reward, result.error_kind) == (None, "setup_failed") and "exited 3" in result.error

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    dead = PiConfig(endpoint={"name": f"http://127.0.0.1:{port}/v1", "model": "m", "api_key": "k"})
    result = run_rollout(PiTask(instruction="x", verify=["true"]), dead)
    assert (result.reward, result.error_kind) == (None, "endpoint_error") and "unreachable" in result.error

    task = PiTask(instruction="x", verify=["true"], solution=[{"tool": "bash", "command": "true"}])
    for error, kind, message in [(SandboxError("bwrap died"), "infra", "SandboxError: bwrap died"),
                                 (EnvironmentBuildError("the build failed"), "environment_build_failed",
                                  "the build failed")]:
        def broken(ctx, runtime, error=error):
            raise error

        monkeypatch.setattr(phases, "create_sandbox", broken)
        result = run_rollout(task)
        assert (result.reward, result.error_kind, result.error) == (None, kind, message)


def test_the_tree_drawn_in_the_docstring_is_the_code():
    """Each class the docstring's tree draws exists, under the parent drawn; each class of the
    tree is drawn."""
    import re

    import pi_env.errors

    by_name = {c.__name__: c for c in defined_exceptions()}
    by_name.update({name: value for name, value in vars(pi_env.errors).items()
                    if isinstance(value, type) and issubclass(value, PiEnvError)})
    parents: list[str] = []
    drawn = set()
    for line in pi_env.errors.__doc__.splitlines():
        found = re.match(r"^\s*((?:│   )*)([├└]── )?(\w+)", line)  # the ancestors' bars, the branch, the name
        if not found or not (found.group(2) or found.group(3) == "PiEnvError"):
            continue  # prose, or a drawn class's description continued
        depth = len(found.group(1)) // 4 + bool(found.group(2))
        name = found.group(3)
        assert name in by_name, f"the tree draws {name}, which pi-env does not define"
        if depth:
            parent = by_name[parents[depth - 1]]
            assert issubclass(by_name[name], parent) and by_name[name] is not parent, (name, parent)
        parents[depth:] = [name]
        drawn.add(name)
    assert set(by_name) - drawn == set(), f"classes missing from the tree: {sorted(set(by_name) - drawn)}"
