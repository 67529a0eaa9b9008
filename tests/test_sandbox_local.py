"""The local (bubblewrap) and unsafe-local sandbox backends, against the real bwrap: isolation
and what is specific to them (the backend-independent contract is test_sandbox_contract.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import threading
import time

import pytest
from helpers import missing_feature

from pi_env.sandbox import (
    SandboxError,
    SandboxLimits,
    SandboxSpec,
    SandboxUnavailable,
    get_backend,
)
from pi_env.sandbox.local import LocalSandboxBackend
from pi_env.sandbox.unsafe_local import UnsafeLocalBackend

IS_ROOT = os.geteuid() == 0  # CI runs as root: each sandbox then has a uid of its own
TAG = f"{os.getpid() % 1000:03d}"  # in commands, so a non-root run finds only this run's leftovers


@pytest.fixture(scope="module")
def backend() -> LocalSandboxBackend:
    try:
        return LocalSandboxBackend()
    except SandboxUnavailable as exc:
        missing_feature(f"bubblewrap unusable here: {exc}")


@pytest.fixture
def sandbox(backend):
    with backend.create(SandboxSpec()) as sb:
        yield sb


def left_running(sandbox, marker: str) -> list[str]:
    """What the sandbox left running: as root, every process of its uid; otherwise (the sandbox
    runs as our own uid) our processes whose command line holds `marker`."""
    if IS_ROOT:
        return processes_of(sandbox.uid)
    return [cmd for cmd in processes_of(os.getuid()) if marker in cmd]


def processes_of(uid: int) -> list[str]:
    """Processes (zombies included: they still count against RLIMIT_NPROC) of real uid `uid`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid:
            found.append(f"{pid} {status['State'].strip()}: {cmdline}")
    return found


# --- commands -----------------------------------------------------------------------------


def test_exec_runs_in_workdir_with_a_clean_environment(backend, monkeypatch):
    monkeypatch.setenv("PI_ENV_FAKE_SECRET", "hunter2")
    with backend.create(SandboxSpec(env={"FROM_SPEC": "spec"})) as sb:
        result = sb.exec("echo hello; pwd; env; exit 3", env={"FROM_CALL": "call"})
        assert result.exit_code == 3 and not result.timed_out
        lines = result.stdout.splitlines()
        assert lines[:2] == ["hello", "/root/workdir"]
        assert "HOME=/root" in lines and "USER=root" in lines and "LANG=C.UTF-8" in lines
        assert "FROM_SPEC=spec" in lines and "FROM_CALL=call" in lines
        assert "hunter2" not in result.stdout

        assert sb.exec(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"
        assert sb.exec("cat", stdin=b"from stdin").stdout == "from stdin"
        # Reopening the pipes by path needs them to belong to the sandbox uid.
        result = sb.exec("cat /dev/stdin > /dev/stdout; echo err > /dev/stderr", stdin=b"in")
        assert (result.exit_code, result.stdout, result.stderr) == (0, "in", "err\n")
        assert sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
        sb.exec("mkdir sub")
        assert sb.exec("pwd", cwd="sub").stdout == "/root/workdir/sub\n"
        assert sb.exec("echo oops >&2; false").stderr == "oops\n"
        assert sb.exec("id -u; hostname").stdout == "0\npi-env\n"
        # The command is not the pid namespace's init (which ignores such signals).
        assert sb.exec(["sh", "-c", "kill -TERM $$; echo survived"]).exit_code == 128 + 15
        assert sb.exec("sh -c 'kill -TERM $$; echo survived'").exit_code == 128 + 15


def test_host_secrets_are_invisible(sandbox):
    with tempfile.TemporaryDirectory() as host_tmp:
        secret = os.path.join(host_tmp, "secret.txt")
        with open(secret, "w") as f:
            f.write("TOP-SECRET")
        paths = [secret, "/etc/shadow", "/etc/sudoers", os.path.expanduser("~/.bash_history")]
        if IS_ROOT:
            root_secret = f"/root/.pi-env-test-secret-{os.getpid()}"
            with open(root_secret, "w") as f:
                f.write("TOP-SECRET")
            paths.append(root_secret)
        try:
            result = sandbox.exec(
                " ; ".join(f"cat {p}" for p in paths) + f"; ls -a {host_tmp} /root"
            )
        finally:
            if IS_ROOT:
                os.unlink(root_secret)
    assert "TOP-SECRET" not in result.stdout
    assert result.stderr.count("No such file or directory") == len(paths) + 1  # + the ls
    assert ".pi-env-test-secret" not in result.stdout


def test_sandboxes_do_not_see_each_other(backend):
    with backend.create(SandboxSpec()) as a, backend.create(SandboxSpec()) as b:
        a.write_file("mine.txt", "A's data")
        assert a.exec("cat /root/workdir/mine.txt").stdout == "A's data"
        result = b.exec(
            f"cat /root/workdir/mine.txt {a.host_home}/workdir/mine.txt; ls {a.host_dir}"
        )
        assert "A's data" not in result.stdout and result.exit_code != 0
        if IS_ROOT:
            assert a.uid != b.uid


def test_only_home_tmp_and_shm_are_writable(sandbox):
    for path in ("/etc/x", "/usr/x", "/x", "/opt/x", "/proc/x", "/dev/x", "/etc/passwd"):
        assert sandbox.exec(f"echo x > {path}").exit_code != 0, path
    assert sandbox.exec("echo x > /tmp/x && echo x > /root/x && echo x > /dev/shm/x").exit_code == 0
    assert sandbox.exists("/root/x")
    assert sandbox.exec("cat /tmp/x").exit_code != 0  # /tmp is private to each command


def test_no_capabilities(sandbox):
    status = sandbox.exec("cat /proc/self/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, cap
    assert fields["NoNewPrivs"].strip() == "1"


# --- limits and killing -------------------------------------------------------------------


def test_fork_bomb_is_bounded_and_fully_killed(backend):
    with backend.create(SandboxSpec(limits=SandboxLimits(max_processes=64))) as sb:
        started = time.monotonic()
        # The trailing sleep keeps the namespace's init alive; its exit would end the bomb.
        result = sb.exec(f":(){{ :|:& }};:; sleep 100.{TAG}", timeout_s=2)
        assert result.timed_out and result.exit_code is None
        assert "Resource temporarily unavailable" in result.stderr  # RLIMIT_NPROC bit
        assert time.monotonic() - started < 15
        assert left_running(sb, ":(){") == []
        assert sb.exec("echo alive").stdout == "alive\n"  # the sandbox is still usable


def test_timeout_kills_setsid_and_nohup_escapes(sandbox):
    result = sandbox.exec(
        f"setsid sleep 1000.{TAG} & nohup sleep 1001.{TAG} >/dev/null 2>&1 & (sleep 1002.{TAG} &);"
        f" echo up; sleep 1003.{TAG}",
        timeout_s=1,
    )
    assert result.timed_out and result.exit_code is None and result.stdout == "up\n"
    assert 1 <= result.duration_s < 6
    assert left_running(sandbox, f".{TAG}") == []


def test_daemons_die_with_their_command(sandbox):
    result = sandbox.exec(f"setsid sleep 1004.{TAG} >/dev/null 2>&1 & echo started", timeout_s=10)
    assert result.exit_code == 0 and result.duration_s < 5
    assert left_running(sandbox, f"sleep 1004.{TAG}") == []


def test_start_wait_poll_and_kill(sandbox):
    sandbox.write_file("input.txt", "line one\nline two\n")
    echo = sandbox.start("cat; echo done >&2", stdin_path="input.txt")
    result = echo.wait(10)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "line one\nline two\n", "done\n")

    sleeper = sandbox.start("echo ready; sleep 100")
    assert sleeper.poll() is None
    result = sleeper.wait(0.5)
    assert result.timed_out and result.exit_code is None and result.stdout == "ready\n"
    assert sleeper.poll() is not None
    sleeper.kill()
    sleeper.kill()  # idempotent

    # Started from a thread that ends at once: the command must not die with that thread.
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("p", sandbox.start(f"sleep 100.{TAG}")))
    thread.start()
    thread.join()
    time.sleep(0.3)
    assert box["p"].poll() is None
    sandbox.kill_all()
    assert box["p"].wait(5).exit_code is None and box["p"].poll() is not None
    assert left_running(sandbox, f"sleep 100.{TAG}") == []


def test_resource_limits_apply(backend):
    limits = SandboxLimits(max_file_bytes=1 << 20, max_open_files=100, max_memory_bytes=1 << 30)
    with backend.create(SandboxSpec(limits=limits)) as sb:
        result = sb.exec("ulimit -n; ulimit -c; ulimit -d; head -c 2000000 /dev/zero > big")
        assert result.stdout.split() == ["100", "0", str((1 << 30) // 1024)]
        assert (
            result.exit_code != 0
            and os.path.getsize(os.path.join(sb.host_home, "workdir/big")) == 1 << 20
        )


# --- files --------------------------------------------------------------------------------


def test_files_the_host_writes_belong_to_the_sandbox_uid(sandbox):
    """(The file API itself is in the contract suite.)"""
    sandbox.write_file("deep/er/nested.bin", bytes(range(256)), mode=0o600)
    host_file = os.path.join(sandbox.host_home, "workdir/deep/er/nested.bin")
    assert stat.S_IMODE(os.stat(host_file).st_mode) == 0o600
    if IS_ROOT:
        assert os.stat(host_file).st_uid == sandbox.uid
        assert os.stat(os.path.dirname(host_file)).st_uid == sandbox.uid
    assert sandbox.exec("echo more >> deep/er/nested.bin").exit_code == 0  # so it can write it


def test_symlinks_planted_by_the_sandbox_are_never_followed(sandbox):
    pwned = f"pwned-{os.getpid()}"
    with tempfile.TemporaryDirectory() as host_dir:
        try:
            # Links to sandbox paths, and to a host path that only the host could resolve.
            sandbox.exec(
                f"ln -s /etc evil; ln -s {host_dir} hostdir; ln -s /etc/passwd passwd_link;"
                " mkfifo fifo"
            )
            with pytest.raises(FileNotFoundError):
                sandbox.read_file("evil/passwd")
            with pytest.raises(FileNotFoundError):
                sandbox.read_file("passwd_link")
            with pytest.raises(FileNotFoundError):
                sandbox.read_file("fifo")  # and it did not hang waiting for a writer
            assert not sandbox.exists("evil") and not sandbox.exists("evil/passwd")
            assert sandbox.snapshot(".") == {}
            # Writing through a planted link replaces the link with a real directory.
            sandbox.write_file(f"evil/{pwned}", "x")
            sandbox.write_file(f"hostdir/sub/{pwned}", "x")
            assert os.listdir(host_dir) == [] and not os.path.exists(f"/etc/{pwned}")
            assert sandbox.exec(f"test ! -L evil && cat evil/{pwned} hostdir/sub/{pwned}").stdout == "xx"
        finally:  # should the defence fail, do not leave the host polluted
            if os.path.exists(f"/etc/{pwned}"):
                os.unlink(f"/etc/{pwned}")

        with open("/etc/passwd", "rb") as f:
            host_passwd = f.read()
        sandbox.write_file("passwd_link", "replaced the link, not its target")
        with open("/etc/passwd", "rb") as f:
            assert f.read() == host_passwd
        assert stat.S_ISREG(
            os.lstat(os.path.join(sandbox.host_home, "workdir/passwd_link")).st_mode
        )

        sandbox.remove("evil")  # removes the link only
        assert os.path.isdir("/etc/ssl") and not os.path.lexists(
            os.path.join(sandbox.host_home, "workdir/evil")
        )
        sandbox.remove("hostdir")
        assert os.path.isdir(host_dir)


def test_ro_mounts(backend):
    outer = tempfile.mkdtemp(prefix="pi-env-rt-")  # not tmp_path: pytest makes its parents 0o700
    try:
        runtime = os.path.join(outer, "runtime")
        os.mkdir(runtime)
        with open(os.path.join(runtime, "tool.sh"), "w") as f:
            f.write("echo from-runtime")
        os.chmod(outer, 0o755)
        os.chmod(runtime, 0o755)
        os.chmod(os.path.join(runtime, "tool.sh"), 0o644)
        with backend.create(SandboxSpec(ro_mounts={"/opt/pi-env/rt": runtime})) as sb:
            assert sb.exec("sh /opt/pi-env/rt/tool.sh").stdout == "from-runtime\n"
            assert sb.exec("touch /opt/pi-env/rt/x").exit_code != 0
        if IS_ROOT:
            os.chmod(outer, 0o700)  # now the sandbox uids cannot reach it:
            with pytest.raises(SandboxError, match=f"{outer} lacks o\\+x"):  # a tree is refused,
                backend.create(SandboxSpec(ro_mounts={"/opt/x": runtime}))
            spec = SandboxSpec(ro_mounts={"/opt/tool.sh": f"{runtime}/tool.sh"})
            with backend.create(spec) as sb:  # a single file is bound from a copy
                assert sb.exec("sh /opt/tool.sh").stdout == "from-runtime\n"
    finally:
        shutil.rmtree(outer)


# --- lifecycle ----------------------------------------------------------------------------


def test_close_deletes_everything_and_is_idempotent(backend):
    sb = backend.create(SandboxSpec())
    sb.exec("mkdir -p a/b && touch a/b/f && chmod 500 a/b a")
    process = sb.start("sleep 100")
    sb.close()
    sb.close()
    assert process.poll() is not None and not os.path.exists(sb.host_dir)
    with pytest.raises(SandboxError, match="closed"):
        sb.exec("true")
    if IS_ROOT:
        assert processes_of(sb.uid) == []
        with open(f"/run/lock/pi-env-uids/{sb.uid}", "a") as lock:  # the uid is free again
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


SANDBOX_OWNER = """
import sys, time
from pi_env.sandbox import SandboxSpec, get_backend
from pi_env.sandbox.local import LocalSandboxBackend
sandbox = LocalSandboxBackend(sys.argv[1]).create(SandboxSpec())
sandbox.start("sleep 300")
print(sandbox.host_dir, sandbox.uid, flush=True)
time.sleep(300)
"""


def test_sandboxes_of_a_killed_owner_are_swept_and_live_ones_kept(monkeypatch):
    """A process SIGKILLed with a sandbox open leaves its dir behind; the next backend on that
    root deletes it (and kills what still ran as its uid), and never touches a live one."""
    import subprocess
    import sys

    from pi_env.sandbox import owned_dirs

    outer = tempfile.mkdtemp(prefix="pi-env-sweep-")  # not tmp_path: pytest makes its parents 0o700
    os.chmod(outer, 0o711)
    root = os.path.join(outer, "root")
    owner = subprocess.Popen([sys.executable, "-c", SANDBOX_OWNER, root], stdout=subprocess.PIPE, text=True)
    try:
        host_dir, uid = owner.stdout.readline().split()
    finally:
        owner.kill()  # SIGKILL: no close(), no cleanup
        owner.wait()
    assert os.path.isdir(host_dir) and os.path.exists(host_dir + ".lock")
    live = LocalSandboxBackend(root).create(SandboxSpec())
    try:
        assert os.path.isdir(host_dir)  # a free lock younger than STALE_LOCK_AGE_S is left alone
        monkeypatch.setattr(owned_dirs, "STALE_LOCK_AGE_S", 0.0)
        LocalSandboxBackend(root)
        assert not os.path.exists(host_dir) and not os.path.exists(host_dir + ".lock")
        assert os.path.isdir(live.host_dir) and live.exec("echo alive").stdout == "alive\n"
        if IS_ROOT:  # zombies may stay until init reaps the dead owner's orphans; nothing runs
            assert [p for p in processes_of(int(uid)) if " Z " not in p] == []
        # A lock-less dir of an older pi-env is swept only once it is a day old.
        legacy = os.path.join(root, "sb-legacy")
        os.mkdir(legacy)
        LocalSandboxBackend(root)
        assert os.path.isdir(legacy)
        os.utime(legacy, (time.time() - 2 * 86400,) * 2)
        LocalSandboxBackend(root)
        assert not os.path.exists(legacy) and os.path.isdir(live.host_dir)
    finally:
        live.close()
    assert os.listdir(root) == []
    shutil.rmtree(outer)


@pytest.mark.skipif(not IS_ROOT, reason="mounting a size-capped home needs root")
def test_a_stale_sandbox_with_its_capped_home_still_mounted_is_swept(monkeypatch):
    """A dead owner's dir whose size-capped home tmpfs is still mounted (with another tmpfs
    stacked on it and one inside the work dir): rmdir of a mount point is EBUSY, so the sweep
    detaches every mount under the dir first; nothing is left mounted or on disk."""
    from pi_env.sandbox import owned_dirs
    from pi_env.sandbox.totals import host_totals, mount_capped_home, mount_points_under

    if not host_totals().disk:
        pytest.skip(f"no size-capped homes here: {host_totals().why_not}")
    outer = tempfile.mkdtemp(prefix="pi-env-sweep-mounted-")
    os.chmod(outer, 0o711)
    root = os.path.join(outer, "root")
    os.mkdir(root, 0o711)
    try:
        host_dir, lock_fd = owned_dirs.make_host_dir(root, None, disk_bytes=1 << 20)
        home = os.path.join(host_dir, "home")
        mount_capped_home(home, 1 << 20, None)  # stacked on the capped home
        os.mkdir(os.path.join(home, "workdir"))
        mount_capped_home(os.path.join(home, "workdir"), 1 << 20, None)
        with open(os.path.join(home, "workdir", "f"), "w") as f:
            f.write("x")
        os.close(lock_fd)  # the owner dies: no discard, its lock is free
        assert len(mount_points_under(host_dir)) == 3
        monkeypatch.setattr(owned_dirs, "STALE_LOCK_AGE_S", 0.0)
        assert owned_dirs.sweep_stale_host_dirs(root) == [host_dir]
        assert os.listdir(root) == [] and mount_points_under(outer) == []
    finally:
        from pi_env.sandbox.totals import unmount_all

        unmount_all(outer)
        shutil.rmtree(outer)


def test_concurrent_sandboxes_from_threads(backend):
    def run(i: int) -> tuple[int, str]:
        with backend.create(SandboxSpec()) as sb:
            sb.write_file("n.txt", str(i))
            return sb.uid, sb.exec("cat n.txt; sleep 0.2").stdout

    results: list = [None] * 6
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, run(i))) for i in range(6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [out for _, out in results] == [str(i) for i in range(6)]
    if IS_ROOT:
        assert len({uid for uid, _ in results}) == 6


def test_missing_bwrap_explains_how_to_fix_it():
    with pytest.raises(SandboxUnavailable) as info:
        LocalSandboxBackend(bwrap="/nonexistent/bwrap")
    message = str(info.value)
    assert "apt-get install bubblewrap" in message and "dnf install bubblewrap" in message
    assert "unsafe-local" in message


def test_registry():
    assert get_backend("unsafe-local").name == "unsafe-local"
    with pytest.raises(ValueError, match=r"known: .*\blocal\b.*unsafe-local"):
        get_backend("docker-please")


# --- unsafe-local -------------------------------------------------------------------------


def test_unsafe_local_maps_paths_without_isolation(monkeypatch):
    monkeypatch.setenv("PI_ENV_FAKE_SECRET", "hunter2")
    with pytest.warns(RuntimeWarning, match="no file, network or process isolation"):
        sb = UnsafeLocalBackend().create(SandboxSpec(env={"FROM_SPEC": "spec"}))
    with sb:
        result = sb.exec('pwd; echo "$HOME" "$FROM_SPEC" "$PI_ENV_FAKE_SECRET"; exit 4')
        assert result.exit_code == 4
        assert result.stdout == f"{sb.host_home}/workdir\n{sb.host_home} spec \n"
        sb.write_file("sub/f.txt", "data")
        assert sb.exec("cat sub/f.txt").stdout == "data"
        assert sb.exec("cat f.txt", cwd="/root/workdir/sub").stdout == "data"
        assert sb.read_file("/root/workdir/sub/f.txt") == b"data"
        assert sb.host_path("sub/f.txt") == f"{sb.host_home}/workdir/sub/f.txt"
        assert sb.exec("sleep 10", timeout_s=0.3).timed_out
        with tempfile.TemporaryDirectory() as outside:
            sb.exec(f"ln -s {outside} tmplink")
            sb.write_file("tmplink/pwned", "x")  # replaces the link, never follows it
            assert os.listdir(outside) == [] and sb.exec("test ! -L tmplink && cat tmplink/pwned").stdout == "x"
    assert not os.path.exists(sb.host_dir)
