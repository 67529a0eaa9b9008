"""Verify runs in a world the agent did not shape (issue 12, part 1): a hostile agent (the oracle's
`solution` steps, run by the real Pi in the real sandbox) plants a hook outside the work dir that
would make a failing verify pass; the task stays unsolved, so every rollout must score 0.0.

Each attack here made its task score 1.0 before verify's world was reset to what setup left."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from sandbox_backends import registered

from pi_env import PiConfig, PiTask, load_tasks, run_rollout

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

HIDDEN_CHECK = "import pathlib, sys\nsys.exit(0 if pathlib.Path('solved.txt').exists() else 1)\n"
EXIT_0_AT_EXIT = "import atexit, os; atexit.register(lambda: os._exit(0))"
USER_SITE = "$(python3 -c 'import site; print(site.getusersitepackages())')"
FORGE_REWARD = "mkdir -p $HOME/logs/verifier; echo 1.0 > $HOME/logs/verifier/reward.txt"

# A wheel of a package `checker` whose `python3 -m checker` always passes, in /root/evil, and a
# pip config that installs from there only (what `pip install checker` in a verifier then gets).
FAKE_CHECKER_WHEEL = r"""mkdir -p $HOME/evil && python3 - <<'EOF'
import zipfile, os
with zipfile.ZipFile(os.path.expanduser('~/evil/checker-1.0-py3-none-any.whl'), 'w') as z:
    z.writestr('checker/__init__.py', '')
    z.writestr('checker/__main__.py', 'print("all good")\n')
    z.writestr('checker-1.0.dist-info/METADATA', 'Metadata-Version: 2.1\nName: checker\nVersion: 1.0\n')
    z.writestr('checker-1.0.dist-info/WHEEL', 'Wheel-Version: 1.0\nGenerator: x\nRoot-Is-Purelib: true\nTag: py3-none-any\n')
    z.writestr('checker-1.0.dist-info/RECORD', '')
EOF
mkdir -p $HOME/.config/pip && printf '[global]\nno-index = true\nfind-links = /root/evil\nbreak-system-packages = true\nuser = true\n' > $HOME/.config/pip/pip.conf"""

ATTACKS = {
    # Python's user site: a usercustomize.py runs in every python3 and can force exit code 0.
    "usercustomize": (f"d={USER_SITE}; mkdir -p $d && echo '{EXIT_0_AT_EXIT}' > $d/usercustomize.py",
                      {"check.py": HIDDEN_CHECK}, ["python3 check.py"]),
    # A .pth file in the user site: its `import` lines run at start-up.
    "pth": (f"d={USER_SITE}; mkdir -p $d && echo '{EXIT_0_AT_EXIT}' > $d/zz-evil.pth",
            {"check.py": HIDDEN_CHECK}, ["python3 check.py"]),
    # git's global config: core.fsmonitor is a command every `git status` runs.
    "git-fsmonitor": (f"git config --global core.fsmonitor '{FORGE_REWARD}; false'", {},
                      ["git init -q . 2>/dev/null; git status --porcelain >/dev/null; test -f solved.txt"]),
    # A shell start-up file read by the login shell a verifier uses to get its PATH.
    "shell-rc": ("echo 'exit 0' >> $HOME/.bash_profile; echo 'exit 0' >> $HOME/.profile", {},
                 ["bash -lc 'test -f solved.txt'"]),
    # ~/.npmrc: script-shell is what `npm test` runs the test script with.
    "npmrc": ("printf '#!/bin/sh\\nexit 0\\n' > $HOME/yes.sh && chmod +x $HOME/yes.sh && "
              "echo script-shell=$HOME/yes.sh > $HOME/.npmrc",
              {"package.json": json.dumps({"name": "t", "version": "1.0.0", "scripts": {"test": "test -f solved.txt"}})},
              ["npm test --silent --offline"]),
    # pip's user config: the verifier's `pip install checker` gets the agent's package.
    "pip-config": (FAKE_CHECKER_WHEEL, {},
                   ["python3 -m pip install -q checker 2>/dev/null; python3 -m checker"]),
    # /tmp and ~/.cache: a verifier that keeps state in a fixed place.
    "tmp": ("echo PASS > ${TMPDIR:-/tmp}/verdict; mkdir -p $HOME/.cache && echo PASS > $HOME/.cache/verdict",
            {}, ["test -f solved.txt && echo PASS > ${TMPDIR:-/tmp}/verdict; "
                 "grep -qs PASS ${TMPDIR:-/tmp}/verdict || grep -qs PASS $HOME/.cache/verdict"]),
}


# What each attack's verify needs in the sandbox's userland (the podman image is minimal).
NEEDS = {"usercustomize": "command -v python3", "pth": "command -v python3", "git-fsmonitor": "command -v git",
         "shell-rc": "command -v bash", "npmrc": "command -v npm", "pip-config": "python3 -m pip --version",
         "tmp": "true"}


def _config(backend: str, needs: str = "true") -> PiConfig:
    """The backend's config; skips when its userland lacks what `needs` (a shell check) runs."""
    from pi_env.sandbox import SandboxSpec

    made = registered(backend)()  # skips (or fails, where CI requires it) a backend that cannot run here
    with made.create(SandboxSpec()) as sandbox:
        if sandbox.exec(needs, timeout_s=60).exit_code != 0:
            pytest.skip(f"the {backend} backend's userland fails `{needs}`")
    return PiConfig(sandbox={"backend": backend})


@pytest.mark.parametrize("backend", ["local", "podman"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hook_planted_outside_the_work_dir_never_scores_an_unsolved_task(attack, backend):
    config = _config(backend, NEEDS[attack])
    steps, verify_files, verify = ATTACKS[attack]
    task = PiTask(task_id=f"hook-{attack}", instruction="solve it", verify=verify, verify_files=verify_files,
                  solution=[{"tool": "bash", "command": steps + " && echo planted"}])
    result = run_rollout(task, config)
    assert result.error_kind is None, (result.error, result.agent_log_tail)
    assert "planted" in json.dumps(result.messages), "the attack did not run: the test proves nothing"
    assert result.reward == 0.0, [(r.cmd, r.exit_code, r.stdout[-300:], r.stderr[-300:]) for r in result.verify_results]


def test_setup_made_home_state_survives_into_verify():
    """What setup put in the home (a user-site package, a git identity) is the task's, and verify
    still has it: only the agent's changes are undone."""
    task = PiTask(task_id="setup-home", instruction="x",
                  setup=[f"d={USER_SITE}; mkdir -p $d && echo 'VALUE = 42' > $d/setupmod.py",
                         "git config --global user.name setup-user", "echo 'export FROM_SETUP=1' > $HOME/.profile"],
                  verify=["python3 -c 'import setupmod; assert setupmod.VALUE == 42'",
                          "test \"$(git config --global user.name)\" = setup-user",
                          "bash -lc 'test \"$FROM_SETUP\" = 1'", "test -f solved.txt"],
                  solution=[{"tool": "bash", "command": "git config --global user.name agent && "
                                                        f"echo 'VALUE = 0' > {USER_SITE}/setupmod.py && "
                                                        "echo 'exit 0' >> $HOME/.profile && touch solved.txt"}])
    result = run_rollout(task)
    assert result.error_kind is None, result.error
    assert [r.exit_code for r in result.verify_results] == [0, 0, 0, 0], result.verify_results
    assert result.reward == 1.0


def test_unmodified_harbor_csv_total_verifier_with_a_wrong_answer_scores_zero(tmp_path):
    """The Harbor example's own verifier (python3 /tests/test_total.py), a wrong total.py, and a
    usercustomize.py that forces every python3 to exit 0."""
    source = Path(__file__).parent.parent / "examples" / "harbor" / "csv-total"
    task_dir = tmp_path / "csv-total"
    shutil.copytree(source, task_dir)
    (task_dir / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nprintf 'print(0)\\n' > /app/total.py\n"
        f"d={USER_SITE}; mkdir -p $d && echo '{EXIT_0_AT_EXIT}' > $d/usercustomize.py\n")
    [task] = load_tasks(task_dir)
    result = run_rollout(task)
    assert result.error_kind is None, (result.error, result.agent_log_tail)
    assert result.reward == 0.0, [(r.stdout[-500:], r.stderr[-300:]) for r in result.verify_results]


def _remote_backend(name: str):
    """The hf or e2b backend, through its real SDK, against its loopback stand-in (where the agent
    is root of the sandbox as on the real services), with the host gateway reachable by URL."""
    from pi_env.proxy.gateway import get_gateway
    from pi_env.sandbox.remote import Retrying

    if not shutil.which("nsenter"):
        pytest.skip("the loopback stand-ins need nsenter")
    url = get_gateway().tcp_base_url.removesuffix("/v1")
    if name == "hf":
        hub = pytest.importorskip("huggingface_hub")
        pytest.importorskip("huggingface_hub._sandbox")
        from pi_env.sandbox.hf import HfSandboxBackend, transient
        from pi_env.testing.fake_hf_sandbox import FakeHfJobs

        service = FakeHfJobs().__enter__()
        patch = pytest.MonkeyPatch()
        patch.setattr(hub.constants, "ENDPOINT", service.endpoint)
        backend = HfSandboxBackend(token="hf_pi_env_fake", namespace="pi-env-test", gateway_url=url,
                                   retrying=Retrying(transient, attempts=4, base_s=0.05, cap_s=0.2))
        return backend, service, patch.undo
    pytest.importorskip("e2b")
    from pi_env.sandbox.e2b import E2BSandboxBackend, transient
    from pi_env.testing.fake_e2b import FakeE2B

    service = FakeE2B().__enter__()
    backend = E2BSandboxBackend(api_key=service.api_key, api_url=service.url, sandbox_url=service.url,
                                http_version="1.1", gateway_url=url,
                                retrying=Retrying(transient, attempts=4, base_s=0.05, cap_s=0.2))
    return backend, service, lambda: None


@pytest.mark.parametrize("name", ["hf", "e2b"])
def test_remote_verify_runs_in_a_fresh_sandbox_with_only_the_work_dir(name):
    """On a remote service the agent is root of the whole sandbox, so verify runs in a fresh one:
    the task's files, setup again, and the agent's work dir. Hooks in the home and /tmp stay behind."""
    backend, service, undo = _remote_backend(name)
    try:
        attack = (f"d={USER_SITE}; mkdir -p $d && echo '{EXIT_0_AT_EXIT}' > $d/usercustomize.py; "
                  "echo PASS > /tmp/verdict; mkdir -p sub && echo kept > sub/out.txt; ln -s sub/out.txt link")
        task = PiTask(task_id=f"remote-{name}", instruction="solve it", files={"given.txt": "from the task\n"},
                      setup=["echo setup-ran > $HOME/setup-marker"],
                      verify=["python3 check.py", "grep -q PASS /tmp/verdict",
                              "test -f $HOME/setup-marker && test \"$(cat link)\" = kept && grep -q task given.txt"],
                      verify_files={"check.py": HIDDEN_CHECK},
                      solution=[{"tool": "bash", "command": attack}])
        result = run_rollout(task, sandbox_backend=backend)
        assert result.error_kind is None, (result.error, result.agent_log_tail[-2000:])
        assert [r.exit_code != 0 for r in result.verify_results] == [True, True, False], result.verify_results
        assert result.reward == pytest.approx(1 / 3)
        assert result.files["sub/out.txt"] == "kept\n"
        assert service.running() == []  # both sandboxes deleted
        if name == "e2b":  # egress per phase: none at create; setup open, agent only the gateway, verify none
            from e2b import ALL_TRAFFIC

            (agent_box, agent_rules), (verify_box, verify_rules) = service.networks.items()
            assert all(service.requests[box]["network"]["denyOut"] == [ALL_TRAFFIC] for box in (agent_box, verify_box))
            # setup open; pi-env's own record of setup's files none; the agent only the gateway
            assert agent_rules == [{}, {"denyOut": [ALL_TRAFFIC]}, {"allowOut": ["127.0.0.1"], "denyOut": [ALL_TRAFFIC]}]
            assert verify_rules == [{}, {"denyOut": [ALL_TRAFFIC]}]
    finally:
        undo()
        service.close()


# Every python3 ends by writing a 1.0 reward file (Harbor's verifier scripts run python3).
FORGE_HARBOR_REWARD = ("import atexit, os; atexit.register(lambda: os.path.isdir('/root/logs/verifier') and "
                       "open('/root/logs/verifier/reward.txt', 'w').close() is None and "
                       "open('/root/logs/verifier/reward.txt', 'a').write('1.0'))")


@pytest.mark.parametrize("backend", ["local", "podman"])
def test_each_step_of_a_multi_step_harbor_task_verifies_in_a_clean_world(tmp_path, backend):
    """examples/harbor/text-tool (two [[steps]], each with its own verifier). Step one solves its
    part and plants a usercustomize.py that makes every python3 write a 1.0 reward file; step two
    answers wrong. Each step's verify runs in setup's world, while step two's agent still finds
    its own home as step one left it (a Harbor task's steps share one container)."""
    config = _config(backend)
    task_dir = tmp_path / "text-tool"
    shutil.copytree(Path(__file__).parent.parent / "examples" / "harbor" / "text-tool", task_dir)
    if backend == "podman":  # no image registry here: the locally built base image
        dockerfile = task_dir / "environment" / "Dockerfile"
        dockerfile.write_text(re.sub(r"(?m)^FROM \S+", "FROM localhost/pi-env-base:bookworm", dockerfile.read_text()))
    steps = task_dir / "steps"
    (steps / "lines" / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nprintf 'def count_lines(text):\\n    return len(text.splitlines())\\n' > /app/textstat.py\n"
        f"d={USER_SITE}; mkdir -p $d && echo \"{FORGE_HARBOR_REWARD}\" > $d/usercustomize.py\n"
        "echo step-one > $HOME/.agent-note\n")
    # Step two's count_words is wrong (-1) if its home kept step one's note, right otherwise.
    (steps / "words" / "solution" / "solve.sh").write_text(
        "#!/bin/bash\nif grep -q step-one $HOME/.agent-note; then n=-1; else n='len(text.split())'; fi\n"
        "printf \"def count_words(text):\\n    return $n\\n\" >> /app/textstat.py\n")
    [task] = load_tasks(task_dir)
    result = run_rollout(task, config)
    assert result.error_kind is None, (result.error, result.agent_log_tail[-2000:])
    assert result.step_rewards == [1.0, pytest.approx(1 / 3)], [v.stdout[-500:] for v in result.verify_results]
    assert result.reward == pytest.approx(2 / 3)


@pytest.mark.parametrize("backend", ["local", "podman", "unsafe-local"])
def test_restore_home_puts_back_setups_home_and_keeps_the_agents_output(backend):
    """The sandbox side of it: restore_home() brings back the home as checkpointed, but for the
    work dir and the kept dirs (a kept path through a symlink is an empty dir, never followed);
    the TMPDIR of unsafe-local is emptied; put_back_agent_home() gives the agent its home again."""
    import warnings

    from pi_env.sandbox import SandboxSpec

    made = registered(backend)() if backend != "unsafe-local" else __import__("pi_env.sandbox", fromlist=["x"]) \
        .get_backend("unsafe-local")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # unsafe-local says it is unsafe
        sandbox = made.create(SandboxSpec())
    with sandbox:
        def run(command: str) -> str:
            outcome = sandbox.exec(command, timeout_s=60)
            assert outcome.exit_code == 0, (command, outcome.stderr)
            return outcome.stdout

        run("mkdir -p ~/.config && echo setup > ~/.config/x && echo 'export A=setup' > ~/.profile")
        sandbox.checkpoint_home()
        run("echo agent > ~/.config/x && echo evil > ~/.bashrc && mkdir -p ~/logs/agent ~/.local/lib "
            "&& echo log > ~/logs/agent/l && echo out > out.txt && echo tmp > ${TMPDIR:-/tmp}/t "
            "&& head -c 4M /dev/urandom > ~/big")
        sandbox.restore_home(("logs/agent",), set_aside=True)
        assert run("cat ~/.config/x; ls -A ~; cat out.txt ~/logs/agent/l; cat ${TMPDIR:-/tmp}/t 2>&1 || true") \
            .split("\n")[:8] == ["setup", ".config", ".pi-env-agent-home", ".profile", "logs", "workdir", "out", "log"]
        # The agent's home was set aside inside the sandbox's home, never copied to the host's disk.
        outside = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(sandbox.host_dir)
                      if not d.startswith(sandbox.host_home) for f in files)
        assert outside < 1 << 20, outside
        run("echo verify > ~/.config/x && rm -r ~/logs/agent && echo verdict > verdict.txt")
        sandbox.put_back_agent_home()
        assert run("cat ~/.config/x ~/.bashrc verdict.txt; test -d ~/.local/lib && ls -A ~/logs/agent && echo ok") \
            == "agent\nevil\nverdict\nok\n"
        # A kept dir reached through a symlink the agent planted: never followed, an empty dir.
        run("rm -rf ~/logs && mkdir -p ~/elsewhere/agent && echo x > ~/elsewhere/agent/f && ln -s elsewhere ~/logs")
        sandbox.restore_home(("logs/agent",))
        assert run("test ! -L ~/logs && ls -A ~/logs/agent; test ! -e ~/elsewhere && echo gone") == "gone\n"


def test_an_agent_that_fills_its_capped_home_is_still_verified_and_scored():
    """The agent deletes what setup left in the home and fills the freed space with its work dir,
    so setup's home no longer fits back in: verify still runs (with less of setup's world, never
    with the agent's) and the rollout is scored, not unscored."""
    from pi_env.sandbox.totals import host_totals

    if not host_totals().disk:
        pytest.skip("this host cannot cap a sandbox home (needs root for a tmpfs home)")
    task = PiTask(task_id="fill-home", instruction="x", setup=["head -c 8M /dev/zero > $HOME/.setup-blob"],
                  verify=["test -f solved.txt"],
                  solution=[{"tool": "bash", "command": "rm $HOME/.setup-blob; head -c 64M /dev/zero > fill; echo filled"}])
    result = run_rollout(task, PiConfig(limits={"max_disk_bytes": 32 << 20}))
    assert result.error_kind is None, (result.error, result.agent_log_tail[-2000:])
    assert result.reward == 0.0 and [r.exit_code for r in result.verify_results] == [1]
    assert "setup's home was restored only in part" in result.agent_log_tail


def test_an_exported_work_dir_keeps_only_members_that_stay_inside_it():
    """On hf/e2b the agent was root of the machine that made the archive (it may have replaced tar):
    what reaches verify's fresh sandbox is rebuilt host-side from members that extract inside the
    work dir only."""
    import io
    import tarfile

    from pi_env.sandbox.remote import _safe_tree

    hostile = io.BytesIO()
    with tarfile.open(fileobj=hostile, mode="w") as tar:
        def add(name, kind=tarfile.REGTYPE, link="", mode=0o644, data=b"x"):
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode, info.size = kind, link, mode, len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("./out.txt")
        add("./site", tarfile.SYMTYPE, "/root/.local/lib/python3.11/site-packages")
        add("./site/usercustomize.py")  # through the symlink just made
        add("../.bashrc")
        add("/root/.gitconfig")
        add("./dev", tarfile.CHRTYPE)
        add("./fifo", tarfile.FIFOTYPE)
        add("./suid", mode=0o4755)
        add("./hard", tarfile.LNKTYPE, "../../etc/passwd")
        add("./ok-link", tarfile.LNKTYPE, "out.txt")
    with tarfile.open(fileobj=io.BytesIO(_safe_tree(hostile.getvalue()))) as clean:
        members = {m.name: m for m in clean.getmembers()}
    assert sorted(members) == ["ok-link", "out.txt", "site", "suid"]
    assert members["site"].issym() and members["suid"].mode == 0o755
    assert members["ok-link"].islnk() and members["ok-link"].linkname == "out.txt"
    with tarfile.open(fileobj=io.BytesIO(_safe_tree(b""))) as empty:
        assert empty.getmembers() == []


FILL_HOME = ("head -c 256M /dev/zero > fill 2>/dev/null; python3 -c \"\n"
             "import os\nos.makedirs('many', exist_ok=True)\ni = 0\nwhile True:\n"
             "    try: open(f'many/{i}', 'w').close()\n    except OSError: break\n    i += 1\nprint('files', i)\"")


def test_agent_code_that_fills_the_home_during_verify_is_a_zero_never_unscored():
    """The agent's program, run by the first verify command, uses up the home's inodes: staging
    the next command's room fails. What an earlier command's agent code did is the agent's: the
    rollout scores 0.0 with the reason (it used to be an unscored `infra`, which collect retries)."""
    from pi_env.sandbox.totals import host_totals

    if not host_totals().disk:
        pytest.skip("this host cannot cap a sandbox home (needs root for a tmpfs home)")
    # (the hidden files' inodes freed first, so staging them again needs inodes the fill took)
    fill = ("import os, shutil\nos.remove('check.py')\nshutil.rmtree('more')\nos.makedirs('many', exist_ok=True)\n"
            "i = 0\nwhile True:\n"
            "    try: open(f'many/{i}', 'w').close()\n    except OSError: break\n    i += 1\nprint('files', i)\n")
    task = PiTask(task_id="fill-in-verify", instruction="x", limits={"storage_mb": 32},
                  verify_files={"check.py": "import sys\nsys.exit(1)\n", "more/data.txt": "x" * 4096},
                  verify=["python3 solution.py", "python3 check.py"],
                  solution=[{"tool": "write", "path": "solution.py", "content": fill}])
    result = run_rollout(task)
    assert "files" in result.verify_results[0].stdout, "the home was not filled: the test proves nothing"
    assert result.error_kind is None, (result.error, result.verify_notes)
    assert result.reward == 0.0 and any("room could not be made before command 2" in note
                                        for note in result.verify_notes), result.verify_notes


@pytest.mark.parametrize("solved", [False, True])
def test_an_agent_that_uses_up_its_homes_blocks_and_inodes_is_still_verified(solved):
    """A disk total below the memory total: the agent fills its home to the last byte and inode.
    The hidden verify files (100 KiB) and the verifier's dir still get their room (kept for verify,
    out of the agent's reach): the rollout is scored as what the agent did, never unscored."""
    from pi_env.sandbox.totals import host_totals

    if not host_totals().disk:
        pytest.skip("this host cannot cap a sandbox home (needs root for a tmpfs home)")
    task = PiTask(task_id="fill-all", instruction="x", limits={"storage_mb": 32},
                  verify_files={"check.py": "# " + "x" * (100 << 10) + "\nimport os, sys\n"
                                "sys.exit(0 if os.path.exists('solved.txt') else 1)\n"},
                  verify=["python3 check.py"],
                  solution=[{"tool": "bash", "command": ("touch solved.txt; " if solved else "") + FILL_HOME}])
    result = run_rollout(task)
    assert "files" in json.dumps(result.messages), "the home was not filled: the test proves nothing"
    assert result.error_kind is None, (result.error, result.agent_log_tail[-2000:])
    assert result.reward == (1.0 if solved else 0.0), result.verify_results
