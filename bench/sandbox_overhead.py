"""How much the sandbox backends cost.

Local backend: create + close, exec("true"), and the same command line run bare
(subprocess.run, no output pipes or threads, no shell as the namespace's init). Side by side:
create + close without the per-sandbox totals (no memory cgroup, no size-capped home), and
exec("true") with network="full" (its own namespace given the internet by slirp4netns).
Every backend that runs here (local, podman): create-to-ready (create() until a first
exec("true") has returned: the sandbox provably runs commands) and teardown (close() of a
sandbox that ran a command), N rounds each.

    python bench/sandbox_overhead.py [N]

Prints tables, then one JSON line with the medians (ms); a backend that cannot run here is
listed under "skipped" with the reason.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from pi_env.sandbox import SandboxLimits, SandboxSpec, SandboxUnavailable, get_backend
from pi_env.sandbox.local import LocalSandboxBackend
from pi_env.sandbox.totals import host_totals

LIFECYCLE_BACKENDS = ("local", "podman")

TARGET_CREATE_TEARDOWN_MS = 50


def timings_ms(action: Callable[[], object], n: int) -> list[float]:
    action()  # warm-up: first-use caches, page cache
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[-1]


def lifecycle_ms(backend, n: int) -> tuple[list[float], list[float]]:
    """(create-to-ready samples, teardown samples) over n rounds, after one warm-up round."""
    ready, teardown = [], []
    for i in range(n + 1):
        started = time.perf_counter()
        sandbox = backend.create(SandboxSpec())
        assert sandbox.exec("true").exit_code == 0
        created = time.perf_counter()
        sandbox.close()
        if i:
            ready.append((created - started) * 1000)
            teardown.append((time.perf_counter() - created) * 1000)
    return ready, teardown


def lifecycle(n: int) -> dict:
    figures: dict = {"skipped": {}}
    print(f"\n{'N=' + str(n):<18}{'ready median':>14}{'ready p90':>11}{'teardown median':>17}{'teardown p90':>14}")
    for name in LIFECYCLE_BACKENDS:
        try:
            backend = get_backend(name)
        except SandboxUnavailable as exc:
            figures["skipped"][name] = str(exc)
            print(f"{name:<18}skipped: {exc}")
            continue
        ready, teardown = lifecycle_ms(backend, n)
        print(f"{name:<18}{statistics.median(ready):>14.1f}{p90(ready):>11.1f}"
              f"{statistics.median(teardown):>17.1f}{p90(teardown):>14.1f}")
        figures[name] = {
            "create_to_ready_median_ms": round(statistics.median(ready), 1),
            "create_to_ready_p90_ms": round(p90(ready), 1),
            "teardown_median_ms": round(statistics.median(teardown), 1),
            "teardown_p90_ms": round(p90(teardown), 1),
        }
    return figures


LAYER_DOCKERFILE = """FROM debian:bookworm
RUN mkdir -p /opt/tool && echo ok > /opt/tool/version && useradd --uid 1000 worker
ENV TOOL_HOME=/opt/tool
WORKDIR /app
COPY data.txt /app/data.txt
"""


def layered(n: int) -> dict:
    """Local backend with an environment layer: the first build (fresh cache), then
    create-to-ready of sandboxes over the cached layer beside plain ones, in one run."""
    import os
    import tempfile

    from pi_env.sandbox.base import EnvironmentSpec

    if os.geteuid() != 0:
        return {"skipped": "environment layers need root"}
    with tempfile.TemporaryDirectory() as context, tempfile.TemporaryDirectory() as cache:
        with open(os.path.join(context, "Dockerfile"), "w") as f:
            f.write(LAYER_DOCKERFILE)
        with open(os.path.join(context, "data.txt"), "w") as f:
            f.write("data\n")
        os.environ["PI_ENV_LAYER_CACHE"] = cache
        backend = get_backend("local")
        spec = SandboxSpec(environment=EnvironmentSpec(dockerfile=os.path.join(context, "Dockerfile"), context=context))
        started = time.perf_counter()
        backend.create(spec).close()  # builds the layer
        first_build_s = time.perf_counter() - started
        plain, with_layer = [], []
        for i in range(n + 1):
            for target, chosen in ((plain, SandboxSpec()), (with_layer, spec)):
                started = time.perf_counter()
                sandbox = backend.create(chosen)
                assert sandbox.exec("true").exit_code == 0
                if i:
                    target.append((time.perf_counter() - started) * 1000)
                sandbox.close()
        for mount in os.listdir(cache):  # the layer's read-only views stay mounted until unmounted
            subprocess.run(f"umount {cache}/{mount}/view/* 2>/dev/null", shell=True)
    print(f"\nlocal + layer: first build {first_build_s:.2f} s; create-to-ready median {statistics.median(with_layer):.1f} ms "
          f"(plain {statistics.median(plain):.1f} ms)")
    return {"first_build_s": round(first_build_s, 2),
            "create_to_ready_median_ms": round(statistics.median(with_layer), 1),
            "create_to_ready_p90_ms": round(p90(with_layer), 1),
            "plain_create_to_ready_median_ms": round(statistics.median(plain), 1),
            "target_create_to_ready_ms": TARGET_CREATE_TEARDOWN_MS}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    load_before = os.getloadavg()
    backend = LocalSandboxBackend()
    spec = SandboxSpec()

    no_totals = SandboxSpec(limits=SandboxLimits(max_total_memory_bytes=None, max_disk_bytes=None))
    create_close, create_close_no_totals = [], []
    for _ in range(2):  # interleaved, so both see the same load
        create_close += timings_ms(lambda: backend.create(spec).close(), n // 2)
        create_close_no_totals += timings_ms(lambda: backend.create(no_totals).close(), n // 2)
    with backend.create(spec) as sandbox:
        exec_true = timings_ms(lambda: sandbox.exec("true"), n)
        exec_true_network = timings_ms(lambda: sandbox.exec("true", network="full"), n)
        # The exact command line exec() builds (setpriv, prlimit, bwrap and its flags), with
        # `true` run directly instead of under the shell that serves as the namespace's init.
        popen_args = sandbox._popen_args("true", None, None, "none")
        argv = popen_args.pop("args")
        argv = [*argv[: len(argv) - argv[::-1].index("--")], "/usr/bin/true"]
        bare = timings_ms(lambda: subprocess.run(argv, **popen_args, check=True), n)

    rows = [
        ("create + close", create_close),
        ("  without totals", create_close_no_totals),
        ('exec("true")', exec_true),
        ('  network="full"', exec_true_network),
        ("bare bwrap true", bare),
    ]
    print(f"{'N=' + str(n):<18}{'median ms':>10}{'p90 ms':>10}{'min ms':>10}")
    for name, samples in rows:
        print(
            f"{name:<18}{statistics.median(samples):>10.2f}{p90(samples):>10.2f}{min(samples):>10.2f}"
        )
    backends = lifecycle(n)
    backends["local_with_layer"] = layered(n)
    print(
        json.dumps(
            {
                "bench": "sandbox_overhead",
                "backends": backends,
                "create_teardown_median_ms": round(statistics.median(create_close), 2),
                "create_teardown_p90_ms": round(p90(create_close), 2),
                "create_teardown_without_totals_median_ms": round(statistics.median(create_close_no_totals), 2),
                "totals": host_totals().describe(),
                "exec_true_network_full_median_ms": round(statistics.median(exec_true_network), 2),
                "exec_true_network_full_p90_ms": round(p90(exec_true_network), 2),
                "exec_true_median_ms": round(statistics.median(exec_true), 2),
                "exec_true_p90_ms": round(p90(exec_true), 2),
                "bare_bwrap_true_median_ms": round(statistics.median(bare), 2),
                "bare_bwrap_true_p90_ms": round(p90(bare), 2),
                "target_create_teardown_ms": TARGET_CREATE_TEARDOWN_MS,
                "loadavg": {"before": load_before, "after": os.getloadavg()},
            }
        )
    )


if __name__ == "__main__":
    main()
