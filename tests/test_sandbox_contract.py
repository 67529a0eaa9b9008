"""The contract every sandbox backend must pass (see base.py), run against every backend of
tests/sandbox_backends.py that can run here for real. Backend-specific isolation tests live
next to each backend (test_sandbox_local.py, test_sandbox_podman.py, ...).

Only the protocol is used: no host_dir, uid or other backend internals. "Nothing is left
running" is observed the way any backend allows: a killed command stops touching a heartbeat
file in the sandbox home.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from helpers import wait_for
from sandbox_backends import BACKENDS, BackendEntry

from pi_env.sandbox import GATEWAY_SOCKET, SandboxError, SandboxLimits, SandboxSpec

HEARTBEAT = "while :; do date +%s%N > {path}; sleep 0.1; done"


@pytest.fixture(scope="module", params=BACKENDS, ids=[entry.name for entry in BACKENDS])
def entry(request) -> BackendEntry:
    return request.param


@pytest.fixture(scope="module")
def backend(entry):
    return entry.make()


@pytest.fixture
def sandbox(backend):
    sb = backend.create(SandboxSpec())
    try:
        yield sb
    finally:
        sb.close()


def need(entry: BackendEntry, feature: str) -> None:
    if feature not in entry.features:
        pytest.skip(f"backend {entry.name!r} does not exercise {feature!r} here")


def assert_stopped(sandbox, path: str) -> None:
    """The heartbeat command writing `path` is dead: the file stops changing."""
    first = sandbox.read_file(path)
    time.sleep(0.6)  # six beats
    assert sandbox.read_file(path) == first, "a killed command is still running"


def wait_for_file(sandbox, path: str, timeout_s: float = 30) -> None:
    wait_for(lambda: sandbox.exists(path), timeout_s, f"{path} to appear")


# --- exec ---------------------------------------------------------------------------------


def test_the_sandbox_offers_a_clean_world_for_verify(sandbox):
    """Verify never runs in the world the agent shaped: a sandbox either puts its home back
    (RestoresHome) or hands the work dir to a fresh one (ExportsTrees); its abilities are
    declared Protocols, checked with isinstance."""
    from pi_env.sandbox.base import ExportsTrees, RestoresHome, Sandbox

    assert isinstance(sandbox, Sandbox)
    assert isinstance(sandbox, RestoresHome) or isinstance(sandbox, ExportsTrees), type(sandbox)


def test_exec_exit_code_output_env_and_cwd(backend, monkeypatch):
    monkeypatch.setenv("PI_ENV_FAKE_SECRET", "hunter2")
    with backend.create(SandboxSpec(env={"FROM_SPEC": "spec", "BOTH": "spec"})) as sb:
        assert sb.home == "/root" and sb.workdir == "/root/workdir" and sb.id
        result = sb.exec("echo hello; pwd; env; echo oops >&2; exit 3",
                         env={"FROM_CALL": "call", "BOTH": "call"})
        assert (result.exit_code, result.timed_out) == (3, False)
        lines = result.stdout.splitlines()
        assert lines[:2] == ["hello", "/root/workdir"]
        assert "HOME=/root" in lines and "FROM_SPEC=spec" in lines and "FROM_CALL=call" in lines
        assert "BOTH=call" in lines  # the call's env wins over the spec's
        assert "hunter2" not in result.stdout  # nothing of the host environment
        assert result.stderr == "oops\n" and result.duration_s >= 0

        assert sb.exec(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"  # argv: no shell
        assert sb.exec("cat", stdin=b"from stdin").stdout == "from stdin"
        assert sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sb.exec("mkdir -p sub/dir").exit_code == 0
        assert sb.exec("pwd", cwd="sub/dir").stdout == "/root/workdir/sub/dir\n"
        assert sb.exec("pwd", cwd="/root/workdir/sub").stdout == "/root/workdir/sub\n"
        # A command killed by a signal (it is not a namespace's init, which would ignore it).
        assert sb.exec(["sh", "-c", "kill -TERM $$; echo survived"]).exit_code == 128 + 15
        assert sb.exec("sh -c 'kill -TERM $$; echo survived'").exit_code == 128 + 15
        with pytest.raises(ValueError):
            sb.exec([])


def test_exec_timeout_kills_the_command_and_what_it_started(sandbox):
    started = time.monotonic()
    result = sandbox.exec(
        "(setsid sh -c '" + HEARTBEAT.format(path="/root/beat-setsid") + "' &) ; "
        + HEARTBEAT.format(path="/root/beat") + " & echo up; sleep 1000",
        timeout_s=2,
    )
    assert result.timed_out and result.exit_code is None  # unknown, never success
    assert result.stdout == "up\n" and 2 <= result.duration_s < 20
    assert time.monotonic() - started < 30
    assert_stopped(sandbox, "/root/beat")
    assert_stopped(sandbox, "/root/beat-setsid")
    assert sandbox.exec("echo alive").stdout == "alive\n"  # the sandbox is still usable


def test_output_is_decoded_with_replacement_and_bounded(sandbox):
    assert sandbox.exec(r"printf 'a\377\376b'").stdout == "a\ufffd\ufffdb"
    assert sandbox.exec(r"printf '\377' >&2").stderr == "\ufffd"
    result = sandbox.exec("head -c 50000000 /dev/zero | tr '\\0' x; echo END")
    assert result.exit_code == 0
    assert len(result.stdout) < (1 << 20) + 100  # the tail is kept
    assert result.stdout.startswith("[... ") and "truncated" in result.stdout
    assert result.stdout.endswith("xxxxEND\n")


# --- background commands ------------------------------------------------------------------


def test_start_wait_poll(sandbox):
    sandbox.write_file("input.txt", "line one\nline two\n")
    echo = sandbox.start("cat; echo done >&2; exit 5", stdin_path="input.txt")
    result = echo.wait(60)
    assert (result.exit_code, result.stdout, result.stderr) == (5, "line one\nline two\n", "done\n")
    assert echo.poll() == 5 and echo.wait() == result  # later waits: the same result

    bounded = sandbox.start("head -c 100000 /dev/zero | tr '\\0' y; echo END", output_limit_bytes=1000)
    out = bounded.wait(60).stdout
    assert out.endswith("yyyEND\n") and "truncated" in out and len(out) < 1100


def test_wait_timeout_kills(sandbox):
    sleeper = sandbox.start("echo ready; " + HEARTBEAT.format(path="beat"))
    wait_for_file(sandbox, "beat")
    assert sleeper.poll() is None
    result = sleeper.wait(0.5)
    assert result.timed_out and result.exit_code is None and result.stdout == "ready\n"
    assert sleeper.poll() is not None
    assert_stopped(sandbox, "beat")


def test_kill_is_idempotent_and_leaves_nothing_running(sandbox):
    process = sandbox.start("(" + HEARTBEAT.format(path="beat-child") + ") & "
                            + HEARTBEAT.format(path="beat"))
    wait_for_file(sandbox, "beat")
    wait_for_file(sandbox, "beat-child")
    process.kill()
    process.kill()
    result = process.wait(30)
    assert result.exit_code is None and not result.timed_out and process.poll() is not None
    assert_stopped(sandbox, "beat")
    assert_stopped(sandbox, "beat-child")
    process.kill()  # after the end too


def test_kill_all_stops_every_command_and_the_sandbox_stays_usable(sandbox):
    processes = [sandbox.start(HEARTBEAT.format(path=f"beat-{i}")) for i in range(3)]
    # Started from a thread that ends at once: the command must not die with that thread.
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("p", sandbox.start(HEARTBEAT.format(path="beat-t"))))
    thread.start()
    thread.join()
    for path in ("beat-0", "beat-1", "beat-2", "beat-t"):
        wait_for_file(sandbox, path)
    assert box["p"].poll() is None
    sandbox.kill_all()
    for process in [*processes, box["p"]]:
        assert process.wait(30).exit_code is None
    for path in ("beat-0", "beat-1", "beat-2", "beat-t"):
        assert_stopped(sandbox, path)
    assert sandbox.exec("echo alive").stdout == "alive\n"


# --- files --------------------------------------------------------------------------------


def test_write_read_exists_with_parents(sandbox):
    sandbox.write_file("deep/er/nested.bin", bytes(range(256)), mode=0o600)
    assert sandbox.read_file("/root/workdir/deep/er/nested.bin") == bytes(range(256))
    assert sandbox.read_file("deep/er/nested.bin", max_bytes=3) == b"\0\1\2"
    assert sandbox.exec(
        "stat -c %a deep/er/nested.bin; od -An -tx1 -N4 deep/er/nested.bin"
    ).stdout.split() == ["600", "00", "01", "02", "03"]
    sandbox.write_file("/root/.config/tool.json", "{}")  # anywhere under /root
    assert sandbox.exec("cat ~/.config/tool.json").stdout == "{}"
    sandbox.write_file("deep/er/nested.bin", "replaced")
    assert sandbox.read_file("deep/er/nested.bin") == b"replaced"
    sandbox.exec("printf 'from inside' > made.txt")
    assert sandbox.read_file("made.txt") == b"from inside"

    assert sandbox.exists("deep/er") and sandbox.exists("/root/workdir/made.txt")
    assert not sandbox.exists("nope") and not sandbox.exists("deep/nope/x")


def test_large_files_round_trip(sandbox):
    big = os.urandom(20 << 20)
    sandbox.write_file("big.bin", big)
    assert sandbox.read_file("big.bin") == big
    assert sandbox.exec("wc -c < big.bin").stdout.strip() == str(20 << 20)
    sandbox.exec("head -c 30000000 /dev/zero > made.bin")
    assert sandbox.read_file("made.bin") == bytes(30000000)


def test_file_errors(sandbox):
    sandbox.exec("mkdir dir")
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("nope.txt")
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("nodir/nope.txt")
    with pytest.raises(IsADirectoryError):
        sandbox.read_file("dir")
    for outside in ("/etc/passwd", "../../etc/passwd", "/tmp/x", "/rootx/y"):
        with pytest.raises(ValueError, match="outside /root"):
            sandbox.write_file(outside, "x")


def test_remove(sandbox):
    sandbox.exec("mkdir -p ro/sub && touch ro/sub/f && chmod 555 ro/sub ro")  # read-only tree
    sandbox.write_file("tree/a/b.txt", "b")
    sandbox.write_file("file.txt", "f")
    for path in ("ro", "tree", "file.txt", "never-existed"):
        sandbox.remove(path)
    assert sandbox.exec("ls -A").stdout == ""


def test_snapshot(sandbox):
    sandbox.exec(
        "mkdir -p src/pkg && echo a > src/a.py && echo b > src/pkg/b.py && "
        "head -c 5000 /dev/zero > src/big.bin && ln -s a.py src/link.py"
    )
    assert sandbox.snapshot("src", max_file_bytes=1000) == {"a.py": b"a\n", "pkg/b.py": b"b\n"}
    assert len(sandbox.snapshot("/root/workdir/src", max_files=2)) == 2
    assert sandbox.snapshot("missing") == {}


def test_symlinks_are_never_followed_by_file_operations(sandbox):
    sandbox.exec("ln -s /etc evil; ln -s /etc/passwd passwd_link")
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("evil/passwd")
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("passwd_link")
    assert not sandbox.exists("evil/passwd")
    sandbox.write_file("passwd_link", "replaces the link")
    assert sandbox.exec("cat /etc/passwd").stdout != "replaces the link"
    assert sandbox.exec("test -L passwd_link || cat passwd_link").stdout == "replaces the link"


def test_write_file_replaces_whatever_is_in_the_way(sandbox, tmp_path):
    """Staging (task files, verify_files) owns the paths it writes: a symlink to a host dir, a
    file where a directory goes or a directory where the file goes is replaced, never followed."""
    outside = tmp_path / "host-dir"  # a host dir the symlink points at (also /tmp inside)
    outside.mkdir()
    sandbox.exec(f"ln -s /tmp tests; ln -s {outside} hostlink; echo f > plain; mkdir -p isdir/sub; "
                 "echo x > isdir/sub/y")
    sandbox.write_file("tests/test_x.py", "staged")
    sandbox.write_file("hostlink/a.txt", "staged")
    sandbox.write_file("plain/b.txt", "staged")
    sandbox.write_file("isdir", "staged")
    assert list(outside.iterdir()) == []
    assert sandbox.exec("test -d tests -a ! -L tests -a -d hostlink -a ! -L hostlink").exit_code == 0
    for path in ("tests/test_x.py", "hostlink/a.txt", "plain/b.txt", "isdir"):
        assert sandbox.read_file(path) == b"staged"


def test_deep_trees_are_walked_without_recursion(sandbox):
    """1,200 nested directories (past Python's recursion limit): snapshot() keeps what it can
    reach within its depth bound, remove() and write_file() still work."""
    sandbox.exec("echo top > top.txt; d=deep; for i in $(seq 1200); do d=$d/d; done; mkdir -p $d; "
                 "echo bottom > $d/bottom.txt; mkdir -p deep/d/shallow && echo s > deep/d/shallow/s.txt",
                 timeout_s=120)
    files = sandbox.snapshot(".")
    assert files["top.txt"] == b"top\n" and files["deep/d/shallow/s.txt"] == b"s\n"
    sandbox.write_file("deep/d/new.txt", "n")
    sandbox.remove("deep")
    assert not sandbox.exists("deep") and sandbox.exists("top.txt")


# --- network, mounts, limits --------------------------------------------------------------


@pytest.fixture
def tcp_server():
    """A host TCP server on 127.0.0.1 answering b"pong"; yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    with _serving(server, b"pong"):
        yield server.getsockname()[1]


@pytest.fixture
def unix_server(tmp_path_factory):
    """A host Unix socket server answering b"gateway-ok", in a private (0o700) directory with
    the default socket mode: the backend must make it reachable itself."""
    directory = tmp_path_factory.mktemp("gw")
    os.chmod(directory, 0o700)
    path = str(directory / "gw.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    with _serving(server, b"gateway-ok"):
        yield path


class _serving:
    def __init__(self, server: socket.socket, reply: bytes):
        self.server, self.reply, self.stop = server, reply, threading.Event()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(self.reply)

    def __enter__(self):
        self.server.settimeout(0.2)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def __exit__(self, *exc_info):
        self.stop.set()
        self.thread.join()
        self.server.close()


def connect(target: str) -> str:
    """A shell command printing what a TCP ("host:port") or Unix socket server sends."""
    if target.startswith("/"):
        family, address = "AF_UNIX", repr(target)
    else:
        host, port = target.split(":")
        family, address = "AF_INET", repr((host, int(port)))
    return (
        'python3 -c "import socket\n'
        f"s = socket.socket(socket.{family}); s.settimeout(3)\n"
        f"try:\n    s.connect({address}); print(s.recv(100).decode())\n"
        "except OSError as e:\n    print('FAILED:', e)\""
    )


def test_network_modes(entry, backend, tcp_server):
    need(entry, "network")
    with backend.create(SandboxSpec()) as sb:
        result = sb.exec(connect(f"127.0.0.1:{tcp_server}") + "; " + connect("1.1.1.1:80"))
        assert result.stdout.count("FAILED") == 2 and "pong" not in result.stdout
        assert "pong" not in sb.exec(connect(f"127.0.0.1:{tcp_server}"), network="full").stdout
        with pytest.raises(ValueError, match="gateway"):
            sb.exec("true", network="gateway")  # no gateway socket in the spec
        with pytest.raises(ValueError):
            sb.exec("true", network="everything")


@pytest.fixture
def host_address_server():
    """A host TCP server on the host's own non-loopback address (a "host-local service")."""
    from pi_env.sandbox.usernet import host_addresses

    address = next((a for a in host_addresses() if ":" not in a), None)
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    server = socket.create_server((address, 0))
    with _serving(server, b"host-service"):
        yield f"{address}:{server.getsockname()[1]}"


def outside_nameserver() -> str | None:
    """A nameserver of the host that is neither loopback nor the host itself, if the host
    reaches it over TCP: something outside the machine to reach."""
    from pi_env.sandbox.usernet import host_addresses

    try:
        with open("/etc/resolv.conf") as f:
            servers = [line.split()[1] for line in f if line.startswith("nameserver") and len(line.split()) > 1]
    except OSError:
        return None
    for server in servers:
        if ":" in server or server.startswith("127.") or server in host_addresses():
            continue
        try:
            socket.create_connection((server, 53), timeout=3).close()
            return server
        except OSError:
            continue
    return None


def test_a_phase_with_network_reaches_the_outside_not_the_host(entry, backend, tcp_server, host_address_server):
    """network="full" (setup, verify_network): the host's 127.0.0.1 listeners, the gateway
    address that would lead to them, and the host's own addresses are all unreachable."""
    need(entry, "network")
    with backend.create(SandboxSpec()) as sb:
        targets = [f"127.0.0.1:{tcp_server}", f"10.0.2.2:{tcp_server}", host_address_server]
        result = sb.exec("; ".join(connect(target) for target in targets), network="full")
        assert result.stdout.count("FAILED") == 3, result.stdout + result.stderr
        nameserver = outside_nameserver()
        if nameserver is None:
            pytest.skip("nothing outside this machine is reachable from the host (no outside nameserver)")
        # TCP to a machine outside, and a DNS answer through the sandbox's own resolver.
        dns = ('python3 -c "import socket\n'
               'try:\n    socket.getaddrinfo(\'name-that-does-not-exist.invalid\', 80)\n'
               'except socket.gaierror as e:\n    print(\'answer\' if e.errno == socket.EAI_NONAME else e)"')
        result = sb.exec(f"python3 -c \"import socket; socket.create_connection(('{nameserver}', 53), timeout=5); "
                         f"print('outside-ok')\"; {dns}", network="full", timeout_s=60)
        assert result.stdout.split() == ["outside-ok", "answer"], result.stdout + result.stderr


def test_gateway_socket_only_in_gateway_mode(entry, backend, unix_server, tcp_server):
    need(entry, "gateway_socket")
    spec = SandboxSpec(gateway_socket=unix_server, agent_masked_paths=("/root/workdir/hidden",))
    with backend.create(spec) as sb:
        sb.write_file("hidden/answer.txt", "42")
        result = sb.exec(connect(GATEWAY_SOCKET) + "; " + connect(f"127.0.0.1:{tcp_server}")
                         + "; ls /root/workdir/hidden", network="gateway")
        lines = result.stdout.splitlines()
        assert lines[0] == "gateway-ok" and lines[1].startswith("FAILED") and lines[2:] == []
        assert "FAILED" in sb.exec(connect(GATEWAY_SOCKET)).stdout  # not bound otherwise
        assert sb.exec("cat hidden/answer.txt").stdout == "42"
        assert sb.read_file("hidden/answer.txt") == b"42"


def test_ro_mounts(entry, backend, tmp_path_factory):
    need(entry, "host_mounts")
    runtime = tmp_path_factory.mktemp("runtime")
    os.chmod(runtime, 0o755)
    (runtime / "tool.sh").write_text("echo from-runtime")
    os.chmod(runtime / "tool.sh", 0o644)
    parent = runtime.parent
    while str(parent) != "/":  # pytest makes its temp root 0o700: let sandbox uids through
        os.chmod(parent, os.stat(parent).st_mode | 0o111)
        parent = parent.parent
    spec = SandboxSpec(ro_mounts={"/opt/pi-env/rt": str(runtime), "/opt/one.sh": str(runtime / "tool.sh")})
    with backend.create(spec) as sb:
        assert sb.exec("sh /opt/pi-env/rt/tool.sh; sh /opt/one.sh").stdout == "from-runtime\n" * 2
        assert sb.exec("touch /opt/pi-env/rt/x").exit_code != 0
    assert os.listdir(runtime) == ["tool.sh"]


def test_limits(entry, backend):
    need(entry, "limits")
    limits = SandboxLimits(max_file_bytes=1 << 20, max_open_files=100, max_processes=64)
    with backend.create(SandboxSpec(limits=limits)) as sb:
        result = sb.exec("ulimit -n; head -c 2000000 /dev/zero > big")
        assert result.stdout.split() == ["100"] and result.exit_code != 0
        assert len(sb.read_file("big")) == 1 << 20
        # A fork bomb is bounded, fully killed on timeout, and the sandbox stays usable.
        result = sb.exec(":(){ :|:& };:; sleep 100", timeout_s=3)
        assert result.timed_out and result.exit_code is None
        assert "Resource temporarily unavailable" in result.stderr
        assert sb.exec("echo alive", timeout_s=60).stdout == "alive\n"


def test_memory_total_spans_every_process(entry, backend):
    """RLIMIT_DATA is per process: three children of 200 MB each must not all live in a
    sandbox whose total is 256 MB (the kernel kills inside it; the host is fine)."""
    need(entry, "limits")
    from pi_env.sandbox.totals import host_totals

    if entry.name == "local" and not host_totals().memory:
        pytest.skip(f"no memory total on this host: {host_totals().describe()}")
    limits = SandboxLimits(max_total_memory_bytes=256 << 20)
    child = "python3 -c \"b = bytearray(200 << 20); import time; time.sleep(4); print('lived')\""
    with backend.create(SandboxSpec(limits=limits)) as sb:
        result = sb.exec(f"for i in 1 2 3; do {child} & done; wait", timeout_s=120)
        assert result.stdout.count("lived") < 3, result.stdout + result.stderr
        assert sb.exec(f"{child}", timeout_s=60).stdout == "lived\n"  # one alone fits: the sandbox works


def test_disk_total_ends_in_enospc(entry, backend):
    """Everything the sandbox can write persistently (its home, work dir included) is capped."""
    need(entry, "limits")
    from pi_env.sandbox.totals import host_totals

    if entry.name in ("local", "podman") and not host_totals().disk:
        pytest.skip(f"no disk total on this host: {host_totals().describe()}")
    limits = SandboxLimits(max_disk_bytes=64 << 20)
    with backend.create(SandboxSpec(limits=limits)) as sb:
        result = sb.exec("head -c 100000000 /dev/zero > big; echo rc=$?; mkdir -p /root/elsewhere && "
                         "head -c 100000000 /dev/zero > /root/elsewhere/big2; echo rc=$?")
        assert "No space left on device" in result.stderr and result.stdout.split() == ["rc=1", "rc=1"]
        sb.exec("rm -f big /root/elsewhere/big2")
        assert sb.exec("head -c 30000000 /dev/zero > ok && echo fits").stdout == "fits\n"


# --- lifecycle ----------------------------------------------------------------------------


def test_close_kills_everything_and_is_idempotent(backend):
    sb = backend.create(SandboxSpec())
    process = sb.start("sleep 1000")
    sb.close()
    sb.close()
    assert process.poll() is not None
    for call in (lambda: sb.exec("true"), lambda: sb.start("true"), lambda: sb.write_file("x", "x")):
        with pytest.raises(SandboxError, match="closed"):
            call()


def test_sandboxes_are_separate(backend):
    with backend.create(SandboxSpec()) as a, backend.create(SandboxSpec()) as b:
        assert a.id != b.id
        a.write_file("mine.txt", "A's data")
        assert not b.exists("mine.txt")
        assert b.exec("cat /root/workdir/mine.txt").exit_code != 0
