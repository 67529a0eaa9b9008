"""The engine tier's scripts refuse bad input with what to fix, before starting anything (they
need no engine installed for that; serving a checkpoint is tested in tests/engines)."""

import subprocess
from pathlib import Path

SERVE_VLLM = Path(__file__).resolve().parents[1] / "scripts" / "engines" / "serve_vllm.sh"


def serve_vllm(tmp_path, *args):
    done = subprocess.run(["bash", str(SERVE_VLLM), *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "PI_ENV_ENGINES_DIR": str(tmp_path / "engines")})
    return done.returncode, done.stderr


def test_serve_vllm_model_must_be_a_model_directory(tmp_path):
    code, err = serve_vllm(tmp_path, "--model", str(tmp_path), "--served-name", "mine")
    assert code == 1 and f"--model {tmp_path}: no config.json there" in err


def test_serve_vllm_model_without_a_chat_template_asks_for_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "x"}')
    code, err = serve_vllm(tmp_path, "--model", str(tmp_path))
    assert code == 1 and "pass --chat-template FILE" in err
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    code, err = serve_vllm(tmp_path, "--model", str(tmp_path))  # now only the missing engine stops it
    assert code == 1 and "vLLM is not installed" in err


def test_serve_vllm_unknown_option_is_named(tmp_path):
    code, err = serve_vllm(tmp_path, "--modle", "x")
    assert code == 1 and "unknown option '--modle'" in err
