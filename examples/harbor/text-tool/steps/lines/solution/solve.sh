#!/bin/bash
cat > /app/textstat.py <<'PY'
def count_lines(text: str) -> int:
    return len(text.splitlines())
PY
