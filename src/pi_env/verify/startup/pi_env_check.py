"""pi-env's helpers for verify checks: run the agent's code so that it cannot decide its own score.

Mounted read-only at /opt/pi-env-verify/pi_env_check.py in every sandbox (importable by every
verify Python: `import pi_env_check as check`). Standard library only, Python 3.8+, no pi-env
imports: it runs inside sandboxes and task images.

The pattern (docs/tasks.md, "Writing tasks safely"):

    import pi_env_check as check
    CASES = [("a b a", {"a": 2, "b": 1}), ("", {})]   # the expected answers: in memory only
    check.seal(__file__)                              # hidden files off the disk; process sealed
    got = check.calls("wordcount", "count_words", [[text] for text, _ in CASES])
    passed = sum(g == want for g, (_, want) in zip(got, CASES))
    check.write_reward(passed / len(CASES), passed=passed)

- `seal(*hidden)`: removes the hidden files and dirs named (the check's own `__file__` at least)
  once the check holds what it needs in memory, makes the check's process non-dumpable (the
  agent's code cannot ptrace it, read its memory, its fds or its environment) and a child
  subreaper (every process the agent's code leaves is re-parented to the check, which kills it).
- `call`/`calls`: the agent's function in a fresh child interpreter (cwd: the work dir, which is
  first on its sys.path); the arguments go in on its stdin, the results come back as JSON on a
  pipe of their own (the agent's prints go elsewhere), and every process the child left is
  killed before they are read. The expected answers are never in the child.
- `run`: the agent's program, the same way; its stdout and stderr captured.
- `write_reward`: every process the agent's code left killed, then logs/verifier made a real,
  writable dir with no reward file in it, then reward.txt (or reward.json with details) written
  atomically. A check that scores by its exit status needs no reward file.

Each child is confined before the agent's code starts: no new privileges, and a Landlock domain
(where the kernel has Landlock) that keeps it from ptracing or signalling any process outside it
(the check, the verify command's shell) and from opening their /proc/PID/mem. Where verify runs
as root (Harbor), `user="nobody"` runs the child as that user too.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["AgentError", "Ran", "call", "calls", "confinement", "kill_descendants", "run", "seal", "write_reward"]

DEFAULT_TIMEOUT = 60.0
MAX_OUTPUT = 16 << 20  # bytes kept of a child's stdout, stderr or results
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 1, 4, 36

# The launcher: a bare interpreter (-I -S: nothing of the work dir or the environment is
# imported) that drops to the requested user, confines itself and execs the agent's program.
_LAUNCH = r"""
import ctypes, json, os, signal, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: killed with the check (after setuid, which clears it)
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    sys.exit("pi_env_check: cannot set no_new_privs")
abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset: ABI
if abi >= 1:
    # MAKE_BLOCK handled (no rule: block devices are never made) so the domain exists on every
    # ABI; from ABI 6 signals and abstract sockets are scoped to the domain as well.
    attr = (ctypes.c_uint64 * 3)(1 << 11, 0, 3 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0 or libc.syscall(446, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:  # landlock_restrict_self
        sys.exit("pi_env_check: Landlock refused: errno %d" % ctypes.get_errno())
    os.close(fd)
os.execvp(spec["argv"][0], spec["argv"])
"""

# The child that calls the agent's function: its request on stdin, its results on fd argv[1].
_CALL = r"""
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # the cwd: nothing of the work dir before this file's own imports
import importlib, json, os
request = json.loads(sys.stdin.buffer.read().decode())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
out = int(sys.argv[1])
sys.path.insert(0, request["path"])

def failure(error):
    try:
        return ["error", ("%s: %s" % (type(error).__name__, error))[:2000]]
    except BaseException:
        return ["error", type(error).__name__]

try:
    function = getattr(importlib.import_module(request["module"]), request["function"])
except BaseException as error:
    results = [json.dumps(failure(error))] * len(request["cases"])
else:
    results = []
    for args in request["cases"]:
        try:
            results.append('["ok", %s]' % json.dumps(function(*args)))
        except BaseException as error:
            results.append(json.dumps(failure(error)))
data = ("[" + ",".join(results) + "]").encode()
while data:
    data = data[os.write(out, data):]
os._exit(0)  # the agent's atexit hooks never run
"""


class AgentError(Exception):
    """The agent's code gave no answer: it raised, exited, crashed, timed out or wrote something
    that is not a JSON result. Never equal to an expected answer."""


class Ran:
    """What `run` saw: `returncode` (None when it timed out), `stdout`, `stderr` (text)."""

    def __init__(self, returncode, stdout, stderr, timed_out):
        self.returncode, self.stdout, self.stderr, self.timed_out = returncode, stdout, stderr, timed_out

    @property
    def ok(self):
        return self.returncode == 0 and not self.timed_out

    def __repr__(self):
        return (
            f"Ran(returncode={self.returncode!r}, timed_out={self.timed_out!r}, "
            f"stdout={self.stdout[-300:]!r}, stderr={self.stderr[-300:]!r})"
        )


def seal(*hidden):
    """Call once the check holds what it needs in memory (its cases, expected answers, data):
    removes each hidden file or dir named (the check's own `__file__` at least; where a path
    cannot be removed, it is made unreadable to other users), makes this process non-dumpable
    and a child subreaper."""
    for path in hidden:
        _remove(os.path.abspath(path))
    _harden()


def calls(module, function, cases, timeout=DEFAULT_TIMEOUT, user=None, cwd=None):
    """`function` of the agent's `module` called once per case (a list of argument lists), all
    in one child; returns one result per case, in order: the JSON value it returned (tuples come
    back as lists, dict keys as strings), or an `AgentError` where it raised, or for every case
    when the child died, timed out or wrote something else."""
    cases = [list(args) for args in cases]
    cwd = cwd or workdir()
    request = json.dumps({"module": module, "function": function, "cases": cases, "path": cwd})
    read, write = os.pipe()
    argv = [sys.executable, "-c", _CALL, str(write)]
    try:
        returncode, out, stopped = _supervise(argv, request.encode(), timeout, user, cwd, read, write)
    finally:
        os.close(read)
    where = f"{module}.{function}"
    if stopped:
        return [AgentError(f"{where} {stopped}")] * len(cases)
    try:
        results = json.loads(out[2].decode("utf-8"))
        if not isinstance(results, list) or len(results) != len(cases):
            raise ValueError("not one result per case")
        decoded = []
        for entry in results:
            if not isinstance(entry, list) or len(entry) != 2 or entry[0] not in ("ok", "error"):
                raise ValueError(f"not a result: {entry!r}")
            decoded.append(entry[1] if entry[0] == "ok" else AgentError(f"{where} raised {entry[1]}"))
        return decoded
    except (ValueError, RecursionError) as error:  # not JSON, not one result a case
        tail = out[1].decode("utf-8", "replace")[-1500:]
        why = f"exited with status {returncode}" if not out[2] else f"wrote no valid result ({error})"
        return [AgentError(f"{where} gave no answer: the child {why}; its stderr: {tail}")] * len(cases)


def call(module, function, *args, timeout=DEFAULT_TIMEOUT, user=None, cwd=None):
    """`module.function(*args)` of the agent's in a child (as `calls`); returns its JSON value,
    raises `AgentError` when it gave none."""
    result = calls(module, function, [args], timeout=timeout, user=user, cwd=cwd)[0]
    if isinstance(result, AgentError):
        raise result
    return result


def run(argv, input=None, timeout=DEFAULT_TIMEOUT, user=None, cwd=None):
    """The agent's program `argv` (cwd: the work dir) with `input` (text or bytes) on its stdin;
    every process it left killed before this returns a `Ran` with its status and output."""
    data = input.encode() if isinstance(input, str) else (input or b"")
    returncode, out, stopped = _supervise(list(argv), data, timeout, user, cwd or workdir(), None, None)
    return Ran(None if stopped else returncode, out[0].decode("utf-8", "replace"),
               out[1].decode("utf-8", "replace"), stopped is not None)  # fmt: skip


def write_reward(value, directory=None, **details):
    """The check's verdict, as its last act: every process the agent's code left killed, then
    `directory` ($HOME/logs/verifier by default; a Harbor check names /logs/verifier) made a
    real dir without reward files, then reward.txt (just `value`) or, with `details`,
    reward.json (`{"reward": value, **details}`) written atomically."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"write_reward: {value!r} is not a finite number")
    _harden()
    kill_descendants()
    directory = os.path.abspath(directory or os.path.join(os.path.expanduser("~"), "logs", "verifier"))
    _real_dir(os.path.dirname(directory))
    _real_dir(directory)
    for name in os.listdir(directory):
        if name.startswith("reward") or name.startswith(".reward"):
            _remove(os.path.join(directory, name), strict=True)
    name = "reward.json" if details else "reward.txt"
    text = json.dumps(dict(reward=value, **details)) if details else str(value)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}")
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(handle, text.encode() + b"\n")
    finally:
        os.close(handle)
    os.replace(temporary, os.path.join(directory, name))


def kill_descendants():
    """SIGKILL every process below this one (the subreaper inherits orphans), until none is left."""
    me = os.getpid()
    for _ in range(1000):
        _reap()
        found = _descendants(me)
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)
    raise RuntimeError("pi_env_check: the agent's processes kept coming back")


def confinement():
    """What confines the agent's code here, for a check's log: the Landlock ABI (0: none)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return {"landlock_abi": max(abi, 0), "signals_scoped": abi >= 6}


def workdir():
    """The work dir the agent's code runs in: PI_ENV_WORKDIR in pi-env's verify, else the cwd."""
    return os.environ.get("PI_ENV_WORKDIR") or os.getcwd()


# -- internals --------------------------------------------------------------------------------


def _harden():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "pi_env_check: cannot seal the check's process")


def _supervise(argv, data, timeout, user, cwd, read, write):
    """Run `argv` through the launcher, `data` on its stdin. Returns (status, [stdout, stderr,
    results], why it was stopped or None), once every process it left is dead."""
    _harden()
    uid: int | None = None
    gid: int | None = None
    if user is not None:
        entry = pwd.getpwnam(user)
        uid, gid = entry.pw_uid, entry.pw_gid
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCH, json.dumps({"uid": uid, "gid": gid, "argv": argv})]
    proc = subprocess.Popen(launcher, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, pass_fds=(write,) if write is not None else ())  # fmt: skip
    if write is not None:
        os.close(write)
    pipe_in, pipe_out, pipe_err = proc.stdin, proc.stdout, proc.stderr
    assert pipe_in is not None and pipe_out is not None and pipe_err is not None
    streams = {pipe_out.fileno(): 0, pipe_err.fileno(): 1}
    if read is not None:
        streams[read] = 2
    out = [bytearray(), bytearray(), bytearray()]
    selector = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    stdin = pipe_in.fileno()
    pending = memoryview(data)
    if pending:
        os.set_blocking(stdin, False)
        selector.register(stdin, selectors.EVENT_WRITE)
    else:
        pipe_in.close()

    def pump(wait):
        nonlocal pending
        for key, _ in selector.select(wait):
            if key.fd == stdin:
                try:
                    pending = pending[os.write(stdin, pending[:65536]) :]
                except BlockingIOError:
                    continue
                except OSError:  # the child closed its stdin: the rest is not for it
                    pending = pending[:0]
                if not pending:
                    selector.unregister(stdin)
                    pipe_in.close()
                continue
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                selector.unregister(key.fd)
            else:
                out[streams[key.fd]] += chunk[: MAX_OUTPUT + 1 - len(out[streams[key.fd]])]

    stopped = None
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() >= deadline:
                stopped = f"timed out after {timeout:g}s"
            elif any(len(buffer) > MAX_OUTPUT for buffer in out):
                stopped = f"wrote more than {MAX_OUTPUT >> 20} MiB"
            if stopped:
                break
            pump(min(deadline - time.monotonic(), 0.05))
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
        kill_descendants()  # nothing of the agent's outlives the call: every writer of the pipes is gone
    if stdin in selector.get_map():
        selector.unregister(stdin)
    until = time.monotonic() + 2.0
    while selector.get_map() and time.monotonic() < until:
        pump(0.05)
    selector.close()
    for stream in (pipe_in, pipe_out, pipe_err):
        stream.close()
    return proc.returncode, [bytes(buffer[:MAX_OUTPUT]) for buffer in out], stopped


def _descendants(root):
    """Every live or zombie process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _real_dir(path):
    """`path` a real directory this process can write (a link or file there replaced)."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        _remove(path, strict=True)
    if not os.path.lexists(path):
        os.makedirs(path, 0o755)
    try:
        os.chmod(path, 0o755)
    except OSError:
        pass  # not ours to change (a Harbor mount): writing tells


def _remove(path, strict=False):
    """Remove a file, link or dir tree (dirs made writable first); what cannot be removed (a
    mount point) is made unreadable to others, or, `strict`, an error."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for top, dirs, _ in os.walk(path):
                for name in dirs:
                    if not os.path.islink(os.path.join(top, name)):
                        os.chmod(os.path.join(top, name), 0o700)
            os.chmod(path, 0o700)
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    except OSError:
        if strict:
            raise
        try:
            os.chmod(path, 0o700 if os.path.isdir(path) else 0o600, follow_symlinks=False)
        except (OSError, NotImplementedError):
            pass
