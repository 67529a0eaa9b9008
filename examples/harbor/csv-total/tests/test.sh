#!/bin/bash
# Harbor verifier: reward.txt gets 1 when total.py prints the right total, else 0.
mkdir -p /logs/verifier
if python3 /tests/test_total.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
