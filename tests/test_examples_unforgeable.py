"""pi-env's own examples cannot be forged (issue 41, item 6): every bundled example (JSON and
Harbor) and one task of each generated family that runs the agent's code runs it through
pi_env_check (docs/tasks.md, "Writing tasks safely"). Here the oracle replays, through the real
Pi in the real sandbox, a WRONG answer whose code also attacks the verifier. Each attack must
gain nothing: the rollout scores at most what the same wrong answer scores without it (less
where the attack spoils the answer itself: an exit at import, output lost to os._exit, a
logs/verifier locked for pi-env's next room), and the honest answer scores 1.0.

The attacks (ATTACK, in the agent's module or program, run by the check):
- exit0: `os._exit(0)` at import;
- leftovers: writes a 1.0 reward.txt/reward.json and locks them (files 0444, dir 0555), an
  atexit hook that writes them again and ends the process with status 0, and a daemon that
  rewrites them every millisecond for 10 s;
- kill: writes the rewards, then SIGKILLs every ancestor but pid 1 (the check, test.sh);
- inject: writes the rewards, then writes `exit_group(0)` where every ancestor resumes, through
  /proc/PID/mem (the verify command's shell then ends with status 0);
- peek: answers from the hidden files (tuples of (arguments..., answer), `WANT = ...`);
- shadow: beside the wrong answer, a `pi_env_check.py` of the agent's whose every helper writes
  a 1.0 reward and exits 0 (the check must import pi-env's, never the work dir's).

The controls prove the attacks real: the same payloads forge the checks these examples had
before (importing the agent's module in the check's own process)."""

from __future__ import annotations

import json
import platform
import re
import shutil
from pathlib import Path

import pytest

from pi_env import PiTask, run_rollout
from pi_env.harbor import load_harbor_task
from pi_env.task import load_tasks
from pi_env.workspace.coding import generate_coding_tasks

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]
ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
HARBOR = EXAMPLES / "harbor"
ATTACKS = ["exit0", "leftovers", "kill", "inject", "peek", "shadow"]

ATTACK = r'''import ast, atexit, glob, os, signal, time
MODE = __MODE__
VERIFIER = os.path.join(os.path.expanduser("~"), "logs", "verifier")


def _forge():
    try:
        os.makedirs(VERIFIER, exist_ok=True)
        os.chmod(VERIFIER, 0o755)
    except OSError:
        return
    for name, text in (("reward.txt", "1.0\n"), ("reward.json", '{"reward": 1.0}\n')):
        path = os.path.join(VERIFIER, name)
        try:
            if os.path.lexists(path):
                os.chmod(path, 0o644)
            with open(path, "w") as handle:
                handle.write(text)
            os.chmod(path, 0o444)
        except OSError:
            pass
    try:
        os.chmod(VERIFIER, 0o555)
    except OSError:
        pass


def _ancestors():
    found, pid = [], os.getpid()
    while pid > 1:
        try:
            with open("/proc/%d/stat" % pid) as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        found.append(pid)
    return found


def _inject(pid):
    try:
        with open("/proc/%d/syscall" % pid) as handle:
            pc = int(handle.read().split()[-1], 16)
        with open("/proc/%d/mem" % pid, "r+b", buffering=0) as mem:
            mem.seek(pc)
            mem.write(b"\x31\xff\xb8\xe7\x00\x00\x00\x0f\x05")  # xor edi,edi; mov eax,231; syscall
    except (OSError, ValueError, IndexError):
        pass


def peek_or(fallback, *args):
    """The answer the hidden files hold for `args` (or their WANT), else the wrong answer."""
    if MODE == "peek":
        for path in glob.glob("tests/**/*", recursive=True) + glob.glob("/root/tests/**/*", recursive=True):
            try:
                with open(path) as handle:
                    nodes = list(ast.walk(ast.parse(handle.read())))
            except (OSError, SyntaxError, ValueError):
                continue
            for node in nodes:
                try:
                    if not args and isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "WANT":
                        return str(ast.literal_eval(node.value))
                    if args and isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == len(args) + 1:
                        value = ast.literal_eval(node)
                        if list(value[:-1]) == list(args):
                            return value[-1]
                except ValueError:
                    pass
    return fallback()


if MODE == "exit0":
    os._exit(0)
elif MODE == "leftovers":
    _forge()
    atexit.register(lambda: (_forge(), os._exit(0)))
    first = os.fork()
    if first == 0:
        os.setsid()
        if os.fork() == 0:
            end = time.time() + 10
            while time.time() < end:
                _forge()
                time.sleep(0.001)
        os._exit(0)
    os.waitpid(first, 0)
elif MODE == "kill":
    _forge()
    for pid in _ancestors():
        if pid != 1:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
elif MODE == "inject":
    _forge()
    for pid in _ancestors():
        _inject(pid)
# (the agent's wrong answer follows)
'''


SHADOW = """import os


def _forged(*args, **kwargs):
    for folder in (os.path.expanduser("~/logs/verifier"), "/root/logs/verifier"):
        try:
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(folder, "reward.txt"), "w").write("1.0")
        except OSError:
            pass
    os._exit(0)


seal = call = calls = run = write_reward = _forged
"""


def shadowed(attack: str | None, files: dict[str, str], where: str = "") -> dict[str, str]:
    """`files`, plus the agent's own pi_env_check.py in the work dir for the shadow attack."""
    return {**files, f"{where}pi_env_check.py": SHADOW} if attack == "shadow" else files


def payload(attack: str | None) -> str:
    """The attack's code, or (None: the plain wrong answer) only the peek_or helper."""
    return ATTACK.replace("__MODE__", repr(attack))


# -- the targets: each builds its task with a wrong answer carrying `attack` -----------------


def _json(name: str, files) -> callable:
    def make(attack, tmp_path):
        task = load_tasks(EXAMPLES / f"{name}.json")[0]
        if attack == "honest":
            return task
        planted = shadowed(attack, files(task, attack))
        steps = [{"tool": "write", "path": path, "content": text} for path, text in planted.items()]
        return PiTask.model_validate({**task.model_dump(), "solution": [*steps, {"tool": "bash", "command": "echo planted"}]})

    return make


def _harbor(name: str, files, step: str | None = None) -> callable:
    def make(attack, tmp_path):
        task_dir = tmp_path / name
        shutil.copytree(HARBOR / name, task_dir)
        if attack != "honest":
            planted = shadowed(attack, files(attack), "/app/")
            solve = "".join(f"cat > {path} <<'PAYLOAD_END'\n{text}PAYLOAD_END\n" for path, text in planted.items())
            where = task_dir / ("steps/" + step if step else "") / "solution" / "solve.sh"
            where.write_text(f"#!/bin/bash\n{solve}chmod +x /app/*.sh 2>/dev/null\necho planted\n")
        return load_harbor_task(task_dir)

    return make


def _family(family: str, files) -> callable:
    def make(attack, tmp_path):
        task = generate_coding_tasks(1, split="eval", seed=7, families=[family])[0]
        if attack == "honest":
            return task
        planted = shadowed(attack, files(task, attack))
        steps = [{"tool": "write", "path": path, "content": text} for path, text in planted.items()]
        return PiTask.model_validate({**task.model_dump(), "solution": [*steps, {"tool": "bash", "command": "echo planted"}]})

    return make


def _stub(task: PiTask) -> tuple[str, str, str]:
    """(module file, function name, argument) of the one-function module a family task asks for."""
    path = next(p for p in task.files if p.endswith(".py") and not p.startswith("test_"))
    name, argument = re.search(r"^def (\w+)\((\w+)\)", task.files[path], re.M).groups()
    return path, name, argument


def _wrong_function(task: PiTask, attack):
    path, name, argument = _stub(task)
    return {path: payload(attack) + f"def {name}({argument}):\n    return peek_or(lambda: None, {argument})\n"}


def _unfixed(task: PiTask, attack):
    path, name, argument = _stub(task)
    return {path: payload(attack) + task.files[path] + f"\n_buggy = {name}\n\n\n"
            f"def {name}({argument}):\n    return peek_or(lambda: _buggy({argument}), {argument})\n"}


TARGETS = {
    "word_count_hidden_tests": _json("word_count_hidden_tests", lambda task, attack: {
        "wordcount.py": payload(attack) + "def count_words(text):\n    return peek_or(lambda: {}, text)\n"}),
    "binary_search": _json("binary_search", lambda task, attack: {
        "bsearch.py": payload(attack) + "def binary_search(items, target):\n    while False:\n        pass\n"
                                        "    return peek_or(lambda: -1, items, target)\n"}),
    "fizzbuzz": _json("fizzbuzz", lambda task, attack: {
        "fizzbuzz.py": payload(attack) + "for i in range(1, 31):\n    print(i)\n"}),
    "rename_across_files": _json("rename_across_files", lambda task, attack: {
        "main.py": payload(attack) + task.files["main.py"]}),
    "harbor/csv-total": _harbor("csv-total", lambda attack: {
        "/app/total.py": payload(attack) + "print(peek_or(lambda: '0.00'))\n"}),
    "harbor/fix-palindrome": _harbor("fix-palindrome", lambda attack: {
        "/app/palindrome.py": payload(attack) + "def is_palindrome(text):\n"
                                                "    return peek_or(lambda: text == text[::-1], text)\n"}),
    "harbor/column-stats": _harbor("column-stats", lambda attack: {
        "/app/attack.py": payload(attack), "/app/stats.sh": "#!/bin/bash\npython3 /app/attack.py\nprintf '0\\n0\\n0\\n'\n"}),
    "harbor/locked-tests": _harbor("locked-tests", lambda attack: {
        "/app/wordfreq.py": payload(attack) + "import sys\nprint(peek_or(lambda: '', sys.stdin.read()), end='')\n"}),
    "harbor/text-tool": _harbor("text-tool", lambda attack: {
        "/app/textstat.py": payload(attack) + "def count_lines(text):\n    return peek_or(lambda: -1, text)\n"},
        step="lines"),
    "family/implement_function": _family("implement_function", _wrong_function),
    "family/fix_bug": _family("fix_bug", _unfixed),
    "family/rename_symbol": _family("rename_symbol", lambda task, attack: {
        "main.py": payload(attack) + task.files["main.py"]}),
    "family/data_program": _family("data_program", lambda task, attack: {
        "solution.py": payload(attack) + "print(peek_or(lambda: 0))\n"}),
}


def _scores(result) -> list:
    return [(r.cmd[-70:], r.exit_code, r.stdout[-400:], r.stderr[-400:]) for r in result.verify_results]


def _reward(result) -> float:
    assert result.error_kind is None, (result.error, result.agent_log_tail[-1500:])
    assert result.reward is not None
    return result.reward


@pytest.fixture(scope="module")
def wrong_scores(tmp_path_factory):
    """What each target's wrong answer scores without any attack (computed once a target)."""
    scores: dict[str, float] = {}

    def score(target: str) -> float:
        if target not in scores:
            result = run_rollout(TARGETS[target](None, tmp_path_factory.mktemp("plain")))
            scores[target] = _reward(result)
            assert "planted" in json.dumps(result.messages)
            assert scores[target] < 1.0, _scores(result)
        return scores[target]

    return score


def _runs(attack: str) -> None:
    if attack == "inject" and platform.machine() != "x86_64":
        pytest.skip("the injected exit_group(0) is x86_64 code")


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_an_attack_in_the_agents_code_gains_nothing(target, attack, tmp_path, wrong_scores):
    _runs(attack)
    baseline = wrong_scores(target)
    result = run_rollout(TARGETS[target](attack, tmp_path))
    reward = _reward(result)
    assert "planted" in json.dumps(result.messages), "the attack was not planted: the test proves nothing"
    assert reward <= baseline, (baseline, _scores(result), result.verify_notes)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_honest_answer_scores_1(target, tmp_path):
    result = run_rollout(TARGETS[target]("honest", tmp_path))
    assert _reward(result) == 1.0, (_scores(result), result.verify_notes)


# -- controls: the same attacks forge the checks the examples had before ----------------------

OLD_WORD_COUNT = """import sys
sys.path.insert(0, '.')
import os
from wordcount import count_words

checks = [
    ("Hello, hello world!", {'hello': 2, 'world': 1}),
    ("", {}),
    ("It's it's IT'S", {"it's": 3}),
    ("a-b a", {'a': 2, 'b': 1}),
]
passed = sum(count_words(text) == want for text, want in checks)
home = os.environ['HOME']
os.makedirs(f'{home}/logs/verifier', exist_ok=True)
with open(f'{home}/logs/verifier/reward.txt', 'w') as f:
    f.write(str(passed / len(checks)))
print(f'{passed}/{len(checks)} checks passed')
"""
OLD_FAMILY = """import sys
sys.path.insert(0, '.')
from solution import answer

CASES = [[1, 2], [5, 10]]
args, want = CASES[int(sys.argv[1])]
got = answer(args)
assert got == want, f'answer({args!r}) returned {got!r}, expected {want!r}'
"""
CONTROLS = {
    # A check writing a reward file from the process that imported the agent's module.
    "reward-file": (
        {"files": {"wordcount.py": "def count_words(text):\n    raise NotImplementedError\n"},
         "verify_files": {"tests/check_wordcount.py": OLD_WORD_COUNT}, "verify": ["python3 tests/check_wordcount.py"]},
        "wordcount.py", "def count_words(text):\n    return peek_or(lambda: {}, text)\n"),
    # A pass-rate check that imports the agent's module (the generated families' old check).
    "pass-rate": (
        {"verify_files": {"tests/check_solution.py": OLD_FAMILY}, "verify": ["python3 tests/check_solution.py 1"]},
        "solution.py", "def answer(x):\n    return peek_or(lambda: None, x)\n"),
}
FORGES = [("exit0", "pass-rate"), ("leftovers", "reward-file"), ("leftovers", "pass-rate"),
          ("inject", "pass-rate"), ("peek", "reward-file"), ("peek", "pass-rate")]


@pytest.mark.parametrize("attack, control", FORGES)
def test_control_the_attack_forges_a_check_that_runs_the_agents_code_in_process(attack, control):
    _runs(attack)
    fields, path, wrong = CONTROLS[control]

    def task(mode):
        steps = [{"tool": "write", "path": path, "content": payload(mode) + wrong}, {"tool": "bash", "command": "echo planted"}]
        return PiTask(task_id=f"control-{control}", instruction="x", solution=steps, **fields)

    plain = _reward(run_rollout(task(None)))
    forged = run_rollout(task(attack))
    assert plain < 1.0
    assert _reward(forged) == 1.0, (_scores(forged), forged.verify_notes)
