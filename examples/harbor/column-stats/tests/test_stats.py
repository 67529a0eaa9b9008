import os
import tempfile

import pi_env_check as check
import pytest


@pytest.fixture(scope="session", autouse=True)
def sealed():
    check.seal("/tests")  # collected: the tests leave the disk before stats.sh first runs


def run(path):
    return check.run(["bash", "/app/stats.sh", path], user="nobody", timeout=30)


def test_given_file():
    assert run("/app/data/prices.csv").stdout.split() == ["18", "6", "10"]


def test_hidden_file():
    folder = tempfile.mkdtemp()
    data = os.path.join(folder, "hidden.csv")
    with open(data, "w") as handle:
        handle.write("a,1.5\nb,2.5\nc,-4\nd,8\n")
    os.chmod(data, 0o644)
    os.chmod(folder, 0o755)  # nobody reads it; only the verifier writes it
    assert [float(x) for x in run(data).stdout.split()] == [8.0, 2.0, 8.0]
