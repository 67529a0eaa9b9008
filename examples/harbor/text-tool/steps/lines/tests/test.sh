#!/bin/bash
mkdir -p /logs/verifier
cd /app && python3 - <<'PY'
import json
from textstat import count_lines
ok = [count_lines("") == 0, count_lines("a\nb\n") == 2, count_lines("a\nb") == 2]
json.dump({"reward": sum(ok) / len(ok)}, open("/logs/verifier/reward.json", "w"))
print("lines:", ok)
PY
