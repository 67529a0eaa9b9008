"""The `e2b` backend: E2B sandboxes (PyPI `e2b`), driven through remote.py. Needs `pi-env[e2b]`
and an API key (E2B_API_KEY).

Settings (constructor arguments, else environment): template PI_ENV_E2B_TEMPLATE (default
"base": it needs sh, bash, GNU coreutils/grep/tar and /proc; build a template with the Pi runtime
unpacked at /opt/pi-env/runtime to skip the per-sandbox upload), lifetime
PI_ENV_REMOTE_LIFETIME_S; any other `e2b` connection option (domain, api_url, sandbox_url,
http_version, ...) as keyword arguments.

Egress: E2B's network rules, per phase. A sandbox is created with all egress denied; before a
command whose network mode differs from the last one's, the rules are replaced
(`Sandbox.update_network`): "full" (setup with network) the service's default, "gateway" (the
agent) only the gateway URL's host, "none" (verify) nothing.

Lifetime: E2B's own sandbox timeout, set at create: the service deletes the sandbox then, so a
crashed client leaks nothing beyond it. Every sandbox carries the metadata `pi-env=1` and
`pi-env-sandbox=<id>`: list leftovers with Sandbox.list filtered on it.
"""

from __future__ import annotations

import os

from pi_env.sandbox.base import Network, SandboxSpec, SandboxUnavailable
from pi_env.sandbox.remote import DEFAULT_LIFETIME_S, RemoteSandbox, Retrying, open_sandbox, remote_gateway_url

TRANSIENT_STATUS = frozenset({429, 502, 503, 504})


def transient(exc: BaseException) -> bool:
    """Connection-level failures, rate limits and 502/503/504: retried. A command's own
    failure never is (CommandExitException is not even raised: run() reads the exit code)."""
    import httpx
    from e2b.exceptions import RateLimitException

    if isinstance(exc, (httpx.TransportError, RateLimitException, ConnectionError)):
        return True
    try:
        from connectrpc.code import Code
        from connectrpc.errors import ConnectError

        if isinstance(exc, ConnectError):
            return exc.code in (Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED)
    except ImportError:
        pass
    message = str(exc)
    return any(f"{status}:" in message or f"({status})" in message for status in TRANSIENT_STATUS)


class E2BSession:
    """remote.RemoteSession over one e2b Sandbox."""

    def __init__(self, sandbox):
        self._sandbox = sandbox
        self.id = sandbox.sandbox_id

    def run(self, script: str, timeout_s: float) -> tuple[int | None, str]:
        from e2b.sandbox.commands.command_handle import CommandExitException

        try:
            result = self._sandbox.commands.run(script, timeout=timeout_s)
        except CommandExitException as exc:  # a nonzero exit is an answer, not an error
            return exc.exit_code, exc.stdout
        return result.exit_code, result.stdout

    def spawn(self, script_path: str) -> None:
        handle = self._sandbox.commands.run(f"/bin/sh {script_path}", background=True, timeout=0)
        handle.disconnect()  # the command keeps running; remote.py follows it through files

    def upload(self, path: str, data: bytes) -> None:
        self._sandbox.files.write(path, data)

    def download(self, path: str) -> bytes:
        return bytes(self._sandbox.files.read(path, format="bytes"))

    def destroy(self) -> None:
        self._sandbox.kill()

    def set_network(self, network: Network, gateway_host: str | None) -> None:
        """E2B's egress rules for the commands that follow (they replace the previous ones):
        "full" the service's default (open); "gateway" only the gateway's host; "none" nothing."""
        from e2b import ALL_TRAFFIC

        if network == "full":
            rules = {}
        elif network == "gateway" and gateway_host:
            rules = {"deny_out": [ALL_TRAFFIC], "allow_out": [gateway_host]}
        else:
            rules = {"deny_out": [ALL_TRAFFIC]}
        self._sandbox.update_network(rules)


class E2BSandboxBackend:
    name = "e2b"

    def __init__(
        self,
        *,
        template: str | None = None,
        lifetime_s: float | None = None,
        labels: dict[str, str] | None = None,
        retrying: Retrying | None = None,
        gateway_url: str | None = None,
        **connection,
    ):
        try:
            import e2b  # noqa: F401
        except ImportError as exc:
            raise SandboxUnavailable("the e2b backend needs the e2b SDK: pip install 'pi-env[e2b]'") from exc
        if not (connection.get("api_key") or os.environ.get("E2B_API_KEY")):
            raise SandboxUnavailable("the e2b backend needs an API key: set E2B_API_KEY")
        self.template = template or os.environ.get("PI_ENV_E2B_TEMPLATE", "base")
        self.lifetime_s = float(lifetime_s or os.environ.get("PI_ENV_REMOTE_LIFETIME_S", str(DEFAULT_LIFETIME_S)))
        self.labels = dict(labels or {})
        self.gateway_url = remote_gateway_url(gateway_url)
        self.connection = connection
        self.retrying = retrying or Retrying(transient)

    def create(self, spec: SandboxSpec) -> RemoteSandbox:
        from e2b import ALL_TRAFFIC, Sandbox

        # No egress until a command's network mode opens it (E2BSession.set_network).
        return open_sandbox(
            spec,
            lambda metadata: E2BSession(
                Sandbox.create(
                    self.template,
                    timeout=int(self.lifetime_s),
                    metadata=metadata,
                    network={"deny_out": [ALL_TRAFFIC]},
                    **self.connection,
                )
            ),
            labels=self.labels,
            retrying=self.retrying,
            gateway_url=self.gateway_url,
            watchdog_s=None,
        )  # E2B's own timeout is the lifetime
