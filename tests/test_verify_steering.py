"""The agent's files cannot steer verify (issue 24): what the agent leaves in its work dir never
takes the place of the verifier's interpreter, test runner, their plugins and configuration, a
library, a tool on PATH, or the reward file. A hostile agent (the oracle replaying a planted
solution, through the real Pi, in the real sandbox) plants the forgery beside a wrong answer:
every such rollout must score 0.0, and the honest answer to the same task 1.0.

Each attack here scored 1.0 before its defence (pi_env.verify); each test was seen failing with
that defence removed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sandbox_backends import registered

from pi_env import PiConfig, PiTask, run_rollout
from pi_env.harbor import load_harbor_task

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]
HARBOR = Path(__file__).parent.parent / "examples" / "harbor"
EXIT_0 = "import os; os._exit(0)\n"  # a module that ends its importer's process with success
FORGE = "open('/root/logs/verifier/reward.txt', 'w').write('1.0')\n"
# pytest for the sandbox's python3, in setup's user site (setup's home is verify's).
INSTALL_PYTEST = "python3 -m pip install -q --user --break-system-packages --disable-pip-version-check pytest"

HIDDEN_UNITTEST = ("import unittest\nimport solution\n\nclass T(unittest.TestCase):\n"
                   "    def test_answer(self):\n        self.assertEqual(solution.answer(), 42)\n")
HIDDEN_PYTEST = "import fractions\nimport solution\n\ndef test_answer():\n    assert solution.answer() == 42\n"
HIDDEN_CHECK = "import fractions, sys\nimport solution\nsys.exit(0 if solution.answer() == 42 else 1)\n"
WRONG = "def answer():\n    return 41\n"
RIGHT = "def answer():\n    return 42\n"
PYTEST_TASK = {"setup": [INSTALL_PYTEST], "verify_files": {"test_hidden.py": HIDDEN_PYTEST},
               "verify": ["python3 -m pytest -q -p no:cacheprovider test_hidden.py"]}

# name -> (task fields, files the agent plants beside its wrong answer, what the sandbox needs)
ATTACKS = {
    # The program verify runs writes the reward file: this task scores by pass rate.
    "reward-file-from-program": (
        {"verify": ["python3 solution.py | grep -qx 42"]},
        {"solution.py": FORGE + "print(41)\n"}, "python3"),
    # The test runner itself, shadowed from the cwd (`python3 -m unittest`).
    "runner-unittest": (
        {"verify_files": {"test_hidden.py": HIDDEN_UNITTEST}, "verify": ["python3 -m unittest -q test_hidden"]},
        {"unittest.py": EXIT_0}, "python3"),
    # A standard library module a hidden check imports, shadowed from the script's dir.
    "library": ({"verify_files": {"check.py": HIDDEN_CHECK}, "verify": ["python3 check.py"]},
                {"fractions.py": EXIT_0}, "python3"),
    # The same through PYTHONPATH=... as a verifier may extend it (the documented way).
    "library-pythonpath": ({"verify_files": {"check.py": HIDDEN_CHECK},
                            "verify": ['PYTHONPATH="$PYTHONPATH:." python3 check.py']},
                           {"fractions.py": EXIT_0}, "python3"),
    # pytest, shadowed from the cwd (`python3 -m pytest`).
    "runner-pytest": (PYTEST_TASK, {"pytest.py": EXIT_0}, "pytest"),
    # A conftest.py plugin beside the hidden tests.
    "conftest": (PYTEST_TASK, {"conftest.py": EXIT_0}, "pytest"),
    # pytest's configuration: collect only, which exits 0.
    "pytest-ini": (PYTEST_TASK, {"pytest.ini": "[pytest]\naddopts = --collect-only\n"}, "pytest"),
    "pyproject": (PYTEST_TASK, {"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '--collect-only'\n"},
                  "pytest"),
    # An __init__.py makes the hidden test part of a package whose __init__ runs first.
    "init-py": (PYTEST_TASK, {"__init__.py": EXIT_0}, "pytest"),
    # A site hook in the work dir.
    "sitecustomize": ({"verify_files": {"check.py": HIDDEN_CHECK}, "verify": ["PYTHONPATH=. python3 check.py"]},
                      {"sitecustomize.py": EXIT_0}, "python3"),
    # A node_modules the agent planted shadows the verifier's package (in setup's home).
    "node-modules": (
        {"setup": ["mkdir -p $HOME/node_modules/checker && "
                   "echo 'module.exports = x => x === 42' > $HOME/node_modules/checker/index.js"],
         "verify_files": {"check.js": "process.exit(require('checker')(require('./solution.js').answer()) ? 0 : 1)\n"},
         "verify": ["node check.js"]},
        {"node_modules/checker/index.js": "module.exports = () => true\n"}, "node"),
}
NODE_FILES = {"solution.js": "exports.answer = () => 41\n"}
NEEDS = {"python3": "command -v python3", "node": "command -v node",
         "pytest": "python3 -m pip --version"}


def _config(backend: str, needs: str) -> PiConfig:
    from pi_env.sandbox import SandboxSpec

    made = registered(backend)()  # skips (or fails, where CI requires it) a backend that cannot run here
    with made.create(SandboxSpec()) as sandbox:
        if sandbox.exec(NEEDS[needs], timeout_s=60).exit_code != 0:
            pytest.skip(f"the {backend} backend's userland has no {needs}")
    return PiConfig(sandbox_backend=backend)


def _task(name: str, fields: dict, files: dict[str, str]) -> PiTask:
    steps = [{"tool": "write", "path": path, "content": text} for path, text in files.items()]
    return PiTask(task_id=name, instruction="make answer() return 42", **fields,
                  solution=[*steps, {"tool": "bash", "command": "echo planted"}])


def _scores(result) -> list:
    return [(r.cmd[-60:], r.exit_code, r.stdout[-300:], r.stderr[-300:]) for r in result.verify_results]


@pytest.mark.parametrize("backend", ["local", "podman"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_forgery_in_the_work_dir_scores_0_and_the_honest_answer_1(attack, backend):
    fields, planted, needs = ATTACKS[attack]
    config = _config(backend, needs)
    answer = NODE_FILES if needs == "node" else {"solution.py": WRONG}
    if attack == "reward-file-from-program":
        answer = {}
    forged = run_rollout(_task(attack, fields, {**answer, **planted}), config)
    assert forged.error_kind is None, (forged.error, forged.agent_log_tail[-1500:], forged.setup_results)
    assert "planted" in json.dumps(forged.messages), "the attack did not run: the test proves nothing"
    assert forged.reward == 0.0, _scores(forged)
    honest_files = {"solution.js": "exports.answer = () => 42\n"} if needs == "node" else \
        {"solution.py": "print(42)\n" if attack == "reward-file-from-program" else RIGHT}
    honest = run_rollout(_task(attack, fields, honest_files), config)
    assert honest.reward == 1.0, _scores(honest)
    # What was set aside for verify is the agent's again afterwards (the collected files).
    for path, text in planted.items():
        if "/" not in path:
            assert forged.files.get(path) == text, sorted(forged.files)


def test_a_reward_file_written_by_the_agents_program_is_ignored_and_noted():
    fields, planted, _ = ATTACKS["reward-file-from-program"]
    result = run_rollout(_task("noted", fields, planted))
    assert result.reward == 0.0 and result.reward_source == "pass_rate"
    assert any("ignored" in note and "pass rate" in note for note in result.verify_notes), result.verify_notes


def test_a_path_shim_in_the_work_dir_does_not_replace_the_verifiers_tool():
    # A task whose PATH starts in the work dir (as a Dockerfile's ENV may): the agent's bin/grep.
    config = PiConfig(extra_env={"PATH": "/root/workdir/bin:/usr/local/bin:/usr/bin:/bin"})
    task = PiTask(task_id="path-shim", instruction="print 42", verify=["python3 solution.py | grep -qx 42"],
                  solution=[{"tool": "write", "path": "solution.py", "content": "print(41)\n"},
                            {"tool": "write", "path": "bin/grep", "content": "#!/bin/sh\nexit 0\n"},
                            {"tool": "bash", "command": "chmod +x bin/grep && echo planted"}])
    result = run_rollout(task, config)
    assert "planted" in json.dumps(result.messages)
    assert result.reward == 0.0, _scores(result)


@pytest.mark.parametrize("content, why", [("1e308", "outside the task's reward_range"), ("nan", "not finite"), ("-inf", "not finite"),
                                          ("one", "not a number"), (None, "missing"), ("DIR", "cannot be read")])
def test_a_reward_file_that_is_not_a_reward_is_a_zero_with_the_reason(content, why):
    write = {None: "true", "DIR": "mkdir -p $HOME/logs/verifier/reward.txt"}.get(
        content, f"echo {content} > $HOME/logs/verifier/reward.txt")
    task = PiTask(task_id="bad-reward", instruction="x", verify=[write], reward_file=True,
                  solution=[{"tool": "bash", "command": "true"}])
    result = run_rollout(task)
    assert result.error_kind is None and result.reward == 0.0, (result.error, result.verify_notes)
    assert result.reward_source == "reward_file" and why in result.verify_notes[-1], result.verify_notes


def test_agent_code_one_verify_command_runs_cannot_rewrite_the_next_ones_world():
    """Before each verify command the verifier's dir is emptied and the hidden files staged again:
    the agent's program, run by a first command, writes a 1.0 reward file and rewrites the hidden
    check; only the last command's reward file counts, and the check that runs is the task's."""
    rewrite = "open('check.py', 'w').write('raise SystemExit(0)')\n"
    task = PiTask(task_id="next-command", instruction="x", reward_file=True,
                  verify=["python3 solution.py", "true"],
                  solution=[{"tool": "write", "path": "solution.py", "content": FORGE + rewrite}])
    result = run_rollout(task)
    assert result.reward == 0.0 and "missing" in result.verify_notes[-1], result.verify_notes
    task = task.model_copy(update={"reward_file": None, "verify": ["python3 solution.py", "python3 check.py"],
                                   "verify_files": {"check.py": "raise SystemExit(1)\n"}})
    result = run_rollout(task)
    assert [r.exit_code for r in result.verify_results] == [0, 1] and result.reward == 0.5
    # The residual docs/isolation.md names: agent code run by the command that writes the reward.
    task = task.model_copy(update={"verify": ["true", "python3 solution.py"], "verify_files": {}, "reward_file": True})
    assert run_rollout(task).reward == 1.0


def _harbor(tmp_path: Path, name: str, solve: str) -> PiTask:
    task_dir = tmp_path / name
    shutil.copytree(HARBOR / name, task_dir)
    (task_dir / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    return load_harbor_task(task_dir)


def test_harbor_reward_steps_never_import_the_agents_modules(tmp_path):
    """fix-palindrome's verifier writes reward.json. pi-env's reward step used to run Python in the
    work dir: an agent's json.py/os.py there wrote 1.0 with no program written at all."""
    planted = "".join(f"printf '{FORGE}' > /app/{module}.py\n" for module in ("json", "math", "os"))
    result = run_rollout(_harbor(tmp_path, "fix-palindrome", planted))
    untouched = run_rollout(_harbor(tmp_path / "plain", "fix-palindrome", "true\n"))  # the program as given
    assert result.error_kind is None, result.error
    assert result.reward == untouched.reward < 1.0, _scores(result)


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="environment layers need root (overlay mounts)")
def test_harbor_tests_are_staged_where_nothing_the_agent_planted_sits_beside_them(tmp_path):
    """column-stats runs pytest in /tests: a conftest.py the agent put where the tests are staged
    from used to sit next to them and pass them all."""
    planted = ("mkdir -p /app/.harbor/tests && printf 'import os; os._exit(0)\\n' > /app/.harbor/tests/conftest.py\n"
               "printf '#!/bin/bash\\necho 0\\n' > /app/stats.sh\n")
    result = run_rollout(_harbor(tmp_path, "column-stats", planted))
    assert result.error_kind is None, result.error
    assert result.reward == 0.0, _scores(result)
    assert any(".harbor" in note for note in result.verify_notes), result.verify_notes


@pytest.mark.parametrize("backend", ["local", "podman", "unsafe-local"])
def test_set_aside_moves_only_what_the_agent_planted_and_put_back_restores_it(backend):
    """Sandbox level: setup's conftest.py stays, the agent's new ones go (names that are not UTF-8,
    hold a newline or a space included), the task's own file of such a name is staged again, and
    put_back gives the agent's files back byte for byte."""
    from pi_env.sandbox import SandboxSpec
    from pi_env.verify import put_back, record_setup, set_aside, startup_mount

    task = PiTask(task_id="aside", instruction="x", files={"pkg/conftest.py": "# the task's\n"},
                  verify_files={"tests/test_hidden.py": "def test_x(): pass\n"})
    made = registered(backend)()
    with made.create(SandboxSpec(ro_mounts=startup_mount())) as sandbox:
        for path, text in task.files.items():
            sandbox.write_file(path, text)
        sandbox.write_file("setup/conftest.py", "# setup's\n")
        record_setup(sandbox, task, setup_ran=True, env={})  # setup made setup/conftest.py
        planted = {"conftest.py": "a", "deep/er/pytest.ini": "b", "pkg/conftest.py": "c", "tests/helper.py": "d",
                   "tests/__init__.py": "e", "node_modules/x/index.js": "f", "keep.py": "g",
                   "pyproject.toml": "[tool.pytest.ini_options]\n", "setup.cfg": "[metadata]\nname = x\n"}
        for path, text in planted.items():
            sandbox.write_file(path, text)
        odd = sandbox.exec(["/bin/bash", "-c", r"mkdir -p $'a\nb' $'c\xff' 'd e' && for d in $'a\nb' $'c\xff' 'd e'; "
                                               r'do echo odd > "$d/conftest.py"; done'], timeout_s=30)
        assert odd.exit_code == 0, odd.stderr
        moved, notes = set_aside(sandbox, task)
        assert len(moved) == 9, notes  # 3 odd, conftest.py, deep/er/pytest.ini, pkg/conftest.py, tests, node_modules, pyproject
        assert "pkg/conftest.py" not in notes[0]  # the task's own file: set aside, but not news
        assert sandbox.read_file("setup/conftest.py") == b"# setup's\n"  # setup made it: stays
        assert sandbox.read_file("pkg/conftest.py") == b"# the task's\n"  # the task's own, staged again
        assert sandbox.read_file("keep.py") == b"g" and sandbox.read_file("setup.cfg").startswith(b"[metadata]")
        assert not any(sandbox.exists(path) for path in ("conftest.py", "tests", "node_modules", "pyproject.toml",
                                                         "deep/er/pytest.ini", "d e/conftest.py"))
        sandbox.write_file("tests/test_hidden.py", "staged")  # what verify stages there meanwhile
        put_back(sandbox, task, moved)
        for path, text in planted.items():
            assert sandbox.read_file(path) == text.encode(), path
        check = sandbox.exec(["/bin/bash", "-c", r"cat $'a\nb/conftest.py' $'c\xff/conftest.py' 'd e/conftest.py'"],
                             timeout_s=30)
        assert check.stdout == "odd\n" * 3 and not sandbox.exists("tests/test_hidden.py")


@pytest.mark.parametrize("name", ["hf", "e2b"])
def test_remote_verify_keeps_the_verifiers_tools_first(name):
    """hf and e2b (their stand-ins): verify runs in a fresh sandbox with the agent's work dir, and
    gets the same start-up (uploaded like the other read-only mounts) and set-aside."""
    from test_verify_world import _remote_backend

    backend, service, undo = _remote_backend(name)
    try:
        plain = "import sys, solution\nsys.exit(0 if solution.answer() == 42 else 1)\n"
        checks = {"verify_files": {"check.py": HIDDEN_CHECK, "test_hidden.py": HIDDEN_UNITTEST, "plain.py": plain},
                  "verify": ["python3 check.py", "python3 -m unittest -q test_hidden", "PYTHONPATH=. python3 plain.py"]}
        planted = {"fractions.py": EXIT_0, "unittest.py": EXIT_0, "sitecustomize.py": EXIT_0}
        forged = run_rollout(_task(f"remote-{name}", checks, {"solution.py": WRONG, **planted}), sandbox_backend=backend)
        assert forged.error_kind is None, (forged.error, forged.agent_log_tail[-1500:])
        assert forged.reward == 0.0, _scores(forged)
        honest = run_rollout(_task(f"remote-{name}", checks, {"solution.py": RIGHT}), sandbox_backend=backend)
        assert honest.reward == 1.0, _scores(honest)
    finally:
        undo()
        service.close()


def test_after_verify_the_work_dir_is_the_agents_again():
    """The hidden files are gone and what they replaced is back: the collected files (and a later
    step's agent) see the agent's work dir, never the hidden checks."""
    hidden = {"check.py": "print('hidden check')\n", "tests/test_hidden.py": "print('hidden test')\n"}
    task = PiTask(task_id="agents-again", instruction="x", verify_files=hidden,
                  verify=["python3 check.py", "python3 tests/test_hidden.py"],
                  solution=[{"tool": "write", "path": "check.py", "content": "mine\n"},
                            {"tool": "write", "path": "tests/notes.txt", "content": "also mine\n"}])
    result = run_rollout(task)
    assert [r.stdout for r in result.verify_results] == ["hidden check\n", "hidden test\n"]
    assert result.files == {"check.py": "mine\n", "tests/notes.txt": "also mine\n"}, result.files


def test_hidden_tests_in_a_package_named_like_the_standard_librarys_still_run():
    """The hidden files' own `test/` package is the verifier's, found where Python finds it, not
    the standard library's `test`; an agent's `test.py` beside it is set aside."""
    task = PiTask(task_id="test-package", instruction="make answer() return 42",
                  verify_files={"test/__init__.py": "", "test/test_hidden.py": HIDDEN_UNITTEST},
                  verify=["python3 -m unittest -q test.test_hidden"],
                  solution=[{"tool": "write", "path": "solution.py", "content": RIGHT},
                            {"tool": "write", "path": "test.py", "content": EXIT_0}])
    result = run_rollout(task)
    assert result.reward == 1.0, _scores(result)
    assert result.files["test.py"] == EXIT_0  # the agent's, back after verify


def test_a_later_steps_own_test_package_is_the_verifiers_too():
    """A multi-step Harbor task's second step stages a `test/` package the first step did not:
    verifying that step finds it as its own, not the standard library's `test` (the hidden
    modules are the verified step's, not the first step's)."""
    one = {"run.sh": "python3 check.py\n", "check.py": HIDDEN_CHECK}
    two = {"run.sh": "python3 -m unittest -q test.test_hidden\n", "test/__init__.py": "",
           "test/test_hidden.py": HIDDEN_UNITTEST}
    write = [{"tool": "write", "path": "solution.py", "content": RIGHT}]
    steps = [{"name": "one", "instruction": "make answer() return 42", "verify_files": one, "solution": write},
             {"name": "two", "instruction": "keep answer() at 42", "verify_files": two, "solution": write}]
    task = PiTask(task_id="later-test-package", instruction="make answer() return 42", verify_files=one,
                  verify=["bash run.sh"], solution=write,
                  metadata={"harbor": {"source": "t", "path_map": {"/app": "/root/workdir"}, "steps": steps}})
    result = run_rollout(task)
    assert [r.exit_code for r in result.verify_results] == [0, 0], _scores(result)
    assert result.reward == 1.0, _scores(result)


def test_verify_runs_the_source_the_agent_left_never_a_stale_compiled_copy():
    """Python prefers __pycache__/x.pyc to x.py when the source's mtime and size match: an edit of
    the same size within the same second (here pinned with touch) was verified as the old code.
    The agent's __pycache__ is set aside for verify, whichever way it came to disagree with the source."""
    pin = "touch -d @1700000000 solution.py"
    task = PiTask(task_id="stale-pyc", instruction="make answer() return 42",
                  verify_files={"check.py": HIDDEN_CHECK}, verify=["python3 check.py"],
                  solution=[{"tool": "write", "path": "solution.py", "content": WRONG},
                            {"tool": "bash", "command": f"{pin} && python3 -c 'import solution'"},
                            {"tool": "write", "path": "solution.py", "content": RIGHT},
                            {"tool": "bash", "command": f"{pin} && ls __pycache__"}])
    result = run_rollout(task)
    assert "solution.cpython" in json.dumps(result.messages), "no compiled copy was made: the test proves nothing"
    assert result.reward == 1.0, _scores(result)
