#!/bin/bash
cat > /app/total.py <<'PY'
import csv
from decimal import Decimal

with open("/app/sales.csv") as handle:
    total = sum(Decimal(row["amount"]) for row in csv.DictReader(handle))
print(f"{total:.2f}")
PY
python3 /app/total.py
