"""PiConfig in sections: every old flat key has one home and still loads (with a warning naming
it), a mode-only setting exists only in its mode, one default per setting, saved flat configs
load, secrets stay hidden, and the command line's flags are the ones they were."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from pi_env.config import FLAT_KEYS, MODES, PiConfig, modes_with

FIXTURES = Path(__file__).parent / "fixtures" / "config"
SRC = Path(__file__).parent.parent / "src" / "pi_env"
# A value for each flat key that differs from its default (so it cannot be dropped as one).
SAMPLE = {
    "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-x", "model": "m", "pi_package": "@x/pi",
    "pi_version": "0.9.0", "node_version": "20.0.0", "provider_name": "p", "system_prompt": "s",
    "append_system_prompt": "a", "tools": ["read"], "thinking": "low", "context_window": 1000,
    "max_tokens": 256, "max_turns": 3, "setup_timeout_s": 5, "agent_timeout_s": 6, "verify_timeout_s": 7,
    "max_processes": 64, "max_memory_bytes": 1 << 30, "max_file_bytes": 1 << 20,
    "max_total_memory_bytes": 1 << 30, "max_disk_bytes": 1 << 30, "max_read_bytes": 1 << 20,
    "extra_env": {"A": "1"}, "extra_setup_shell": ["true"], "sandbox_backend": "podman",
    "runtime_cache_dir": "/c", "max_total_tokens": 99, "upstream_connect_timeout_s": 3,
    "upstream_read_timeout_s": 4, "gate_timeout_s": 8, "gateway_max_request_bytes": 1 << 17,
    "gateway_max_concurrent_calls": 2, "gateway_allow_fields": ["ignore_eos"],
    "gateway_session_header": "X-S", "gateway_cache_salt": True, "policy_version": 3,
    "policy_version_header": "X-Policy-Version", "proxy_top_logprobs": 3, "proxy_disable_thinking": True,
    "proxy_logprobs": False, "proxy_return_token_ids": True, "proxy_sampling": {"temperature": 0.0},
    "trace_dir": "/t", "proxy_token_in": True, "proxy_renderer": "qwen3", "proxy_tokenizer": "/tok",
    "result_max_files": 3, "result_max_file_bytes": 10, "keep_workdir": True, "keep_workdir_max_files": 5,
    "keep_workdir_max_bytes": 50,
}


def at(config: BaseModel, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def test_every_old_key_has_a_sample():
    assert set(SAMPLE) == set(FLAT_KEYS)


@pytest.mark.parametrize("key", sorted(FLAT_KEYS))
def test_each_flat_key_loads_into_its_section_with_a_warning_naming_it(key):
    path = FLAT_KEYS[key]
    owners = modes_with(path.split(".")[1]) if path.startswith("mode.") else []
    mode = {"mode": owners[0]} if owners else {}
    with pytest.warns(DeprecationWarning) as caught:
        config = PiConfig(**mode, **{key: SAMPLE[key]})
    messages = [str(w.message) for w in caught if "flat keys" in str(w.message)]
    assert len(messages) == 1 and f"{key} -> {path}" in messages[0]
    assert at(config, path) == SAMPLE[key]
    with pytest.warns(DeprecationWarning, match=rf"PiConfig\.{key} is deprecated: read config\.{re.escape(path)}"):
        assert getattr(config, key) == SAMPLE[key]  # a trainer's old read still works


def test_one_warning_names_every_old_key():
    with pytest.warns(DeprecationWarning) as caught:
        config = PiConfig(mode="transparent_proxy", proxy_top_logprobs=3, max_tokens=256, agent_timeout_s=9)
    assert len(caught) == 1
    assert all(f"{k} -> {p}" in str(caught[0].message) for k, p in [
        ("proxy_top_logprobs", "mode.top_logprobs"), ("max_tokens", "gateway.max_tokens"),
        ("agent_timeout_s", "limits.agent_timeout_s")])
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert (config.mode.top_logprobs, config.gateway.max_tokens, config.limits.agent_timeout_s) == (3, 256, 9)


def test_the_sectioned_form_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = PiConfig(endpoint="vllm", agent="codex", mode="transparent_proxy",
                          gateway={"max_tokens": 256})
    assert (config.endpoint.name, config.agent.name, config.mode.name) == ("vllm", "codex", "transparent_proxy")
    assert config.mode == "transparent_proxy" and config.endpoint == "vllm"  # the shorthand still compares


@pytest.mark.parametrize("key", sorted(k for k, p in FLAT_KEYS.items() if p.startswith("mode.")))
def test_a_mode_only_key_under_another_mode_says_where_it_belongs(key):
    field = FLAT_KEYS[key].split(".")[1]
    owners = modes_with(field)
    other = next(name for name in MODES if name not in owners)
    with pytest.raises(ValidationError, match=rf"{key} is a setting of {' and '.join(owners)} \(mode\.{field}\), "
                                              rf"not of {other}"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        PiConfig(mode=other, **{key: SAMPLE[key]})
    with pytest.raises(ValidationError, match=rf"mode\.{field} is a setting of {' and '.join(owners)}"):
        PiConfig(mode={"name": other, field: SAMPLE[key]})


def test_which_modes_honour_which_settings():
    assert set(MODES["black_box"].model_fields) == {"name"}
    shared = {"sampling", "trace_dir", "token_in", "renderer", "tokenizer"}
    assert set(MODES["transparent_proxy"].model_fields) == {"name", *shared, "top_logprobs", "disable_thinking",
                                                            "logprobs", "return_token_ids", "cache_salt"}
    assert set(MODES["interception_gate"].model_fields) == {"name", *shared, "gate_timeout_s"}


def test_switching_mode_keeps_the_settings_both_modes_have():
    config = PiConfig(mode={"name": "transparent_proxy", "sampling": {"seed": 1}, "trace_dir": "/t"})
    gate = config.in_mode("interception_gate")
    assert (gate.mode.name, gate.mode.sampling, gate.mode.trace_dir) == ("interception_gate", {"seed": 1}, "/t")
    assert config.mode.name == "transparent_proxy"  # a copy
    with pytest.warns(DeprecationWarning, match="read config.mode.top_logprobs"):
        assert PiConfig().proxy_top_logprobs == 5  # what the flat field held in a mode that ignored it


def test_one_default_per_setting():
    """Each default is written once: max_tokens' 4096 in config.py (DEFAULT_MAX_TOKENS), which
    the field, --help and run_rollout read; the gateway takes it as the session's one cap."""
    hits = [f"{path.relative_to(SRC)}" for path in SRC.rglob("*.py")
            for line in path.read_text().splitlines() if re.search(r"\b4096\b", line) and "max_tokens" in line.lower()]
    assert sorted(hits) == ["config.py"], hits
    # the settings both capturing modes have are declared once, in their shared base
    from pi_env.config import _Capturing

    shared = {name for name in vars(_Capturing)["__annotations__"] if name in _Capturing.model_fields}
    assert shared == {"sampling", "trace_dir", "token_in", "renderer", "tokenizer"}
    assert not any(shared & set(vars(mode).get("__annotations__", {})) for mode in MODES.values())


def test_a_saved_flat_config_loads_to_an_equal_config():
    """Configs `redacted()` wrote into records and dataset cards before the sections (made with
    the code of aff8787) load, with a warning, to the config they described."""
    saved = json.loads((FIXTURES / "redacted_flat_aff8787.json").read_text())
    expected = {
        "default": PiConfig(),
        "transparent_proxy": PiConfig(
            endpoint={"name": "vllm", "base_url": "http://***@10.0.0.1:8000/v1", "api_key": "***",
                      "model": "Qwen/Qwen3-8B"},
            agent={"thinking": "low", "pi": {"tools": ["read", "bash"]}},
            limits={"agent_timeout_s": 120},
            gateway={"max_tokens": 256, "max_turns": 12, "policy_version": 3},
            mode={"name": "transparent_proxy", "top_logprobs": 3, "sampling": {"temperature": 0.0, "seed": 7},
                  "trace_dir": "/data/traces", "cache_salt": True, "token_in": True, "renderer": "qwen3"},
            sandbox={"backend": "podman", "extra_env": {"A": "1"}},
            result={"keep_workdir": True},
        ),
        "interception_gate": PiConfig(agent="codex", mode={"name": "interception_gate", "gate_timeout_s": 30,
                                                           "sampling": {"top_p": 0.9}}),
    }
    for name, flat in saved.items():
        with pytest.warns(DeprecationWarning, match="flat keys are deprecated"):
            loaded = PiConfig.model_validate(flat)
        assert loaded == expected[name], name
        assert PiConfig.model_validate_json(loaded.model_dump_json()) == loaded  # the new form round-trips


def test_redacted_hides_the_key_and_url_credentials():
    config = PiConfig(endpoint={"name": "http://u:pw@10.0.0.1:8000/v1,http://u:pw@10.0.0.2:8000/v1",
                                "base_url": "http://user:secret@h:1/v1", "api_key": "sk-secret", "model": "m"})
    text = json.dumps(config.redacted()) + repr(config)
    assert "sk-secret" not in text and "secret" not in text and "pw" not in text
    assert config.redacted()["endpoint"]["api_key"] == "***"
    assert config.redacted()["endpoint"]["base_url"] == "http://***@h:1/v1"


def test_the_command_lines_flags_are_the_ones_they_were():
    """The flag names of every command, as they were before the sections (aff8787)."""
    script = """
import argparse, json, sys
from pi_env import cli
class Stop(Exception): pass
def grab(self, args=None, namespace=None):
    sys.modules[__name__].parser = self
    raise Stop
argparse.ArgumentParser.parse_args = grab
try:
    cli.main(["run", "x"])
except Stop:
    pass
sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
print(json.dumps({name: sorted(",".join(a.option_strings) or a.dest for a in p._actions)
                  for name, p in sub.choices.items()}))
"""
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(shown.stdout) == json.loads((FIXTURES / "cli_flags_aff8787.json").read_text())


def test_the_command_line_builds_the_sectioned_config(tmp_path):
    import argparse

    from pi_env.arguments import config_from_args

    args = argparse.Namespace(endpoint="vllm", base_url=None, model="m", api_key=None, backend="local",
                              agent="pi", agent_version=None, max_tokens=64, sampling="temperature=0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        config = config_from_args(args, mode=None, gateway={"max_turns": 4}, mode_settings={"trace_dir": "/t"})
    assert (config.mode.name, config.mode.sampling, config.mode.trace_dir) == ("transparent_proxy",
                                                                                {"temperature": 0}, "/t")
    assert (config.gateway.max_tokens, config.gateway.max_turns, config.endpoint.model) == (64, 4, "m")
    args.sampling = None  # black_box has no trace dir: --trace-dir is ignored there, as it always was
    assert config_from_args(args, mode_settings={"trace_dir": "/t"}).mode.name == "black_box"
    with pytest.raises(ValueError, match="--token-in renders at the gateway, which black_box never does"):
        config_from_args(args, mode_settings={"token_in": True})


def test_an_old_flat_assignment_changes_only_its_config():
    config = PiConfig(mode="transparent_proxy")
    copy = config.model_copy()
    with pytest.warns(DeprecationWarning, match="set config.gateway.max_tokens"):
        copy.max_tokens = 7
    with pytest.warns(DeprecationWarning, match="set config.mode.top_logprobs"):
        copy.proxy_top_logprobs = 2
    assert (copy.gateway.max_tokens, copy.mode.top_logprobs) == (7, 2)
    assert (config.gateway.max_tokens, config.mode.top_logprobs) == (4096, 5)
    with pytest.raises(ValidationError), pytest.warns(DeprecationWarning):
        copy.max_tokens = 0  # checked like the field
    with pytest.raises(ValueError, match="gate_timeout_s is a setting of interception_gate"), \
            pytest.warns(DeprecationWarning):
        copy.gate_timeout_s = 5


def test_a_copys_section_is_its_own():
    config = PiConfig(mode="transparent_proxy")
    copy = config.model_copy()
    copy.gateway.max_tokens, copy.mode.top_logprobs = 7, 2
    assert (config.gateway.max_tokens, config.mode.top_logprobs) == (4096, 5)


def test_switching_away_from_a_setting_the_new_mode_lacks_is_refused():
    salted = PiConfig(mode={"name": "transparent_proxy", "cache_salt": True})
    with pytest.raises(ValueError, match="mode.cache_salt is a setting of transparent_proxy, not of black_box"):
        salted.in_mode("black_box")
    assert PiConfig(mode="transparent_proxy").in_mode("black_box").mode.name == "black_box"  # defaults only


def test_the_dataset_card_reads_a_saved_config_in_either_shape(tmp_path):
    from pi_env.collect.card import build_card

    saved = json.loads((FIXTURES / "redacted_flat_aff8787.json").read_text())["transparent_proxy"]
    for config in (saved, PiConfig(endpoint="vllm", mode="transparent_proxy", agent={"pi": {"version": "1.5.0"}})
                   .redacted()):
        (tmp_path / "metadata.json").write_text(json.dumps({"config": config}))
        card = build_card(tmp_path)
        assert "endpoint: `vllm`" in card and "mode: `transparent_proxy`" in card
        assert f"Pi {config.get('pi_version') or '1.5.0'}" in card
