"""The `GET /version` probe that decides `return_token_ids`: made only when transparent_proxy
needs it, retried after a failure (an engine still starting), and reported in the result."""

import socket

import pytest

from helpers import scripted_config
from pi_env import PiTask, run_rollout
from pi_env import endpoints
from pi_env.endpoints import Endpoint, supports_return_token_ids
from pi_env.scripted import ScriptedServer, ScriptedTurn

TASK = PiTask(task_id="probe", instruction="x", verify=["true"])


def version_probes(server) -> int:
    return server.version_probes


@pytest.fixture(autouse=True)
def fresh_probe_cache(monkeypatch):
    monkeypatch.setattr(endpoints, "_probed", {})


@pytest.mark.needs_bwrap
def test_black_box_never_probes_and_transparent_proxy_reports_its_decision(server):
    key = server.add_script([ScriptedTurn(text="done")])
    plain = run_rollout(TASK, scripted_config(server, key, mode="black_box"))
    assert plain.reward == 1.0 and version_probes(server) == 0
    assert plain.return_token_ids is None and plain.return_token_ids_reason is None

    captured = run_rollout(TASK, scripted_config(server, key, mode="transparent_proxy"))
    assert captured.reward == 1.0 and version_probes(server) == 1
    assert captured.return_token_ids is True
    assert captured.return_token_ids_reason.startswith("probe: vLLM 0.11.0+pi-env-synthetic at ")
    assert captured.proxy_turns[0].completion_token_ids  # and the engine was asked for them


def test_a_failed_probe_is_retried_later_and_an_answer_is_kept(monkeypatch):
    with socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    endpoint = Endpoint(name="vllm", base_url=f"http://127.0.0.1:{port}/v1", model="m")
    now = [1000.0]
    monkeypatch.setattr(endpoints.time, "monotonic", lambda: now[0])

    asked, why = supports_return_token_ids(endpoint)  # the engine is not up yet
    assert asked is False and "failed" in why and f"probed again after {endpoints.PROBE_RETRY_S:g} s" in why
    with ScriptedServer(port=port) as engine:  # now it is
        assert supports_return_token_ids(endpoint) == (asked, why)  # within the retry delay: kept
        assert version_probes(engine) == 0
        now[0] += endpoints.PROBE_RETRY_S
        asked, why = supports_return_token_ids(endpoint)
        assert asked is True and why.startswith("probe: vLLM") and version_probes(engine) == 1
        now[0] += 10 * endpoints.PROBE_RETRY_S
        assert supports_return_token_ids(endpoint)[0] is True and version_probes(engine) == 1  # an answer is kept
