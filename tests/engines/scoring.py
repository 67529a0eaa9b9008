"""Score and render with transformers, on the same weights and chat template the engine serves.

``score_with_transformers(model_dir, prompt_ids, completion_ids)`` returns the log-probability
of each completion token given the prompt and the completion tokens before it: what an
engine's per-token ``logprob`` should be (vLLM reports raw logprobs, before temperature).
``render_with_transformers(model_dir, messages, tools)`` returns the prompt token ids that
transformers' ``apply_chat_template`` makes (with the generation prompt).

torch and transformers live in the engine venv, not the main one. When they cannot be imported
here, the calls go to this file running under the engine venv's python (started once per
process; JSON lines on stdin and stdout), so the tests in the main venv use these helpers
unchanged.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import traceback
from functools import lru_cache
from pathlib import Path
from typing import Any


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def score_with_transformers(model_dir: str | Path, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Per-token logprobs of ``completion_ids`` after ``prompt_ids`` (float32, one forward pass)."""
    request = {"op": "score", "model_dir": str(model_dir), "prompt_ids": prompt_ids, "completion_ids": completion_ids}
    return _call(request)


def render_with_transformers(
    model_dir: str | Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Prompt ids of ``messages`` (+ ``tools``) through the model dir's chat template."""
    request = {"op": "render", "model_dir": str(model_dir), "messages": messages, "tools": tools}
    return _call(request)


def _call(request: dict[str, Any]) -> Any:
    if _have_torch():
        return _handle(request)
    return _Worker.get().call(request)


class _Worker:
    """This file running under the engine venv's python, once per process: one JSON line in,
    one JSON line out per call, so torch and the model load once, not per call."""

    _instance: _Worker | None = None

    @classmethod
    def get(cls) -> _Worker:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        from engine import ENGINE_PYTHON, ENGINES_DIR  # the engine venv (torch + transformers)

        if not ENGINE_PYTHON.exists():
            raise RuntimeError(f"no torch here and no engine venv at {ENGINE_PYTHON}: run scripts/engines/install.sh")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
        env.pop("LD_PRELOAD", None)
        self.log = ENGINES_DIR / "logs" / "scoring.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(ENGINE_PYTHON), str(Path(__file__).resolve()), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        atexit.register(self.close)

    def call(self, request: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the scoring worker died (exit {self.proc.wait()}); see {self.log}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"scoring in the engine venv failed:\n{answer['error']}")
        return answer["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve() -> None:
    """Worker loop: requests on stdin, answers on the real stdout; everything else to stderr."""
    out = sys.stdout
    sys.stdout = sys.stderr
    for line in sys.stdin:
        try:
            answer = {"result": _handle(json.loads(line))}
        except Exception:  # noqa: BLE001 - reported to the caller, which raises
            answer = {"error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


@lru_cache(maxsize=2)
def _load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return tokenizer, model


def _handle(request: dict[str, Any]) -> Any:
    if request["op"] == "score":
        return _score(request["model_dir"], request["prompt_ids"], request["completion_ids"])
    if request["op"] == "render":
        return _render(request["model_dir"], request["messages"], request.get("tools"))
    raise ValueError(f"unknown op {request['op']!r}")


def _score(model_dir: str, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    import torch

    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    _, model = _load(model_dir)
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids) - 1  # position whose logits predict the first completion token
    return [float(logprobs[start + i, tok]) for i, tok in enumerate(completion_ids)]


def _render(model_dir: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    tokenizer = _tokenizer(model_dir)
    # As vLLM does before templating: assistant tool-call arguments become dicts ({} if empty).
    messages = json.loads(json.dumps(messages))
    for message in messages:
        for call in message.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args else {}
                except json.JSONDecodeError:
                    args = {}
            fn["arguments"] = args if isinstance(args, dict) else {}
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return [int(i) for i in ids]


@lru_cache(maxsize=2)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        print(json.dumps(_handle(json.loads(sys.stdin.read()))))
