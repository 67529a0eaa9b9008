import subprocess


def run(path):
    return subprocess.run(["bash", "/app/stats.sh", path], capture_output=True, text=True, timeout=30)


def test_given_file():
    assert run("/app/data/prices.csv").stdout.split() == ["18", "6", "10"]


def test_hidden_file(tmp_path):
    data = tmp_path / "hidden.csv"
    data.write_text("a,1.5\nb,2.5\nc,-4\nd,8\n")
    assert [float(x) for x in run(str(data)).stdout.split()] == [8.0, 2.0, 8.0]
