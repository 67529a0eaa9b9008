"""The `hf` backend: Hugging Face sandboxes (`huggingface_hub.Sandbox`, one HF Job per sandbox),
driven through remote.py. Needs `pi-env[hf]` and an HF token (HF_TOKEN or `hf auth login`).

Settings (constructor arguments, else environment): image PI_ENV_HF_IMAGE (default
python:3.12: it needs sh, bash, GNU coreutils/grep/tar and /proc), flavor PI_ENV_HF_FLAVOR
(cpu-basic), namespace PI_ENV_HF_NAMESPACE (the token's user), lifetime PI_ENV_REMOTE_LIFETIME_S.

Lifetime: the SDK fixes the Job's own timeout at 24 h, so the hard lifetime is a watchdog inside
the sandbox (kills every command at the deadline) plus the service-side idle timeout, which then
stops the Job: at most lifetime + idle timeout after a client crash. Every Job carries the labels
`pi-env=1` and `pi-env-sandbox=<id>`: list leftovers with `hf jobs ps` filtered on them.
"""

from __future__ import annotations

import os

from pi_env.sandbox.base import SandboxSpec, SandboxUnavailable
from pi_env.sandbox.remote import DEFAULT_LIFETIME_S, RemoteSandbox, Retrying, open_sandbox, remote_gateway_url

TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
IDLE_TIMEOUT_S = 300


def _sdk():
    try:
        import huggingface_hub
        from huggingface_hub import Sandbox  # noqa: F401  (>= 1.29)
    except ImportError as exc:
        raise SandboxUnavailable(
            "the hf backend needs huggingface_hub>=1.29 with its Sandbox API: pip install 'pi-env[hf]'"
        ) from exc
    return huggingface_hub


def transient(exc: BaseException) -> bool:
    """Connection-level failures and 429/502/503/504: retried. A command's own failure never is."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, SandboxCommandError, SandboxError

    if isinstance(exc, httpx2.TransportError):
        return True
    if isinstance(exc, SandboxCommandError):
        return False
    if isinstance(exc, SandboxError):
        return exc.status_code in TRANSIENT_STATUS or (exc.status_code is None and "connection lost" in str(exc))
    if isinstance(exc, HfHubHTTPError):
        return exc.response is not None and exc.response.status_code in TRANSIENT_STATUS
    return False


class HfSession:
    """remote.RemoteSession over one huggingface_hub Sandbox."""

    def __init__(self, sandbox):
        self._sandbox = sandbox
        self.id = sandbox.id

    def run(self, script: str, timeout_s: float) -> tuple[int | None, str]:
        result = self._sandbox.run(["/bin/sh", "-c", script], timeout=timeout_s, check=False)
        return (None if result.timed_out else result.exit_code), result.stdout

    def spawn(self, script_path: str) -> None:
        self._sandbox.run(["/bin/sh", script_path], background=True)

    def upload(self, path: str, data: bytes) -> None:
        self._sandbox.files.write(path, data)

    def download(self, path: str) -> bytes:
        return self._sandbox.files.read(path)

    def destroy(self) -> None:
        self._sandbox.kill()  # cancels the Job; idempotent
        if not self._sandbox._killed:  # the SDK logs and swallows a failed cancel: surface it
            raise RuntimeError(f"cancelling HF sandbox job {self.id} failed")


class HfSandboxBackend:
    name = "hf"

    def __init__(
        self,
        *,
        image: str | None = None,
        flavor: str | None = None,
        namespace: str | None = None,
        token: str | None = None,
        lifetime_s: float | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        labels: dict[str, str] | None = None,
        retrying: Retrying | None = None,
        gateway_url: str | None = None,
    ):
        hub = _sdk()
        self.token = token
        if not (token or hub.get_token()):
            raise SandboxUnavailable("the hf backend needs a Hugging Face token: set HF_TOKEN or run `hf auth login`")
        self.image = image or os.environ.get("PI_ENV_HF_IMAGE", "python:3.12")
        self.flavor = flavor or os.environ.get("PI_ENV_HF_FLAVOR", "cpu-basic")
        self.namespace = namespace or os.environ.get("PI_ENV_HF_NAMESPACE") or None
        self.lifetime_s = float(lifetime_s or os.environ.get("PI_ENV_REMOTE_LIFETIME_S", str(DEFAULT_LIFETIME_S)))
        self.idle_timeout_s = idle_timeout_s
        self.labels = dict(labels or {})
        self.gateway_url = remote_gateway_url(gateway_url)
        self.retrying = retrying or Retrying(transient)

    def create(self, spec: SandboxSpec) -> RemoteSandbox:
        from huggingface_hub import Sandbox

        return open_sandbox(
            spec,
            lambda labels: HfSession(
                Sandbox.create(
                    self.image,
                    flavor=self.flavor,
                    idle_timeout=int(self.idle_timeout_s),
                    namespace=self.namespace,
                    labels=labels,
                    token=self.token,
                )
            ),
            labels=self.labels,
            retrying=self.retrying,
            gateway_url=self.gateway_url,
            watchdog_s=self.lifetime_s,
        )
