"""ATIF exports validated by Harbor's own models (PyPI `harbor` 0.26, ATIF-v1.8). harbor needs
Python >= 3.12, so it lives in a test-only venv: scripts/harbor_venv.sh makes .venv-harbor/
(or name its python in PI_ENV_HARBOR_PYTHON)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from pi_env.collect import CollectRunner
from pi_env.collect.export import export
from pi_env.task import load_tasks

ROOT = Path(__file__).parent.parent
HARBOR_PYTHON = os.environ.get("PI_ENV_HARBOR_PYTHON") or str(ROOT / ".venv-harbor" / "bin" / "python")
VALIDATE = """
import json, sys
from harbor.models.trajectories import Trajectory
for number, line in enumerate(open(sys.argv[1]), 1):
    trajectory = Trajectory.model_validate(json.loads(line))
    steps = [s for s in trajectory.steps if s.source == "agent" and s.metrics]
    print(json.dumps({"line": number, "version": trajectory.schema_version, "agent_steps": len(steps),
                      "ids": sum(len(s.metrics.completion_token_ids or []) for s in steps),
                      "logprobs": sum(len(s.metrics.logprobs or []) for s in steps)}))
"""


@pytest.mark.needs_bwrap
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(HARBOR_PYTHON), reason="no harbor venv: run scripts/harbor_venv.sh")
def test_atif_export_validates_with_harbors_models_and_keeps_ids_and_logprobs(tmp_path):
    tasks = [t for t in load_tasks(ROOT / "examples") if t.task_id in ("fizzbuzz", "binary_search")]
    summary = CollectRunner(tasks, tmp_path, concurrency=2).run()  # transparent_proxy: ids and logprobs
    assert summary.complete
    path, written, _ = export(tmp_path, "atif")
    assert written == 2
    done = subprocess.run([HARBOR_PYTHON, "-c", VALIDATE, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    checked = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(checked) == 2 and all(c["version"] == "ATIF-v1.8" for c in checked)
    assert all(c["agent_steps"] > 0 and c["ids"] > 0 and c["ids"] == c["logprobs"] for c in checked)

    # Harbor's models do reject what breaks the format: the check can fail.
    row = json.loads(path.read_text().splitlines()[0])
    row["steps"][0]["step_id"] = 7
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(row) + "\n")
    done = subprocess.run([HARBOR_PYTHON, "-c", VALIDATE, str(broken)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "step_id" in done.stderr
