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
import subprocess
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
    return PiConfig(sandbox={"backend": backend})


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


# Issue 41's classes: what tools, import systems and git prefer, links, the verify commands' own
# leftovers. name -> (task fields, the wrong answer, what the agent plants (files), commands the
# agent runs after writing them, the honest answer, what the sandbox needs). Each forgery scored
# 1.0 (or 0.5) on the set-aside design; each must score what the wrong answer scores alone.
CHECKLIB = "def ok(x):\n    return x == 42\n"
LIB_CHECK = "import sys, checklib, solution\nsys.exit(0 if checklib.ok(solution.answer()) else 1)\n"
EXTENSION = ("#include <Python.h>\nstatic PyObject *ok(PyObject *s, PyObject *a) { Py_RETURN_TRUE; }\n"
             "static PyMethodDef m[] = {{\"ok\", ok, METH_VARARGS, \"\"}, {0}};\n"
             "static struct PyModuleDef d = {PyModuleDef_HEAD_INIT, \"checklib\", 0, -1, m};\n"
             "PyMODINIT_FUNC PyInit_checklib(void) { return PyModule_Create(&d); }\n")
BUILD = ("gcc -shared -fPIC $(python3 -c 'import sysconfig; print(\"-I\" + sysconfig.get_paths()[\"include\"])') ext.c "
         "-o checklib$(python3 -c 'import sysconfig; print(sysconfig.get_config_var(\"EXT_SUFFIX\"))')")
# Run by the first verify command: an unchecked-hash .pyc for the hidden checklib, used by the next.
PYC = (WRONG + "if __name__ == '__main__':\n    import os, py_compile, sys\n"
       "    open('evil.py', 'w').write('def ok(x):\\n    return True\\n')\n"
       "    py_compile.compile('evil.py', cfile=f'__pycache__/checklib.{sys.implementation.cache_tag}.pyc',\n"
       "                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n    print(41)\n")
GIT_SETUP = ["git init -q && git add -A && git -c user.email=a@b -c user.name=a commit -qm init"]
GIT_CHECK = ("import solution\nopen('/root/logs/verifier/reward.txt', 'w')"
             ".write('1' if solution.answer() == 42 else '0')\n")
FORGING_CONFIG = ("[core]\n\trepositoryformatversion = 0\n\tbare = false\n[filter \"x\"]\n"
                  "\tclean = \"sh -c 'echo 1 > /root/logs/verifier/reward.txt; cat'\"\n")
PYTEST_HIDDEN = {"setup": [INSTALL_PYTEST], "verify_files": {"test_hidden.py": HIDDEN_PYTEST},
                 "verify": ["python3 -m pytest -q -p no:cacheprovider test_hidden.py"]}
COLLECT_ONLY = "addopts = ['--collect-only']\n"
SUBPROCESS_CHECK = {"verify_files": {"check.py": "import subprocess, sys, solution\n"
                                                 "sys.exit(0 if solution.answer() == 42 else 1)\n"},
                    "verify": ["python3 check.py"]}
COPY_CHECK = {"verify_files": {"check.py": "import copy, sys, solution\nsys.exit(0 if solution.answer() == 42 else 1)\n"},
              "verify": ["python3 check.py"]}
NODE_CHECKER = {"setup": ["mkdir -p $HOME/node_modules/checker && "
                          "echo 'module.exports = x => x === 42' > $HOME/node_modules/checker/index.js"],
                "verify_files": {"check.js": "process.exit(require('checker')(require('./solution.js').answer()) ? 0 : 1)\n"}}
PTH_WRITER = ("if __name__ == '__main__':\n    import os, site\n    d = site.getusersitepackages()\n"
              "    os.makedirs(d, exist_ok=True)\n    open(os.path.join(d, 'zz.pth'), 'w').write('import os; os._exit(0)\\n')\n")
CHECKER_WRITER = ("if (require.main === module) require('fs').writeFileSync(require('os').homedir() + "
                  "'/node_modules/checker/index.js', 'module.exports = () => true\\n')\n")
CLASSES = {
    "pytest-toml": (PYTEST_HIDDEN, {"solution.py": WRONG}, {"pytest.toml": "[pytest]\n" + COLLECT_ONLY}, [],
                    {"solution.py": RIGHT}, "pytest"),
    "pyproject-native-table": (PYTEST_HIDDEN, {"solution.py": WRONG}, {"pyproject.toml": "[tool.pytest]\n" + COLLECT_ONLY},
                               [], {"solution.py": RIGHT}, "pytest"),
    "pyproject-dotted-key": (PYTEST_HIDDEN, {"solution.py": WRONG},
                             {"pyproject.toml": "tool.pytest.ini_options.addopts = '--collect-only'\n"}, [],
                             {"solution.py": RIGHT}, "pytest"),
    "extension-module": ({"verify_files": {"check.py": LIB_CHECK, "checklib.py": CHECKLIB}, "verify": ["python3 check.py"]},
                         {"solution.py": WRONG}, {"ext.c": EXTENSION}, [BUILD], {"solution.py": RIGHT}, "gcc"),
    "node-extensionless": ({"verify_files": {"judge.js": "module.exports = x => x === 42\n",
                                             "check.js": "process.exit(require('./judge')(require('./solution.js')"
                                                         ".answer()) ? 0 : 1)\n"},
                            "verify": ["node check.js"]},
                           NODE_FILES, {"judge": "module.exports = () => true\n"}, [],
                           {"solution.js": "exports.answer = () => 42\n"}, "node"),
    "pyc-from-an-earlier-command": ({"verify_files": {"check.py": LIB_CHECK, "checklib.py": CHECKLIB},
                                     "verify": ["python3 solution.py | grep -qx 42", "python3 check.py"]},
                                    {"solution.py": WRONG + "if __name__ == '__main__':\n    print(41)\n"},
                                    {"solution.py": PYC}, [], {"solution.py": RIGHT + "print(42)\n"}, "python3"),
    "git-filter-driver": ({"setup": GIT_SETUP, "files": {"solution.py": "def answer():\n    return 0\n"},
                           "reward_file": True, "verify_files": {"check.py": GIT_CHECK},
                           "verify": ["python3 check.py; git diff --stat > /dev/null"]},
                          {"solution.py": WRONG}, {".git/config": FORGING_CONFIG, ".git/info/attributes": "* filter=x\n"},
                          [], {"solution.py": RIGHT}, "git"),
    "link-to-the-reward-file": ({"reward_file": True,
                                 "verify": ["python3 solution.py > out.txt; grep -qx 42 out.txt && "
                                            "echo 1 > $HOME/logs/verifier/reward.txt; true"]},
                                {"solution.py": "print(1)\n"}, {}, ["ln -s /root/logs/verifier/reward.txt out.txt"],
                                {"solution.py": "print(42)\n"}, "python3"),
    "link-to-a-hidden-file": ({"verify_files": {"check.py": HIDDEN_CHECK},
                               "verify": ["python3 solution.py > notes.txt; python3 check.py"]},
                              {"solution.py": WRONG + "print('import os; os._exit(0)')\n"}, {},
                              ["ln -s check.py notes.txt"], {"solution.py": RIGHT}, "python3"),
    # Found by a red-team pass on the room itself:
    # a name the standard library reserves, which this platform lacks (subprocess tries msvcrt)
    "stdlib-name-the-platform-lacks": (SUBPROCESS_CHECK, {"solution.py": WRONG}, {"msvcrt.py": EXIT_0}, [],
                                       {"solution.py": RIGHT}, "python3"),
    # what a standard library module imports at its top (copy tries org.python.core)
    "stdlib-optional-import": (COPY_CHECK, {"solution.py": WRONG},
                               {"org/__init__.py": "", "org/python/__init__.py": "", "org/python/core.py": EXIT_0},
                               [], {"solution.py": RIGHT}, "python3"),
    # package metadata in the work dir: an entry point pytest autoloads as a plugin
    "dist-info-pytest-plugin": (PYTEST_HIDDEN, {"solution.py": WRONG},
                                {"evil-0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 0\n",
                                 "evil-0.dist-info/entry_points.txt": "[pytest11]\nevil = evilplug\n",
                                 "evilplug.py": EXIT_0}, [], {"solution.py": RIGHT}, "pytest"),
    # Node resolves a package's own name (package.json "exports") before node_modules
    "node-package-self-reference": ({**NODE_CHECKER, "verify": ["node check.js"]}, NODE_FILES,
                                    {"package.json": '{"name": "checker", "exports": "./evil.js"}',
                                     "evil.js": "module.exports = () => true\n"}, [],
                                    {"solution.js": "exports.answer = () => 42\n"}, "node"),
    # the first command's agent code changes the home the second command's tools read
    "user-site-between-commands": ({"setup": [INSTALL_PYTEST], "verify_files": {"test_hidden.py": HIDDEN_PYTEST},
                                    "verify": ["python3 -c 'import solution, sys; sys.exit(solution.answer() != 42)'; "
                                               "s=$?; python3 solution.py; exit $s",
                                               "python3 -m pytest -q -p no:cacheprovider test_hidden.py"]},
                                   {"solution.py": WRONG}, {"solution.py": WRONG + PTH_WRITER}, [],
                                   {"solution.py": RIGHT}, "pytest"),
    # the first command's agent code removes what setup made in the home (the verifier's helper):
    # only the home's own ctime changes
    "home-entry-removed-between-commands": (
        {"setup": ["d=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p $d && "
                   "printf 'def ok(x):\\n    return x == 42\\n' > $d/checklib.py"],
         "verify_files": {"check.py": LIB_CHECK},
         "verify": ["python3 -c 'import solution, sys; sys.exit(solution.answer() != 42)'; s=$?; "
                    "python3 solution.py; exit $s", "python3 check.py"]},
        {"solution.py": WRONG, "checklib.py": "def ok(x):\n    return True\n"},
        {"solution.py": WRONG + "if __name__ == '__main__':\n    import os, shutil\n"
                                "    shutil.rmtree(os.path.expanduser('~/.local'))\n"}, [],
        {"solution.py": RIGHT}, "python3"),
    "node-modules-between-commands": ({**NODE_CHECKER, "verify": ["node -e \"process.exit(require('./solution.js')"
                                                                  ".answer() === 42 ? 0 : 1)\"; s=$?; node solution.js; "
                                                                  "exit $s", "node check.js"]},
                                      NODE_FILES, {"solution.js": "exports.answer = () => 41\n" + CHECKER_WRITER}, [],
                                      {"solution.js": "exports.answer = () => 42\n"}, "node"),
}
NEEDS.update({"gcc": "command -v gcc && python3 -c 'import sysconfig, os; "
                     "assert os.path.exists(sysconfig.get_paths()[\"include\"] + \"/Python.h\")'",
              "git": "command -v git && command -v python3"})


@pytest.mark.parametrize("backend", ["local", "podman"])
@pytest.mark.parametrize("attack", sorted(CLASSES))
def test_a_class_of_forgery_scores_what_the_wrong_answer_scores_alone(attack, backend):
    _class_of_forgery(attack, _config(backend, CLASSES[attack][-1]))


# Verify is the agent's no matter which agent ran: one class of each kind (a tool's configuration,
# a link, git, the home between commands, Node's resolution) planted through each other agent's
# own tools (the oracle adapts the steps), on the local backend.
@pytest.mark.parametrize("agent", ["opencode", "qwen-code", "mini-swe-agent"])
@pytest.mark.parametrize("attack", ["pytest-toml", "link-to-the-reward-file", "git-filter-driver",
                                    "home-entry-removed-between-commands", "node-package-self-reference"])
def test_a_class_of_forgery_fails_through_every_agent(attack, agent):
    config = _config("local", CLASSES[attack][-1])
    config.agent = {"name": agent}  # validated on assignment, as PiConfig(agent=agent)
    _class_of_forgery(attack, config, agent)


def _class_of_forgery(attack: str, config: PiConfig, agent: str = "pi") -> None:
    fields, wrong, planted, commands, honest_files, needs = CLASSES[attack]

    def task(files: dict[str, str], commands: list[str]) -> PiTask:
        steps = [{"tool": "write", "path": path, "content": text} for path, text in files.items()]
        # "planted" is printed only when every command of the attack succeeded
        steps += [{"tool": "bash", "command": " && ".join([*commands, "echo plant''ed"])}]
        return PiTask(task_id=attack, instruction="make answer() return 42", **fields, solution=steps)

    alone = run_rollout(task(wrong, []), config)
    forged = run_rollout(task({**wrong, **planted}, commands), config)
    assert forged.agent == agent
    assert forged.error_kind is None, (forged.error, forged.agent_log_tail[-1500:], forged.setup_results)
    assert "planted" in json.dumps(forged.messages), "the attack did not run: the test proves nothing"
    assert alone.reward == 0.0 and forged.reward == alone.reward, (_scores(forged), forged.verify_notes)
    honest = run_rollout(task(honest_files, []), config)
    assert honest.reward == 1.0, (_scores(honest), honest.verify_notes)


def test_a_reward_file_written_by_agent_code_that_killed_its_check_does_not_count():
    """The check runs the agent's program in a subprocess and writes the reward after it; the
    program writes 1.0 itself and kills the check before it can write its 0 (the csv-total
    forgery). The command was killed: its reward file does not count, 0.0 with the reason."""
    check = ("import subprocess, sys\nout = subprocess.run([sys.executable, 'solution.py'], capture_output=True, "
             "text=True).stdout\nopen('/root/logs/verifier/reward.txt', 'w').write('1' if out.strip() == '42' else '0')\n")
    kill = ("import os, signal\nopen('/root/logs/verifier/reward.txt', 'w').write('1')\n"
            "os.kill(os.getppid(), signal.SIGKILL)\nprint(41)\n")
    fields = {"reward_file": True, "verify_files": {"check.py": check}, "verify": ["python3 check.py"]}
    forged = run_rollout(_task("kills-its-check", fields, {"solution.py": kill}))
    assert "planted" in json.dumps(forged.messages)
    assert forged.reward == 0.0 and "killed" in forged.verify_notes[-1], (forged.verify_notes, _scores(forged))
    assert run_rollout(_task("kills-its-check", fields, {"solution.py": "print(42)\n"})).reward == 1.0


def test_a_verifier_dir_an_earlier_command_locked_is_the_verifiers_again():
    """The agent's program, run by the first command, makes logs/ and logs/verifier read-only: the
    next command's room makes them writable again (their owner can), so the answer is scored as
    it is, here 1.0, never 0.0 for a room that could not be made."""
    lock = ("import os\ndef answer():\n    return 42\nif __name__ == '__main__':\n"
            "    home = os.path.expanduser('~')\n    os.chmod(home + '/logs/verifier', 0o555)\n"
            "    os.chmod(home + '/logs', 0o555)\n")
    fields = {"verify_files": {"check.py": HIDDEN_CHECK}, "verify": ["python3 solution.py", "python3 check.py"]}
    result = run_rollout(_task("locked-verifier-dir", fields, {"solution.py": lock}))
    assert "planted" in json.dumps(result.messages)
    assert result.reward == 1.0, (result.verify_notes, _scores(result))


def test_a_runner_the_image_lacks_is_the_tasks_error_or_not_found_never_the_agents():
    """No pytest for the sandbox's python3: `python3 -m pytest` is the task's error, found after
    setup (unscored, `setup_failed`, saying what to install), and where pi-env cannot tell (the
    command sets PATH), the agent's pytest.py is not imported: the command fails as it would
    beside an empty work dir."""
    from pi_env.sandbox import SandboxSpec

    config = _config("local", "python3")
    with registered("local")().create(SandboxSpec()) as sandbox:
        if sandbox.exec("cd && python3 -c 'import pytest'", timeout_s=60).exit_code == 0:
            pytest.skip("the sandbox's python3 has pytest")
    plain = {"verify_files": {"test_hidden.py": HIDDEN_PYTEST}, "verify": ["python3 -m pytest -q test_hidden.py"]}
    result = run_rollout(_task("no-runner", plain, {"solution.py": WRONG, "pytest.py": EXIT_0}), config)
    assert result.error_kind == "setup_failed" and "install it in setup" in result.error, result.error
    hidden = {**plain, "verify": ["PATH=$PATH python3 -m pytest -q test_hidden.py"]}
    result = run_rollout(_task("no-runner-unchecked", hidden, {"solution.py": RIGHT, "pytest.py": EXIT_0}), config)
    assert "planted" in json.dumps(result.messages)
    assert result.reward == 0.0 and "No module named 'pytest'" in result.verify_results[0].stderr, _scores(result)


def test_a_reward_file_written_by_the_agents_program_is_ignored_and_noted():
    fields, planted, _ = ATTACKS["reward-file-from-program"]
    result = run_rollout(_task("noted", fields, planted))
    assert result.reward == 0.0 and result.reward_source == "pass_rate"
    assert any("ignored" in note and "pass rate" in note for note in result.verify_notes), result.verify_notes


def test_a_path_shim_in_the_work_dir_does_not_replace_the_verifiers_tool():
    # A task whose PATH starts in the work dir (as a Dockerfile's ENV may): the agent's bin/grep.
    config = PiConfig(sandbox={"extra_env": {"PATH": "/root/workdir/bin:/usr/local/bin:/usr/bin:/bin"}})
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


ROOM_PLANT = r"""set -e
mkfifo fifo
ln -s /root/logs/verifier/reward.txt out.txt          # the verifier's redirect would write the reward
ln -s check.py alias.py                               # a link onto a hidden file
ln -s /root/.bashrc home.txt                          # anything of the home
ln -s /usr/bin/python3 python                         # a venv's interpreter: kept
ln -s keep.py also.py                                 # a link within the work: kept
ln -s loop2 loop1; ln -s loop1 loop2; ln -s nowhere dangling  # resolved as far as they go: into the work
ln -s into/x into                                     # a link into itself (realpath never ends): out
mkdir -p check __pycache__ .git/hooks .git/info .git/objects .git/refs/heads pkg2
printf 'import os; os._exit(0)\n' > check/__init__.py     # a package dir beats check.py
printf 'x' > check.cpython-311-x86_64-linux-gnu.so   # an extension module beats check.py
printf 'x' > lib; printf 'x' > lib.json               # Node: ./lib and ./lib.json before ./lib.js
printf 'x' > __pycache__/keep.cpython-311.pyc; printf 'x' > lone.pyc; printf 'x' > pkg2/x.pyo
printf 'ref: refs/heads/main\n' > .git/HEAD
printf '#!/bin/sh\nexit 0\n' > .git/hooks/pre-commit
printf '* filter=evil diff=evil\n' > .git/info/attributes
printf '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = /x\n\tpager = /x\n[filter "evil"]\n\tclean = /x\n' > .git/config
printf '[diff "evil"]\n\ttextconv = /x\n[include]\n\tpath = /x\n[user]\n\tname = agent\n' >> .git/config
mkdir -p sub && printf 'gitdir: /root/x\n' > sub/.git
mkdir -p $'a\nb' $'c\xff' 'd e'; for d in $'a\nb' $'c\xff' 'd e'; do echo odd > "$d/conftest.py"; done
"""


@pytest.mark.parametrize("script", ["_ROOM", "_PUT_BACK"])
def test_the_rooms_scripts_parse(script):
    """bash reads a script a command at a time: a stray `fi` after an `exit` would never be seen."""
    from pi_env.verify import room

    checked = subprocess.run(["bash", "-n"], input=getattr(room, script), capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("backend", ["local", "podman", "unsafe-local"])
def test_the_room_holds_the_agents_work_as_data_and_leave_gives_it_back(backend):
    """Sandbox level (pi_env.verify.room): every rule of the room on one planted work dir, the
    task's own files staged again, setup's configuration kept, an earlier command's leftovers
    cleaned again by refresh, and leave() giving the agent's work dir back as it left it."""
    from pi_env.sandbox import SandboxSpec
    from pi_env.verify import SETUP_PATHS, record_setup, stage, startup_mount
    from pi_env.verify.room import enter, leave, refresh, restage_task_files, room_for

    task = PiTask(task_id="room", instruction="x", files={"pkg/conftest.py": "# the task's\n", "check.txt": "data"},
                  verify_files={"tests/test_hidden.py": "def test_x(): pass\n", "check.py": "print('hidden')\n", "lib.js": "hidden"})
    made = registered(backend)()
    with made.create(SandboxSpec(ro_mounts=startup_mount())) as sandbox:
        for path, text in task.files.items():
            sandbox.write_file(path, text)
        sandbox.write_file("setup/conftest.py", "# setup's\n")
        record_setup(sandbox, task, setup_ran=True, env={})  # setup made setup/conftest.py
        planted = {"conftest.py": "a", "deep/er/pytest.ini": "b", "pkg/conftest.py": "c", "tests/helper.py": "d",
                   "tests/__init__.py": "e", "node_modules/x/index.js": "f", "keep.py": "g", "pytest.toml": "h",
                   "pyproject.toml": 'tool.pytest.ini_options.addopts = "--co"\n', "tests.py": "i", "check.txt": "j"}
        for path, text in planted.items():
            sandbox.write_file(path, text)
        plant = sandbox.exec(["/bin/bash", "-c", ROOM_PLANT.replace("/root", sandbox.host_path("/root")) if backend == "unsafe-local"
                              else ROOM_PLANT], timeout_s=30)
        assert plant.exit_code == 0, plant.stderr
        before = sandbox.exec(["/bin/bash", "-c", "find . -printf '%p %y %l\\n' | sort | md5sum"], timeout_s=30).stdout
        room = room_for(sandbox, task, SETUP_PATHS)
        entered = enter(sandbox, task, room)
        restage_task_files(sandbox, task)
        stage(sandbox, task)
        assert "tests.py" in entered.notes[0] and "pkg/conftest.py" not in entered.notes[0], entered.notes
        listing = sandbox.exec(["/bin/bash", "-c", r"find . -mindepth 1 ! -path './.git/?*/?*' -printf '%P\0' | "
                                r"tr '\n\0\377' '?\n?'"], timeout_s=30).stdout
        assert set(listing.splitlines()) == {
            ".git", ".git/HEAD", ".git/config", ".git/info", ".git/objects", ".git/refs",  # no hooks, no attributes
            "also.py", "python",  # links within the work and into the system; none to the home or the verifier
            "check.py", "check.txt", "lib.js", "tests", "tests/test_hidden.py",  # the verifier's names: its alone
            "keep.py", "pkg", "pkg/conftest.py", "pkg2", "setup", "setup/conftest.py", "sub",  # no cache, no .git file
            "deep", "deep/er", "a?b", "c?", "d e",  # no tool configuration, whatever its name's bytes
        }, listing
        assert sandbox.read_file("pkg/conftest.py") == b"# the task's\n"  # the task's own, staged again
        assert sandbox.read_file("check.txt") == b"data"  # the task's own, under a hidden file's stem
        assert sandbox.read_file("check.py") == b"print('hidden')\n"
        config = sandbox.read_file(".git/config").decode()
        assert "evil" not in config and "/x" not in config, config  # every key that names a program: gone
        if sandbox.exec("test -x /usr/bin/git", timeout_s=30).exit_code == 0:
            assert "agent" in config, config  # allowlisted keys stay
        # An earlier command's agent code leaves a cache, a link and a FIFO; refresh cleans them, keeps data.
        dirty = sandbox.exec(["/bin/bash", "-c", "mkdir -p __pycache__ && echo x > __pycache__/check.cpython-311.pyc"
                              " && ln -s ../logs/verifier/reward.txt r.txt && mkfifo f && echo 41 > out.txt"],
                             timeout_s=30)
        assert dirty.exit_code == 0, dirty.stderr
        refresh(sandbox, task, room)
        assert not any(sandbox.exists(path) for path in ("__pycache__", "r.txt", "f"))
        assert sandbox.read_file("out.txt") == b"41\n"
        leave(sandbox, task, entered)
        after = sandbox.exec(["/bin/bash", "-c", "find . -printf '%p %y %l\\n' | sort | md5sum"], timeout_s=30).stdout
        assert after == before  # the agent's work dir, as it left it (the collected files, a later step's agent)
        for path, text in planted.items():
            assert sandbox.read_file(path) == text.encode(), path


@pytest.mark.parametrize("backend", ["local", "podman"])
def test_a_task_with_outputs_gets_only_those_and_its_own_files(backend):
    from pi_env.sandbox import SandboxSpec
    from pi_env.verify import SETUP_PATHS, startup_mount
    from pi_env.verify.room import enter, leave, restage_task_files, room_for

    task = PiTask(task_id="outputs", instruction="x", outputs=["src/**/*.py", "README.md"],
                  files={"data/in.csv": "1,2\n", "src/app.py": "task's\n"})
    with registered(backend)().create(SandboxSpec(ro_mounts=startup_mount())) as sandbox:
        for path, text in {"data/in.csv": "forged", "src/app.py": "agent's", "src/deep/er/x.py": "x",
                           "src/notes.txt": "n", "README.md": "r", "conftest.py": "c", "pytest.ini": "p"}.items():
            sandbox.write_file(path, text)
        entered = enter(sandbox, task, room_for(sandbox, task, SETUP_PATHS))
        restage_task_files(sandbox, task)
        files = sandbox.snapshot("/root/workdir")
        assert files == {"src/app.py": b"agent's", "src/deep/er/x.py": b"x", "README.md": b"r",
                         "data/in.csv": b"1,2\n"}, files
        leave(sandbox, task, entered)
        assert sandbox.read_file("pytest.ini") == b"p" and sandbox.read_file("data/in.csv") == b"forged"


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
