"""TEST DOUBLE: a loopback stand-in for the E2B API and each sandbox's envd, so the real `e2b`
client (its REST create/kill, its Connect RPC process stream, its /files transfers, its auth
headers and errors) can be driven without the service.

One in-thread WSGI server on 127.0.0.1 answers both: pass it as api_url and sandbox_url (the SDK
then sends E2b-Sandbox-Id to say which sandbox). Routes: POST /v2/sandboxes, DELETE
/sandboxes/<id> (REST, X-API-KEY); GET /health, GET|POST /files (octet-stream) and the Connect
RPC process.Process/Start and SendSignal (served by connectrpc's own server code with the
SDK's JSON codec; X-Access-Token). Each sandbox is a bubblewrap process holding a PID and mount
namespace (private /root, /tmp, /opt, /run; the host's other files read-only; the host's
network); commands enter it with nsenter and run for real; files go through /proc/<pid>/root.

What it is not: E2B's templates, VMs, timeouts (the requested one is only recorded), network
policy (create and update requests are recorded in `requests` and `networks`, not enforced),
pause/resume, users. Faults for retry tests: `fail_api`.
Needs HTTP/1.1 on the client (E2B_HTTP_VERSION=1.1 / http_version="1.1"): it speaks no h2c.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import email.policy
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from email.parser import BytesParser
from socketserver import ThreadingMixIn
from typing import Literal
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from e2b.envd.client_shared import ENVD_JSON_CODEC
from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import ProcessWSGIApplication
from protobuf import Oneof

ENVD_VERSION = "0.5.7"


def _die_with_us() -> None:
    """In the child: SIGKILL when the test process dies, so a crashed test leaks no sandbox."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Machine:
    """One fake sandbox: a bwrap'd `sleep` whose namespaces commands enter."""

    def __init__(self, sandbox_id: str, root: str, request: dict):
        self.id, self.request = sandbox_id, request
        self.token = secrets.token_hex(16)
        self.dir = root
        os.makedirs(os.path.join(root, "root"))
        read_fd, write_fd = os.pipe()
        argv = [
            shutil.which("bwrap") or "bwrap",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--die-with-parent",
            "--info-fd",
            str(write_fd),
            "--ro-bind",
            "/",
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--tmpfs",
            "/opt",
            "--tmpfs",
            "/run",
            "--bind",
            os.path.join(root, "root"),
            "/root",
            "--",
            "sleep",
            "infinity",
        ]
        self.process = subprocess.Popen(
            argv,
            pass_fds=(write_fd,),
            start_new_session=True,
            preexec_fn=_die_with_us,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(write_fd)
        data = b""
        while b"}" not in data:  # bwrap may keep the fd open: read up to the JSON's end
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            data += chunk
        os.close(read_fd)
        # bwrap reports the namespace's init (killing it ends everything inside); commands enter
        # the namespaces and root of its child, the `sleep`.
        self.init_pid = json.loads(data[: data.index(b"}") + 1])["child-pid"]
        deadline = time.monotonic() + 10
        while not (children := open(f"/proc/{self.init_pid}/task/{self.init_pid}/children").read().split()):
            if time.monotonic() > deadline:
                raise RuntimeError("fake e2b sandbox did not start")
            time.sleep(0.01)
        self.pid = int(children[0])
        self.commands: dict[int, subprocess.Popen] = {}

    def spawn(self, config: process_pb.ProcessConfig) -> subprocess.Popen:
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            **dict(config.envs or {}),
        }
        argv = [
            "nsenter",
            "-t",
            str(self.pid),
            "--pid",
            "--mount",
            "--root",
            f"--wd={config.cwd or '/root'}",
            "--",
            config.cmd,
            *config.args,
        ]
        process = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.commands[process.pid] = process
        return process

    def path(self, path: str) -> str:
        """The host path of a sandbox path (through the holder's root; no symlink checks: the
        backend does its own)."""
        return f"/proc/{self.pid}/root{os.path.normpath('/' + path)}"

    def stop(self) -> None:
        for pid in (self.pid, self.init_pid):  # the PIDs bwrap reported: the namespace ends with them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # by the PID we started
            except ProcessLookupError:
                pass
            self.process.wait()
        for process in self.commands.values():
            if process.poll() is None:
                process.kill()
                process.wait()


class _Process:
    """process.Process for connectrpc's server: Start streams a command's events."""

    def __init__(self, fake: FakeE2B):
        self.fake = fake

    def __getattr__(self, name: str):  # every other RPC: not part of the stand-in
        def unimplemented(request, ctx):
            from connectrpc.code import Code
            from connectrpc.errors import ConnectError

            raise ConnectError(Code.UNIMPLEMENTED, f"fake envd: {name} is not implemented")

        return unimplemented

    def _machine(self, ctx) -> _Machine:
        machine = self.fake.machines.get(ctx.request_headers.get("e2b-sandbox-id", ""))
        if machine is None or ctx.request_headers.get("x-access-token") != machine.token:
            from connectrpc.code import Code
            from connectrpc.errors import ConnectError

            raise ConnectError(Code.UNAUTHENTICATED, "unknown sandbox or bad access token")
        return machine

    def start(self, request: process_pb.StartRequest, ctx):
        machine = self._machine(ctx)
        assert request.process is not None, "the e2b SDK always sends the command's process config"
        process = machine.spawn(request.process)
        events: list = []
        done = threading.Condition()

        def pump(stream, name):
            for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
                with done:
                    events.append(process_pb.ProcessEvent.DataEvent(output=Oneof(name, chunk)))
                    done.notify_all()
            with done:
                events.append(name)
                done.notify_all()

        threads = [
            threading.Thread(target=pump, args=(process.stdout, "stdout"), daemon=True),
            threading.Thread(target=pump, args=(process.stderr, "stderr"), daemon=True),
        ]
        for thread in threads:
            thread.start()
        Event = process_pb.ProcessEvent
        started: Oneof[Literal["start"], process_pb.ProcessEvent.StartEvent] = Oneof(
            "start", Event.StartEvent(pid=process.pid)
        )
        yield process_pb.StartResponse(event=Event(event=started))
        closed = 0
        while closed < 2:
            with done:
                while not events:
                    done.wait()
                batch, events[:] = list(events), []
            for item in batch:
                if isinstance(item, str):
                    closed += 1
                else:
                    data: Oneof[Literal["data"], process_pb.ProcessEvent.DataEvent] = Oneof("data", item)
                    yield process_pb.StartResponse(event=Event(event=data))
        code = process.wait()
        end: Oneof[Literal["end"], process_pb.ProcessEvent.EndEvent] = Oneof(
            "end",
            Event.EndEvent(
                exit_code=code if code >= 0 else -1,
                exited=code >= 0,
                status=f"exit status {code}" if code >= 0 else f"signal: {-code}",
            ),
        )
        yield process_pb.StartResponse(event=Event(event=end))

    def send_signal(self, request: process_pb.SendSignalRequest, ctx):
        machine = self._machine(ctx)
        assert request.process is not None and request.process.selector is not None, "the SDK names the process"
        pid = request.process.selector.value
        process = machine.commands.get(pid) if isinstance(pid, int) else None  # by tag: none are tagged
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        return process_pb.SendSignalResponse()


def _read_chunked(stream) -> bytes:
    body = b""
    while True:
        size = int(stream.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while stream.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return body
        body += stream.read(size)
        stream.readline()


class _Handler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class FakeE2B:
    """TEST DOUBLE of the E2B API + envd (see the module docstring). `url` is its address."""

    def __init__(self, api_key: str = "e2b_pi_env_fake"):
        self.api_key = api_key
        self.machines: dict[str, _Machine] = {}
        self.requests: dict[str, dict] = {}  # sandbox id -> its create request body
        self.networks: dict[str, list[dict]] = {}  # sandbox id -> its network updates, in order
        self.killed: list[str] = []
        self.fail_api: list[int] = []  # statuses the next REST API requests answer with
        self._root = tempfile.mkdtemp(prefix="pi-env-fake-e2b-")
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fake-e2b-spawner")
        # _Process answers the RPCs it lacks through __getattr__; the application never asks it for
        # desc (a classmethod of ProcessSync), the one member such a handler cannot provide.
        self._rpc = ProcessWSGIApplication(_Process(self), codecs=[ENVD_JSON_CODEC])  # type: ignore[arg-type]
        self._server = make_server("127.0.0.1", 0, self._app, server_class=_Server, handler_class=_Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-e2b", daemon=True)

    def __enter__(self) -> FakeE2B:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for machine in list(self.machines.values()):
            machine.stop()
        self._server.shutdown()
        self._server.server_close()
        self._spawner.shutdown()
        shutil.rmtree(self._root, ignore_errors=True)

    def running(self) -> list[str]:
        return list(self.machines)

    # -- WSGI

    @staticmethod
    def _reply(
        start_response, status: int, body: bytes | dict | list | None = None, content_type: str = "application/json"
    ):
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        reasons = {
            200: "OK",
            201: "Created",
            204: "No Content",
            400: "Bad Request",
            401: "Unauthorized",
            404: "Not Found",
            429: "Too Many Requests",
            500: "Internal Server Error",
            502: "Bad Gateway",
            503: "Service Unavailable",
        }
        start_response(
            f"{status} {reasons.get(status, 'Error')}",
            [("Content-Type", content_type), ("Content-Length", str(len(body or b"")))],
        )
        return [body or b""]

    def _app(self, environ, start_response):
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        if environ.get("HTTP_TRANSFER_ENCODING", "").lower() == "chunked":  # wsgiref does not decode it
            body = _read_chunked(environ["wsgi.input"])
            environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
            del environ["HTTP_TRANSFER_ENCODING"]
        if path.startswith("/process.Process/"):
            return self._rpc(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        if path == "/v2/sandboxes" or path.startswith("/sandboxes/"):
            return self._api(method, path, body, environ, start_response)
        machine = self.machines.get(environ.get("HTTP_E2B_SANDBOX_ID", ""))
        if machine is None:
            return self._reply(start_response, 502, {"message": "sandbox not found", "code": 502})
        if path == "/health":
            return self._reply(start_response, 204)
        if environ.get("HTTP_X_ACCESS_TOKEN") != machine.token:
            return self._reply(start_response, 401, {"message": "bad access token", "code": 401})
        if path != "/files":
            return self._reply(start_response, 404, {"message": f"no route {path}", "code": 404})
        target = machine.path(parse_qs(environ.get("QUERY_STRING", ""))["path"][0])
        if method == "POST":
            if environ.get("CONTENT_TYPE", "").startswith("multipart/form-data"):
                message = BytesParser(policy=email.policy.HTTP).parsebytes(
                    f"Content-Type: {environ['CONTENT_TYPE']}\r\n\r\n".encode() + body
                )
                payload = next(message.iter_parts()).get_payload(decode=True)
                assert isinstance(payload, bytes), "a form part that is not multipart decodes to bytes"
                body = payload
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(body)
            return self._reply(
                start_response,
                200,
                [{"name": os.path.basename(target), "type": "file", "path": target.split("/root", 1)[1]}],
            )
        try:
            with open(target, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return self._reply(start_response, 404, {"message": "file not found", "code": 404})
        return self._reply(start_response, 200, data, "application/octet-stream")

    def _api(self, method, path, body, environ, start_response):
        if environ.get("HTTP_X_API_KEY") != self.api_key:
            return self._reply(start_response, 401, {"message": "bad api key", "code": 401})
        if self.fail_api:
            status = self.fail_api.pop(0)
            return self._reply(start_response, status, {"message": "injected fault", "code": status})
        if method == "POST" and path == "/v2/sandboxes":
            request = json.loads(body)
            sandbox_id = "sbx" + secrets.token_hex(8)
            # From one long-lived thread: the parent-death signal fires when the creating
            # *thread* ends, and request threads end at once.
            machine = self._spawner.submit(_Machine, sandbox_id, os.path.join(self._root, sandbox_id), request).result()
            self.machines[sandbox_id], self.requests[sandbox_id] = machine, request
            return self._reply(
                start_response,
                201,
                {
                    "templateID": request.get("templateID", "base"),
                    "sandboxID": sandbox_id,
                    "clientID": "fake",
                    "envdVersion": ENVD_VERSION,
                    "envdAccessToken": machine.token,
                },
            )
        if method == "PUT" and path.endswith("/network"):  # egress rules: recorded, not enforced
            sandbox_id = path.split("/")[2]
            if sandbox_id not in self.machines:
                return self._reply(start_response, 404, {"message": "sandbox not found", "code": 404})
            self.networks.setdefault(sandbox_id, []).append(json.loads(body or b"{}"))
            return self._reply(start_response, 204)
        if method == "DELETE":
            gone = self.machines.pop(path.rsplit("/", 1)[1], None)
            if gone is None:
                return self._reply(start_response, 404, {"message": "sandbox not found", "code": 404})
            gone.stop()
            self.killed.append(gone.id)
            return self._reply(start_response, 204)
        return self._reply(start_response, 404, {"message": "no route", "code": 404})
