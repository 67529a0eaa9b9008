import csv
import subprocess
import sys
from decimal import Decimal

with open("/app/sales.csv") as handle:
    want = sum(Decimal(row["amount"]) for row in csv.DictReader(handle))
done = subprocess.run([sys.executable, "/app/total.py"], capture_output=True, text=True, timeout=30, cwd="/app")
got = done.stdout.strip()
print(f"expected {want:.2f}, got {got!r}")
sys.exit(0 if got == f"{want:.2f}" else 1)
