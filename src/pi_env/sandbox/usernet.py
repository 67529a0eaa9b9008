"""The network of a phase that has one (network="full": setup, verify_network): the internet,
not the host.

Sharing the host's network namespace would hand the sandbox every host service on 127.0.0.1
(and on the host's other addresses). Instead the command keeps a network namespace of its own,
and slirp4netns, a user-mode TCP/IP stack running on the host, gives it a tap device with NAT
to the outside:
- `--disable-host-loopback`: the gateway address (10.0.2.2) does not lead to the host's
  127.0.0.1;
- a `prohibit` route in the sandbox's namespace for each of the host's own addresses (read
  when the command starts), so a service the host exposes on, say, its LAN address is not
  reachable either (connect() fails with EACCES); the sandbox cannot change its routes (no
  capabilities);
- DNS through slirp4netns's forwarder (10.0.2.3), which asks the host's resolvers.

bubblewrap creates the namespaces, reports its child's pid on --info-fd and waits on
--block-fd; the host attaches slirp4netns (and the routes) to that pid and only then lets the
command run, so it never sees a half-made network. slirp4netns exits when every process of
the command is gone (its --exit-fd is a pipe whose write end only they hold).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import select
import shutil
import subprocess
import threading
import time

from pi_env.sandbox.base import SandboxError, SandboxUnavailable

SLIRP_DNS = "10.0.2.3"
RESOLV_CONF = f"nameserver {SLIRP_DNS}\n"
ATTACH_TIMEOUT_S = 10.0
INSTALL_HINT = "install slirp4netns (`apt-get install slirp4netns` on Debian/Ubuntu, `dnf install slirp4netns`)"


@functools.cache
def slirp4netns() -> str:
    path = shutil.which("slirp4netns")
    if path is None:
        raise SandboxUnavailable(f"a sandbox phase with network needs user-mode networking: {INSTALL_HINT}")
    return path


def host_addresses() -> list[str]:
    """The host's own non-loopback addresses, read from the kernel (no process to spawn): the
    IPv4 ones from /proc/net/fib_trie (its LOCAL routes), the IPv6 ones from if_inet6."""
    found: set[str] = set()
    try:
        with open("/proc/net/fib_trie") as f:
            previous = ""
            for line in f:
                if "/32 host LOCAL" in line and previous:
                    found.add(previous)
                parts = line.split()
                previous = parts[1] if len(parts) == 2 and parts[0] == "|--" else ""
    except OSError as error:
        raise SandboxError(f"cannot list the host's addresses to keep them from the sandbox: {error}") from None
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                found.add(str(ipaddress.IPv6Address(int(line.split()[0], 16))))
    except OSError:
        pass  # no IPv6 on this host
    return sorted(
        a for a in found if not (ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_link_local)
    )


class UserNet:
    """One command's user-mode network: make it, hand `bwrap_args()` and `pass_fds` to bwrap,
    then `attach(pid_of_bwrap)` right after spawning it."""

    def __init__(self):
        self._info_r, self._info_w = os.pipe()
        self._block_r, self._block_w = os.pipe()
        self._exit_r, self._exit_w = os.pipe()  # slirp4netns exits once every write end is closed
        self.pass_fds = (self._info_w, self._block_r, self._exit_w)

    def bwrap_args(self) -> list[str]:
        return ["--info-fd", str(self._info_w), "--block-fd", str(self._block_r)]

    def attach(self) -> None:
        """Wait for bwrap's namespaces, give them the network, then let the command start."""
        for fd in self.pass_fds:  # bwrap (and the command) hold their own copies
            os.close(fd)
        try:
            pid = self._child_pid()
            _wait_for_loopback(pid)  # bwrap sets up lo itself: touching the namespace before races it
            attach_network(pid, self._exit_r)
            os.write(self._block_w, b"1")
        finally:
            for fd in (self._info_r, self._block_w, self._exit_r):
                os.close(fd)

    def abandon(self) -> None:
        """Close everything when the command could not even be spawned."""
        for fd in (*self.pass_fds, self._info_r, self._block_w, self._exit_r):
            try:
                os.close(fd)
            except OSError:
                pass

    def _child_pid(self) -> int:
        data = b""
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while True:
            try:
                return int(json.loads(data)["child-pid"])
            except (ValueError, KeyError, TypeError):
                pass
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._info_r], [], [], left)[0]:
                raise SandboxError("bubblewrap did not report its sandbox in time")
            chunk = os.read(self._info_r, 4096)
            if not chunk:
                raise SandboxError("bubblewrap exited before its sandbox was ready")
            data += chunk


def _wait_for_loopback(pid: int) -> None:
    """Wait until the loopback device of `pid`'s network namespace is up (bubblewrap brings it
    up after reporting its pid; slirp4netns configuring the namespace meanwhile made bwrap fail
    with "loopback: Failed RTM_NEWADDR" about once in 60 commands). An up lo has ::1 (IPv6) or
    has joined 224.0.0.1 (IPv4)."""
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while time.monotonic() < deadline:
        for name in ("if_inet6", "igmp"):
            try:
                with open(f"/proc/{pid}/net/{name}") as f:
                    if any(line.split()[-1:] == ["lo"] or line.split()[1:2] == ["lo"] for line in f):
                        return
            except OSError:
                pass
        time.sleep(0.001)
    raise SandboxError("the sandbox's loopback device did not come up in time")


def attach_network(pid: int, exit_fd: int) -> None:
    """Give the network namespace of `pid` the internet without the host; slirp4netns runs
    until `exit_fd` (a pipe's read end) reports EOF."""
    slirp, ready_r = _start_slirp(pid, exit_fd)  # starts while the routes go in
    try:
        _prohibit_host_addresses(pid)
        _wait_ready(slirp, ready_r)
    except BaseException:
        slirp.kill()
        raise
    finally:
        os.close(ready_r)


def _prohibit_host_addresses(pid: int) -> None:
    routes = "".join(f"route add prohibit {address}\n" for address in host_addresses())
    if not routes:
        return
    done = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"],
        input=routes,
        capture_output=True,
        text=True,
        timeout=ATTACH_TIMEOUT_S,
        cwd="/",
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    if done.returncode != 0:
        raise SandboxError(f"cannot keep the host's addresses from the sandbox: {done.stderr.strip()[-300:]}")


def _start_slirp(pid: int, exit_fd: int) -> tuple[subprocess.Popen, int]:
    ready_r, ready_w = os.pipe()
    try:
        slirp = subprocess.Popen(
            [
                slirp4netns(),
                "--configure",
                "--mtu=65520",
                "--disable-host-loopback",
                "--enable-sandbox",
                "--enable-seccomp",
                f"--ready-fd={ready_w}",
                f"--exit-fd={exit_fd}",
                str(pid),
                "tap0",
            ],
            pass_fds=(ready_w, exit_fd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd="/",
            env={},
            start_new_session=True,
        )
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return slirp, ready_r


def _wait_ready(slirp: subprocess.Popen, ready_r: int) -> None:
    ready = select.select([ready_r], [], [], ATTACH_TIMEOUT_S)[0] and os.read(ready_r, 1) == b"1"
    if not ready:
        slirp.kill()
        _, err = slirp.communicate()
        raise SandboxError(f"slirp4netns did not start: {err.decode(errors='replace').strip()[-300:]}")
    threading.Thread(target=slirp.communicate, name="pi-env-slirp4netns-reaper", daemon=True).start()


class NetworkHolder:
    """A network namespace of its own, with the internet but not the host, kept by a sleeping
    process until stop(): for a backend that joins an existing namespace (podman's
    `--network ns:PATH`) rather than making one per command as bubblewrap does."""

    def __init__(self):
        own = os.readlink("/proc/self/ns/net")
        exit_r, exit_w = os.pipe()
        try:
            self._process = subprocess.Popen(
                ["unshare", "--net", "--", "sleep", "infinity"],
                pass_fds=(exit_w,),
                stdin=subprocess.DEVNULL,
                cwd="/",
                env={},
                start_new_session=True,
            )
            os.close(exit_w)
            exit_w = -1
            self.path = f"/proc/{self._process.pid}/ns/net"
            deadline = time.monotonic() + ATTACH_TIMEOUT_S
            while os.readlink(self.path) == own:  # unshare has not switched yet
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise SandboxError("could not make a network namespace (unshare --net)")
                time.sleep(0.002)
            attach_network(self._process.pid, exit_r)
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(exit_r)
            if exit_w >= 0:
                os.close(exit_w)

    def stop(self) -> None:
        """End the namespace (slirp4netns exits with its holder)."""
        if getattr(self, "_process", None) is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
