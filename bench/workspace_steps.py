"""Tool steps per second of pi_env.workspace, one run.

  read / write / edit: in-process calls through WorkspaceEnv.call (argument checks, the
                       workspace dict, the JSON result), on a generated task's files;
  bash python / node:  a real program run in the local bubblewrap sandbox (fresh run dir with
                       the workspace copied in, the program, its output back), one sandbox per
                       episode reused across its runs, sequential calls;
  episode:             a whole oracle episode (write, bash, grade), sandbox created and deleted.

Prints a table, then ONE JSON line.

    .venv/bin/python bench/workspace_steps.py [--calls 2000] [--runs 30] [--episodes 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pi_env.workspace import WorkspaceEnv, generate_tasks
from pi_env.workspace.oracle import oracle_turns, reference_program


def per_second(fn, count: int) -> tuple[float, float]:
    """(calls per second, median ms per call). A step that returns a tool result (JSON text) must
    have status "ok", checked outside the clock: a failing step is fast, not a figure."""
    times = []
    for i in range(count):
        start = time.perf_counter()
        outcome = fn(i)
        times.append(time.perf_counter() - start)
        if isinstance(outcome, str):
            check_ok(outcome)
    return count / sum(times), statistics.median(times) * 1000


def check_ok(text: str) -> dict:
    result = json.loads(text)
    if result.get("status") != "ok":
        raise RuntimeError(f"{result.get('tool')} step failed: {text[:500]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="read/write/edit calls each")
    parser.add_argument("--runs", type=int, default=30, help="bash runs per runtime")
    parser.add_argument("--episodes", type=int, default=10, help="whole oracle episodes")
    args = parser.parse_args()

    load_before = os.getloadavg()
    tasks = generate_tasks(10, seed=0)
    python_task = next(t for t in tasks if t.language == "python")
    node_task = next(t for t in tasks if t.language == "javascript" and t.family == python_task.family)
    figures: dict[str, dict[str, float]] = {}

    with WorkspaceEnv(python_task) as env:
        data = next(iter(python_task.files))
        program = reference_program(python_task)
        check_ok(env.call("write", {"path": "notes.txt", "content": "alpha 0\n"}))
        steps = {
            "read": lambda i: env.call("read", {"path": data}),
            "write": lambda i: env.call("write", {"path": "notes.txt", "content": f"alpha {i}\n" + program}),
            "edit": lambda i: env.call("edit", {"path": "notes.txt", "oldText": f"alpha {i}", "newText": f"alpha {i + 1}"}),
        }
        check_ok(env.call("write", {"path": "notes.txt", "content": "alpha 0\n" + program}))
        for name in ("read", "edit", "write"):
            rate, median = per_second(steps[name], args.calls)
            figures[name] = {"steps_per_s": round(rate, 1), "median_ms": round(median, 4)}

    for label, task in (("bash_python", python_task), ("bash_node", node_task)):
        with WorkspaceEnv(task) as env:
            env.call("write", {"path": task.program, "content": reference_program(task)})
            first = time.perf_counter()
            result = check_ok(env.call("bash", {"command": task.command}))  # creates the sandbox
            first_ms = (time.perf_counter() - first) * 1000
            if not result["output_correct"]:
                raise RuntimeError(f"the reference program's output is wrong: {result}")

            def run(i, env=env, task=task):
                result = check_ok(env.call("bash", {"command": task.command}))
                if not result["output_correct"]:
                    raise RuntimeError(f"the reference program's output is wrong: {result}")

            rate, median = per_second(run, args.runs)
            figures[label] = {"steps_per_s": round(rate, 2), "median_ms": round(median, 1),
                              "first_run_ms": round(first_ms, 1)}

    def episode(i):
        task = tasks[i % len(tasks)]
        with WorkspaceEnv(task) as env:
            messages = env.initial_messages()
            for turn in oracle_turns(task):
                messages.append(turn)
                for call in turn.get("tool_calls", []):
                    content = env.call(call["function"]["name"], call["function"]["arguments"])
                    check_ok(content)
                    messages.append({"role": "tool", "content": content})
            score = env.reward(messages)
            if score.reward != 1.0:
                raise RuntimeError(f"the oracle episode of {task.task_id} scored {score}")

    rate, median = per_second(episode, args.episodes)
    figures["oracle_episode"] = {"episodes_per_s": round(rate, 2), "median_ms": round(median, 1)}

    print(f"{'step':<16}{'per second':>12}{'median ms':>12}")
    for name, f in figures.items():
        print(f"{name:<16}{f.get('steps_per_s', f.get('episodes_per_s')):>12}{f['median_ms']:>12}")
    print(json.dumps({"bench": "workspace_steps", "cpus": os.cpu_count(), "calls": args.calls,
                      "runs": args.runs, "episodes": args.episodes, **figures,
                      "loadavg": {"before": load_before, "after": os.getloadavg()}}))


if __name__ == "__main__":
    main()
