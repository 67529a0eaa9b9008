"""Value types: tasks, task files and sets, config, the endpoint catalog."""

import json

import pytest
from pydantic import BaseModel

from pi_env.config import PiConfig
from pi_env.endpoints import EndpointError, resolve_endpoint
from pi_env.task import PiTask, TaskError, load_tasks


def test_coerce_accepts_str_dict_and_task():
    from_str = PiTask.coerce("fix the bug")
    assert from_str.instruction == "fix the bug" and from_str.task_id.startswith("task-")
    from_dict = PiTask.coerce({"instruction": "x", "verify": ["true"], "task_id": "t1"})
    assert from_dict.verify == ["true"] and from_dict.task_id == "t1"
    assert PiTask.coerce(from_dict) is from_dict
    with pytest.raises(TaskError, match="cannot make a task"):
        PiTask.coerce(42)


def test_reference_aliases():
    task = PiTask.coerce({"instruction": "x", "upload_files": {"a.py": "1"}, "setup_shell": "pip install x"})
    assert task.files == {"a.py": "1"} and task.setup == ["pip install x"]


@pytest.mark.parametrize("field", ["files", "verify_files"])
@pytest.mark.parametrize("path, why", [("/etc/passwd", "absolute"), ("../escape.py", "'..'"),
                                        ("a/../../b", "'..'"), ("", "empty"), ("~/x", "absolute"), (".", "work dir itself")])
def test_file_keys_must_be_relative(field, path, why):
    with pytest.raises(TaskError) as error:
        PiTask.coerce({"instruction": "x", field: {path: "data"}})
    assert field in str(error.value) and why in str(error.value)


def test_solution_steps_are_validated():
    task = PiTask.coerce({"instruction": "x", "solution": [
        {"tool": "write", "path": "a", "content": "1"}, {"tool": "edit", "path": "a", "old": "1", "new": "2"},
        {"tool": "bash", "command": "ls"}, {"tool": "read", "path": "a"}]})
    assert [step.tool for step in task.solution] == ["write", "edit", "bash", "read"]
    with pytest.raises(TaskError, match="solution"):
        PiTask.coerce({"instruction": "x", "solution": [{"tool": "rm", "path": "a"}]})
    with pytest.raises(TaskError, match=r"solution\.0\.path|solution\[0\]\.path"):
        PiTask.coerce({"instruction": "x", "solution": [{"tool": "write", "path": "/abs", "content": ""}]})


def test_unknown_field_and_missing_instruction_are_named():
    with pytest.raises(TaskError, match="instrution"):
        PiTask.coerce({"instrution": "typo"})
    with pytest.raises(TaskError, match="instruction"):
        PiTask.coerce({"verify": ["true"]})


def test_task_files_and_sets(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps({"task_id": "a", "instruction": "x"}))
    assert PiTask.from_file(tmp_path / "one.json").task_id == "a"
    jsonl = tmp_path / "set.jsonl"
    jsonl.write_text('{"task_id": "a", "instruction": "x"}\n\n{"task_id": "b", "instruction": "y"}\n')
    assert [t.task_id for t in load_tasks(jsonl)] == ["a", "b"]
    jsonl.write_text('{"task_id": "a", "instruction": "x"}\n{"task_id": "b", "instruction": \n')
    with pytest.raises(TaskError, match=r"set\.jsonl:2: not valid JSON"):
        load_tasks(jsonl)
    jsonl.write_text('{"task_id": "a", "instruction": "x"}\n{"task_id": "a", "instruction": "y"}\n')
    with pytest.raises(TaskError, match="appears twice"):
        load_tasks(jsonl)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(TaskError, match="one JSON object"):
        PiTask.from_file(tmp_path / "bad.json")
    with pytest.raises(TaskError, match="no such task file"):
        PiTask.from_file(tmp_path / "missing.json")


def test_bundled_examples_load():
    tasks = load_tasks("examples")
    assert len(tasks) >= 4 and all(task.solution and task.verify for task in tasks)
    assert any(task.verify_files for task in tasks)


def test_config_hides_the_key():
    config = PiConfig(endpoint={"name": "openai", "api_key": "sk-secret-123"})
    assert "sk-secret-123" not in repr(config) and config.redacted()["endpoint"]["api_key"] == "***"
    with pytest.raises(ValueError, match="unknown Pi tools"):
        PiConfig(agent={"pi": {"tools": ["read", "browser"]}})


def test_endpoint_catalog_precedence(monkeypatch):
    monkeypatch.setenv("VLLM_URL", "http://127.0.0.2:9000")
    monkeypatch.setenv("VLLM_MODEL", "qwen")
    endpoint = resolve_endpoint(PiConfig(endpoint="vllm"))
    assert endpoint.base_url == "http://127.0.0.2:9000/v1" and endpoint.model == "qwen" and endpoint.disable_thinking
    explicit = resolve_endpoint(PiConfig(
        endpoint={"name": "vllm", "base_url": "http://127.0.0.1:8001/v1", "model": "m"},
    ))
    assert explicit.base_url == "http://127.0.0.1:8001/v1" and explicit.model == "m"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(EndpointError, match="OPENAI_API_KEY"):
        resolve_endpoint(PiConfig(endpoint="openai"))
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    hf = resolve_endpoint(PiConfig(endpoint={"name": "hf_router", "model": "org/model"}))
    assert hf.api_key == "hf_x" and hf.base_url == "https://router.huggingface.co/v1"
    assert hf.max_top_logprobs == 5 and hf.return_token_ids is False
    raw = resolve_endpoint(PiConfig(endpoint={"name": "http://127.0.0.1:5000", "model": "m"}))
    assert raw.base_url == "http://127.0.0.1:5000/v1"
    with pytest.raises(EndpointError, match="unknown endpoint"):
        resolve_endpoint(PiConfig(endpoint="nope"))
    with pytest.raises(EndpointError, match="--model"):
        resolve_endpoint(PiConfig(endpoint="http://127.0.0.1:5000"))


def test_every_config_field_says_what_it_is():
    """Each PiConfig field, in every section and mode, carries a docstring (its description: the
    API page and --help show it)."""
    from pi_env.config import MODES, PiConfig

    models = [PiConfig, *MODES.values()]
    undocumented = []
    while models:
        model = models.pop()
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                undocumented.append(f"{model.__name__}.{name}")
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                models.append(field.annotation)
    assert not undocumented, f"PiConfig fields without a docstring: {undocumented}"


def test_run_help_shows_the_config_fields_own_words():
    import subprocess
    import sys

    from pi_env.config import EndpointSettings

    shown = subprocess.run([sys.executable, "-m", "pi_env.cli", "run", "--help"], capture_output=True, text=True,
                           timeout=60).stdout
    flat = " ".join(shown.split())
    assert "upstream key" in flat and " ".join(EndpointSettings.model_fields["model"].description.split()) in flat


def test_max_tokens_is_the_one_cap_and_the_old_second_knob_still_loads():
    assert "proxy_max_tokens_cap" not in PiConfig.model_fields
    # The smaller of the two was in force before they were one knob, so an old config keeps it.
    for given, expected in [({"proxy_max_tokens_cap": 64}, 64),
                            ({"gateway": {"max_tokens": 48}, "proxy_max_tokens_cap": 96}, 48),
                            ({"gateway": {"max_tokens": 300}, "proxy_max_tokens_cap": 200}, 200)]:
        with pytest.warns(DeprecationWarning, match="max_tokens is the one cap"):
            config = PiConfig(**given)
        assert config.gateway.max_tokens == expected == config.proxy_max_tokens_cap
        assert "proxy_max_tokens_cap" not in config.model_dump()
    with pytest.raises(ValueError, match="greater than 0"), pytest.warns(DeprecationWarning):
        PiConfig(proxy_max_tokens_cap=0)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/#", "http://127.0.0.1:9/v1?x=", "ftp://127.0.0.1/v1", "http:///v1",
                                 ["http://127.0.0.1:9/v1", "http://127.0.0.1:8/#"]])
def test_a_base_url_the_api_path_cannot_be_joined_to_is_refused(url):
    """`http://host/#` would swallow the gateway's /chat/completions: the call (and the key) would
    go to http://host/. Refused with what to give instead."""
    with pytest.raises(ValueError, match="no \\? or #"):
        PiConfig(endpoint={"base_url": url})
    assert PiConfig(endpoint={"base_url": "http://user:pw@127.0.0.1:9/v1"}).endpoint.base_url  # user:password stays the operator's choice
