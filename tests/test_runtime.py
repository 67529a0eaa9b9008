"""The Pi runtime: installed once per machine under a lock, clear errors when it cannot be."""

import json
import os
import subprocess
import sys

import pytest

from pi_env.agent.runtime import RuntimeInstallError, _satisfies, ensure_runtime
from pi_env.config import DEFAULT_NODE_VERSION, DEFAULT_PI_PACKAGE, DEFAULT_PI_VERSION


@pytest.mark.parametrize("version, requirement, ok", [
    ("22.23.5", ">=22.19.0", True), ("20.20.2", ">=22.19.0", False), ("20.20.2", ">=20.6.0", True),
    ("18.1.0", "^18 || ^20", True), ("19.0.0", "^18 || ^20", False), ("22.1.0", "", True),
    ("20.5.9", ">=20.6.0 <23", False), ("22.0.0", ">=20.6.0 <23", True)])
def test_engine_ranges(version, requirement, ok):
    assert _satisfies(version, requirement) is ok


def test_version_must_be_pinned(tmp_path):
    with pytest.raises(RuntimeInstallError, match="exact version"):
        ensure_runtime(DEFAULT_PI_PACKAGE, "^1.6", DEFAULT_NODE_VERSION, tmp_path)


def test_unreachable_registry_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")  # nothing listens on port 9
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))  # no cached tarballs
    with pytest.raises(RuntimeInstallError) as error:
        ensure_runtime(DEFAULT_PI_PACKAGE, DEFAULT_PI_VERSION, DEFAULT_NODE_VERSION, tmp_path / "cache",
                       progress=lambda _: None)
    assert "npm install" in str(error.value) and "unreachable" in str(error.value)
    assert not list((tmp_path / "cache" / "runtimes").glob("*/runtime.json"))  # nothing half-installed


@pytest.mark.slow
def test_concurrent_first_install_installs_once(tmp_path):
    """Three processes start on an empty cache at once: one installs, all get the same runtime."""
    script = ("import json, sys; from pi_env.agent.runtime import ensure_runtime;"
              f"r = ensure_runtime({DEFAULT_PI_PACKAGE!r}, {DEFAULT_PI_VERSION!r}, {DEFAULT_NODE_VERSION!r}, sys.argv[1]);"
              "print(json.dumps({'root': r.root, 'install_s': r.install_s}))")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    roots = {json.loads(out)["root"] for out, _ in outputs}
    assert len(roots) == 1
    installing = [err for _, err in outputs if "Installing" in err]
    assert len(installing) == 1, "exactly one process installs; the others wait on the lock"
    root = roots.pop()
    assert sorted(os.listdir(os.path.dirname(root))) == [os.path.basename(root)]  # no staging leftovers
    runtime = ensure_runtime(DEFAULT_PI_PACKAGE, DEFAULT_PI_VERSION, DEFAULT_NODE_VERSION, tmp_path)
    version = subprocess.run([runtime.host_node, runtime.host_cli, "--version"], capture_output=True, text=True,
                             env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PI_OFFLINE": "1"}, timeout=120)
    assert DEFAULT_PI_VERSION in version.stdout + version.stderr
