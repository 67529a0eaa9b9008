"""Start, reach and stop the real engines of the engine tier, for fixtures and for people.

Everything lives in .engines/ (or $PI_ENV_ENGINES_DIR), installed by
scripts/engines/install.sh. The shell scripts in scripts/engines/ hold the engines' command
lines; this module only calls them, so a person and the tests start the same server.

Reuse for other tests (e.g. the proxy tier): take the session fixture ``vllm_engine`` from
tests/engines/conftest.py, an :class:`Engine` with ``base_url``, ``model`` and ``model_dir``.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from helpers import free_port  # tests/ is on the path: its conftest.py is loaded first

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "engines"
ENGINES_DIR = Path(os.environ.get("PI_ENV_ENGINES_DIR") or ROOT / ".engines")
MODEL_NAME = "smollm2-135m-instruct"
MODEL_DIR = ENGINES_DIR / "models" / MODEL_NAME
VLLM_VENV = ENGINES_DIR / "vllm-venv"
# The engine venv's python: it has torch + transformers, which the main venv does not.
ENGINE_PYTHON = VLLM_VENV / "bin" / "python"
LLAMA_VENV = ENGINES_DIR / "llama-venv"
# What llama.cpp serves: the Q4_1 GGUF that MODEL_DIR was dequantized from.
GGUF = ENGINES_DIR / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Engine:
    """A running OpenAI-compatible engine serving MODEL_NAME."""

    kind: str  # "vllm" or "llama.cpp"
    base_url: str  # http://127.0.0.1:PORT/v1, what a client (or the gateway) is pointed at
    model: str  # the served model name, for the request's "model" field
    model_dir: Path  # config + tokenizer + safetensors + chat_template.jinja (scoring, templates)
    pid: int | None  # None when the engine was started elsewhere (ENGINE_BASE_URL)
    log: Path | None = None

    @property
    def root_url(self) -> str:
        """The server root (for /health, /tokenize, /detokenize)."""
        return self.base_url.removesuffix("/v1")


def eos_token_ids(model_dir: Path = MODEL_DIR) -> set[int]:
    """The ids that end a turn (generation_config's eos_token_id, an int or a list)."""
    eos = json.loads((Path(model_dir) / "generation_config.json").read_text())["eos_token_id"]
    return set(eos if isinstance(eos, list) else [eos])


def vllm_missing() -> str | None:
    """Why the vLLM engine cannot be started here, or None when it is installed."""
    if not (VLLM_VENV / ".installed").is_file():
        return f"vLLM is not installed in {VLLM_VENV} (run: make test-engines, or bash scripts/engines/install.sh)"
    if not (MODEL_DIR / ".installed").is_file():
        return f"the converted model is not in {MODEL_DIR} (run: bash scripts/engines/install.sh)"
    return None


def llama_missing() -> str | None:
    """Why llama-server cannot be started here, or None when it is built."""
    if not (LLAMA_VENV / ".installed").is_file():
        return f"llama-server is not built in {LLAMA_VENV} (run: bash scripts/engines/install.sh llama)"
    if not GGUF.is_file():
        return f"{GGUF} is missing (run: bash scripts/engines/install.sh)"
    return None


def start_vllm(port: int | None = None, timeout_s: int = 300, log: Path | None = None, *,
               model_dir: Path | None = None, served_name: str | None = None) -> Engine:
    """Start vLLM via serve_vllm.sh and return once /health answers. Stop it with :func:`stop`.

    The log goes to .engines/logs/vllm-tier.log unless ``log`` says otherwise (overwritten at
    each start). ``model_dir``/``served_name``: serve another checkpoint (--model, --served-name)."""
    extra = [*(["--model", str(model_dir)] if model_dir else []), *(["--served-name", served_name] if served_name else [])]
    engine = _start("vllm", "serve_vllm.sh", port, timeout_s, log or ENGINES_DIR / "logs" / "vllm-tier.log", extra)
    if model_dir or served_name:
        engine = replace(engine, model=served_name or Path(model_dir).name, model_dir=Path(model_dir or MODEL_DIR))
    return engine


def start_llama(port: int | None = None, timeout_s: int = 120, log: Path | None = None) -> Engine:
    """Start llama.cpp's llama-server via serve_llama.sh (log: .engines/logs/llama-tier.log).

    Its ``model_dir`` is the converted model: the same weights, dequantized, for scoring."""
    return _start("llama.cpp", "serve_llama.sh", port, timeout_s, log or ENGINES_DIR / "logs" / "llama-tier.log")


def _start(kind: str, script: str, port: int | None, timeout_s: int, log: Path, extra: list[str] = ()) -> Engine:
    port = port or free_port()
    proc = subprocess.run(
        ["bash", str(SCRIPTS / script), "--port", str(port), "--timeout", str(timeout_s), "--log", str(log), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout_s + 60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} did not start (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    pid = int(proc.stdout.strip().splitlines()[-1])
    return Engine(kind, f"http://127.0.0.1:{port}/v1", MODEL_NAME, MODEL_DIR, pid, log)


def stop(engine: Engine) -> None:
    """Stop an engine this process started, by its PID (and its process group)."""
    if engine.pid is None:
        return
    subprocess.run(["bash", str(SCRIPTS / "stop_engine.sh"), str(engine.pid)], check=False, timeout=120)


# --- a small OpenAI-compatible HTTP client (stdlib only: runs in the main venv) ------------


def post_json(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"POST {url} -> {exc.code}: {exc.read().decode(errors='replace')[:2000]}") from None


def get_json(url: str, timeout: float = 30) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def stream_sse(url: str, body: dict[str, Any], timeout: float = 300) -> Iterator[dict[str, Any]]:
    """POST a streaming request; yield each `data:` event's JSON until `[DONE]`."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"POST {url} -> {exc.code}: {exc.read().decode(errors='replace')[:2000]}") from None
    with resp:
        for raw in resp:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    raise AssertionError(f"stream from {url} ended without [DONE]")


# Lines the tests want shown at the end of the run (measured numbers); conftest prints them.
NOTES: list[str] = []
