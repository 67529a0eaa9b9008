"""TEST DOUBLE: a loopback stand-in for Hugging Face Jobs + the in-job sandbox server, so the
real `huggingface_hub.Sandbox` client (its requests, auth headers, NDJSON exec stream, ranged
file transfers, errors) can be driven without the service.

`FakeHfJobs` (in-thread, 127.0.0.1) answers the few Jobs API routes Sandbox.create/kill use:
POST /api/jobs/<ns> (run_job), GET /api/jobs/<ns>/<id> (inspect_job),
POST /api/jobs/<ns>/<id>/cancel (cancel_job). Each job starts this file as a process (the fake
"sbx-server", stdlib only) inside bubblewrap: its own PID namespace and /proc, a private /root,
/tmp, /opt and /run, the host's other files read-only, the host's network. Commands run there
for real as the server's children. Routes of the fake sbx-server (protocol 3, the subset the
client uses): GET /health, POST /v1/exec, POST|GET /v1/processes, DELETE /v1/processes/<id>,
PUT /v1/files/write, GET /v1/files/read|stat.

What it is not: HF's scheduler, images (the host's userland stands for the job image), the
Jobs proxy, idle timeout, pools, volumes. Faults for retry tests: `FakeHfJobs.fail_jobs_api`
and `FakeHfJobs.fail_sandbox_requests`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

SERVER_PORT_MARKER = "--49983."  # the SDK finds the server URL by the sandbox port in it

# ---------------------------------------------------------------------------------------------
# The fake sbx-server (runs inside bubblewrap; stdlib only)


class QuietJsonHandler(BaseHTTPRequestHandler):
    """A stand-in's request handler: no access log, and `_send` for one JSON (or bytes) answer.
    It lives here because this file must run alone inside the fake job (stdlib only)."""

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes | dict | list, content_type: str = "application/json") -> None:
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Handler(QuietJsonHandler):
    protocol_version = "HTTP/1.1"
    server: _SbxServer

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        path = url.path
        for root in ("/v1/", "/health"):  # drop the job prefix of the exposed URL
            if root in path:
                path = path[path.index(root) :]
                break
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path != "/health":
            if not self.headers.get("Authorization", "").startswith("Bearer "):
                return self._send(401, {"error": "missing bearer"})
            if self.headers.get("X-Sandbox-Token") != self.server.token:
                return self._send(403, {"error": "bad sandbox token"})
            fault = self.server.take_fault()
            if fault:
                return self._send(fault, {"error": "injected fault"})
        try:
            handler = getattr(self, f"_{method}_{path.removeprefix('/v1/').strip('/').replace('/', '_')}", None)
            if path.startswith("/v1/processes/") and method == "delete":
                return self._kill(path.rsplit("/", 1)[1])
            if handler is None:
                return self._send(404, {"error": f"no route {method} {path}"})
            return handler(query, body)
        except FileNotFoundError as exc:
            return self._send(404, {"error": str(exc)})
        except (IsADirectoryError, NotADirectoryError, PermissionError, ValueError) as exc:
            return self._send(400, {"error": str(exc)})

    def do_GET(self):
        self._route("get")

    def do_POST(self):
        self._route("post")

    def do_PUT(self):
        self._route("put")

    def do_DELETE(self):
        self._route("delete")

    # -- routes

    def _get_health(self, query, body):
        self._send(200, {"status": "ok", "protocol": 3, "version": "fake"})

    @staticmethod
    def _argv(payload: dict) -> list[str]:
        cmd = payload["cmd"]
        return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)

    def _post_exec(self, query, body):
        payload = json.loads(body)
        started = time.monotonic()
        process = subprocess.Popen(
            self._argv(payload),
            cwd=payload.get("cwd"),
            env={**os.environ, **payload.get("env", {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = process.communicate((payload.get("stdin") or "").encode(), timeout=payload.get("timeout"))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        code = process.returncode
        events = [
            {"event": "stdout", "data": out.decode(errors="replace")} if out else None,
            {"event": "stderr", "data": err.decode(errors="replace")} if err else None,
            {"event": "ping"},
            {
                "event": "exit",
                "exit_code": None if timed_out or code < 0 else code,
                "signal": -code if code < 0 else None,
                "timed_out": timed_out,
                "duration_ms": int((time.monotonic() - started) * 1000),
            },
        ]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for event in events:
            if event:
                self.wfile.write(json.dumps(event).encode() + b"\n")
                self.wfile.flush()

    def _post_processes(self, query, body):
        payload = json.loads(body)
        process = subprocess.Popen(
            self._argv(payload),
            cwd=payload.get("cwd"),
            env={**os.environ, **payload.get("env", {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        pid = f"p{process.pid}"
        self.server.processes[pid] = (process, payload["cmd"])
        threading.Thread(target=process.wait, daemon=True).start()  # reap it
        self._send(200, {"id": pid, "pid": process.pid})

    def _get_processes(self, query, body):
        self._send(
            200,
            [
                {"id": pid, "pid": p.pid, "cmd": cmd, "running": p.poll() is None, "exit_code": p.poll()}
                for pid, (p, cmd) in self.server.processes.items()
            ],
        )

    def _kill(self, pid: str):
        process, _ = self.server.processes.get(pid, (None, None))
        if process is None:
            return self._send(404, {"error": f"no process {pid}"})
        running = process.poll() is None
        if running:
            os.killpg(process.pid, signal.SIGKILL)
        self._send(200, {"killed": running})

    @staticmethod
    def _no_symlinks(path: str) -> str:
        if not path.startswith("/"):
            raise ValueError("dedicated sandbox paths are absolute")
        current = ""
        for part in os.path.normpath(path).strip("/").split("/"):
            current += "/" + part
            if os.path.islink(current):
                raise ValueError(f"symlink in path: {current}")
        return os.path.normpath(path)

    def _put_files_write(self, query, body):
        path = self._no_symlinks(query["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if "offset" in query else os.O_TRUNC), 0o644)
        try:
            os.pwrite(fd, body, int(query.get("offset", 0)))
            if "truncate_to" in query:
                os.ftruncate(fd, int(query["truncate_to"]))
        finally:
            os.close(fd)
        if "mode" in query:
            os.chmod(path, int(query["mode"], 8))
        self._send(200, {"ok": True})

    def _get_files_stat(self, query, body):
        path = self._no_symlinks(query["path"])
        st = os.stat(path)
        kind = "dir" if os.path.isdir(path) else "file"
        self._send(
            200,
            {
                "name": os.path.basename(path),
                "path": path,
                "type": kind,
                "size": st.st_size,
                "mtime_ms": int(st.st_mtime * 1000),
                "mode": oct(st.st_mode & 0o777)[2:],
            },
        )

    def _get_files_read(self, query, body):
        path = self._no_symlinks(query["path"])
        with open(path, "rb") as f:
            f.seek(int(query.get("offset", 0)))
            data = f.read(int(query["length"]) if "length" in query else -1)
        self._send(200, data, "application/octet-stream")


class _SbxServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, control_dir: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.token = os.environ.pop("SBX_TOKEN")
        self.control_dir = control_dir
        self.processes: dict[str, tuple[subprocess.Popen, object]] = {}
        self._fault_lock = threading.Lock()

    def take_fault(self) -> int | None:
        """A fault the stand-in queued in control_dir/faults ("<status> <count>")."""
        path = os.path.join(self.control_dir, "faults")
        with self._fault_lock:
            try:
                status, count = open(path).read().split()
            except (FileNotFoundError, ValueError):
                return None
            if int(count) <= 1:
                os.unlink(path)
            else:
                open(path, "w").write(f"{status} {int(count) - 1}")
            return int(status)


def _serve_sbx(control_dir: str) -> None:
    server = _SbxServer(control_dir)
    with open(os.path.join(control_dir, "port.tmp"), "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(os.path.join(control_dir, "port.tmp"), os.path.join(control_dir, "port"))
    server.serve_forever()


# ---------------------------------------------------------------------------------------------
# The fake Jobs API (in-thread in the test process)

SANDBOX_CONTROL = "/run/fake-sbx"


class _Job:
    def __init__(self, job_id: str, namespace: str, spec: dict, root: str):
        self.id, self.namespace, self.spec, self.dir = job_id, namespace, spec, root
        self.stage = "RUNNING"
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    def info(self) -> dict:
        return {
            "id": self.id,
            "owner": {"id": "0", "name": self.namespace, "type": "user"},
            "dockerImage": self.spec.get("dockerImage"),
            "command": self.spec.get("command"),
            "environment": self.spec.get("environment"),
            "flavor": self.spec.get("flavor"),
            "labels": self.spec.get("labels"),
            "status": {
                "stage": self.stage,
                "message": None,
                "exposeUrls": [f"http://127.0.0.1:{self.port}/{self.id}{SERVER_PORT_MARKER}fake"],
            },
        }


class _JobsHandler(QuietJsonHandler):
    protocol_version = "HTTP/1.1"
    server: FakeHfJobs

    def _handle(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not self.headers.get("Authorization", "").startswith("Bearer "):
            return self._send(401, {"error": "missing bearer"})
        parts = urlparse(self.path).path.strip("/").split("/")
        fake = self.server
        if parts[:1] == ["api"] and parts[1:2] == ["whoami-v2"]:
            return self._send(200, {"name": "pi-env-test", "type": "user"})
        if parts[:2] != ["api", "jobs"] or len(parts) < 3:
            return self._send(404, {"error": "no route"})
        with fake.lock:
            if fake.fail_jobs_api:
                return self._send(fake.fail_jobs_api.pop(0), {"error": "injected fault"})
        if method == "POST" and len(parts) == 3:
            try:
                started = fake.start_job(parts[2], json.loads(body))
            except RuntimeError as exc:
                return self._send(500, {"error": str(exc)})
            return self._send(200, started.info())
        job = fake.jobs.get(parts[3])
        if job is None:
            return self._send(404, {"error": "no such job"})
        if method == "GET" and len(parts) == 4:
            return self._send(200, job.info())
        if method == "POST" and parts[4:] == ["cancel"]:
            fake.stop_job(job)
            return self._send(200, job.info())
        return self._send(404, {"error": "no route"})

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")


class FakeHfJobs(ThreadingHTTPServer):
    """TEST DOUBLE of HF Jobs for huggingface_hub.Sandbox (see the module docstring).
    `endpoint` is its URL: point huggingface_hub.constants.ENDPOINT at it."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _JobsHandler)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self.jobs: dict[str, _Job] = {}
        self.lock = threading.Lock()
        self.fail_jobs_api: list[int] = []  # statuses the next Jobs API requests answer with
        self._root = tempfile.mkdtemp(prefix="pi-env-fake-hf-")
        self._thread = threading.Thread(target=self.serve_forever, name="fake-hf-jobs", daemon=True)
        # Jobs are spawned from one long-lived thread: bwrap's --die-with-parent fires when the
        # spawning *thread* ends, and a request thread ends with its connection.
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fake-hf-spawner")

    def __enter__(self) -> FakeHfJobs:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for job in list(self.jobs.values()):
            self.stop_job(job)
        self.shutdown()
        self.server_close()
        self._spawner.shutdown()
        shutil.rmtree(self._root, ignore_errors=True)

    def fail_sandbox_requests(self, job_id: str, status: int, count: int) -> None:
        """The next `count` requests to the job's sandbox server answer `status` (0: none)."""
        path = os.path.join(self.jobs[job_id].dir, "control", "faults")
        if count <= 0:
            if os.path.exists(path):
                os.unlink(path)
            return
        with open(path, "w") as f:
            f.write(f"{status} {count}")

    def running(self) -> list[_Job]:
        return [job for job in self.jobs.values() if job.stage == "RUNNING"]

    def start_job(self, namespace: str, spec: dict) -> _Job:
        job_id = secrets.token_hex(12)
        root = os.path.join(self._root, job_id)
        for sub in ("root", "control"):
            os.makedirs(os.path.join(root, sub))
        job = _Job(job_id, namespace, spec, root)
        environment = {**spec.get("environment", {}), **spec.get("secrets", {})}
        argv = [
            shutil.which("bwrap") or "bwrap",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--die-with-parent",
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
            "--bind",
            os.path.join(root, "control"),
            SANDBOX_CONTROL,
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--setenv",
            "HOME",
            "/root",
        ]
        for name, value in environment.items():
            argv += ["--setenv", name, str(value)]
        # The image's python (the test's own may live under /root, which the job hides), and
        # this file copied into the job: the checkout may sit under /tmp, hidden by its tmpfs.
        python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"
        shutil.copyfile(os.path.abspath(__file__), os.path.join(root, "control", "sbx_server.py"))
        argv += ["--", python, "-I", f"{SANDBOX_CONTROL}/sbx_server.py", SANDBOX_CONTROL]
        job.process = self._spawner.submit(
            subprocess.Popen, argv, start_new_session=True, stdin=subprocess.DEVNULL
        ).result()
        port_file = os.path.join(root, "control", "port")
        deadline = time.monotonic() + 120  # a loaded machine starts a sandbox slowly
        while not os.path.exists(port_file):
            if job.process.poll() is not None or time.monotonic() > deadline:
                self.stop_job(job)
                raise RuntimeError(f"fake sbx-server of job {job_id} did not start")
            time.sleep(0.02)
        job.port = int(open(port_file).read())
        with self.lock:
            self.jobs[job_id] = job
        return job

    def stop_job(self, job: _Job) -> None:
        job.stage = "CANCELED"
        if job.process is not None and job.process.poll() is None:
            try:
                os.killpg(job.process.pid, signal.SIGKILL)  # by the PID we started
            except ProcessLookupError:
                pass
            job.process.wait()


if __name__ == "__main__":
    _serve_sbx(sys.argv[1])
