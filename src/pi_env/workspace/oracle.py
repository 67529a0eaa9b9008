"""Reference programs for the task families, and the scripted "oracle" episode built from
them (write the program, run it, state the answer). Synthetic: for tests, benches and
smoke-testing a training loop end to end, never for scoring a model.
"""

from __future__ import annotations

import json
from typing import Any

from pi_env.workspace.tasks import WorkspaceTask

_PYTHON = {
    "csv_filter_sum": """import csv
rows = list(csv.DictReader(open("sales.csv")))
print(sum(int(r["qty"]) for r in rows if r["region"] == {region!r} and int(r["price"]) >= {threshold}))
""",
    "count_words": """words = [w.strip(".,;:!?").lower() for w in open("words.txt").read().split()]
print(sum(1 for w in words if w.startswith({letter!r}) and len(w) >= {min_len}))
""",
    "shortest_path": """import heapq
graph = {{}}
for line in open("edges.txt"):
    if line.strip():
        a, b, w = line.split()
        graph.setdefault(a, []).append((b, int(w)))
        graph.setdefault(b, []).append((a, int(w)))
dist, heap = {{{source!r}: 0}}, [(0, {source!r})]
while heap:
    d, v = heapq.heappop(heap)
    if d > dist[v]:
        continue
    for u, w in graph[v]:
        if d + w < dist.get(u, float("inf")):
            dist[u] = d + w
            heapq.heappush(heap, (d + w, u))
print(dist[{target!r}])
""",
    "date_union": """import datetime
days = set()
for line in open("intervals.txt"):
    if line.strip():
        a, b = (datetime.date.fromisoformat(x) for x in line.split())
        days.update(a + datetime.timedelta(days=k) for k in range((b - a).days + 1))
print(len(days))
""",
    "log_errors": """count = 0
for line in open("app.log"):
    parts = line.split()
    if len(parts) >= 3 and parts[1] == "ERROR" and parts[2] == {service!r}:
        count += {hour_from} <= int(parts[0][:2]) < {hour_to}
print(count)
""",
}

_JAVASCRIPT = {
    "csv_filter_sum": """const fs = require("fs");
const rows = fs.readFileSync("sales.csv", "utf8").trim().split("\\n").slice(1).map(l => l.split(","));
console.log(rows.filter(r => r[0] === {region_js} && Number(r[3]) >= {threshold}).reduce((s, r) => s + Number(r[2]), 0));
""",
    "count_words": """const fs = require("fs");
const words = fs.readFileSync("words.txt", "utf8").split(/\\s+/).filter(Boolean)
  .map(w => w.replace(/^[.,;:!?]+|[.,;:!?]+$/g, "").toLowerCase());
console.log(words.filter(w => w.startsWith({letter_js}) && w.length >= {min_len}).length);
""",
    "shortest_path": """const fs = require("fs");
const graph = {{}};
for (const line of fs.readFileSync("edges.txt", "utf8").split("\\n")) {{
  if (!line.trim()) continue;
  const [a, b, w] = line.trim().split(/\\s+/);
  (graph[a] ||= []).push([b, Number(w)]);
  (graph[b] ||= []).push([a, Number(w)]);
}}
const dist = {{[{source_js}]: 0}};
const done = new Set();
for (;;) {{
  let v = null;
  for (const k in dist) if (!done.has(k) && (v === null || dist[k] < dist[v])) v = k;
  if (v === null) break;
  done.add(v);
  for (const [u, w] of graph[v]) if (!(u in dist) || dist[v] + w < dist[u]) dist[u] = dist[v] + w;
}}
console.log(dist[{target_js}]);
""",
    "date_union": """const fs = require("fs");
const days = new Set();
for (const line of fs.readFileSync("intervals.txt", "utf8").split("\\n")) {{
  if (!line.trim()) continue;
  const [a, b] = line.trim().split(/\\s+/).map(s => Date.parse(s + "T00:00:00Z"));
  for (let t = a; t <= b; t += 86400000) days.add(t);
}}
console.log(days.size);
""",
    "log_errors": """const fs = require("fs");
let count = 0;
for (const line of fs.readFileSync("app.log", "utf8").split("\\n")) {{
  const p = line.trim().split(/\\s+/);
  const hour = Number(p[0].slice(0, 2));
  if (p.length >= 3 && p[1] === "ERROR" && p[2] === {service_js} && {hour_from} <= hour && hour < {hour_to}) count++;
}}
console.log(count);
""",
}


def reference_program(task: WorkspaceTask) -> str:
    """Source of a program that prints the task's answer, in the task's language."""
    templates = {"python": _PYTHON, "javascript": _JAVASCRIPT}.get(task.language)
    if templates is None:
        raise ValueError(f"no reference programs in {task.language}; there are python and javascript ones")
    params = dict(task.metadata)
    params.update({f"{k}_js": json.dumps(v) for k, v in task.metadata.items()})
    return templates[task.family].format(**params)


def oracle_turns(task: WorkspaceTask) -> list[dict[str, Any]]:
    """The assistant turns of a perfect episode (OpenAI-style messages): write the reference
    program, run it with the task's command, state the answer."""

    def call(i: int, name: str, args: dict) -> dict:
        return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}

    return [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call(0, "write", {"path": task.program, "content": reference_program(task)})],
        },
        {"role": "assistant", "content": "", "tool_calls": [call(1, "bash", {"command": task.command})]},
        {"role": "assistant", "content": f"The answer is {task.expected}"},
    ]
