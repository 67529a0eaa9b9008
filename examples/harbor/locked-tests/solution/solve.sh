#!/bin/bash
cat > /app/wordfreq.py <<'PY'
import re
import sys
from collections import Counter

counts = Counter(re.findall(r"[a-z]+", sys.stdin.read().lower()))
for word, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:3]:
    print(word, count)
PY
