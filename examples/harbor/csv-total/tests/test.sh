#!/bin/bash
# Harbor verifier: test_total.py writes /logs/verifier/reward.txt, 1 when total.py prints the
# right total, else 0 (it runs total.py as nobody through pi_env_check, then decides).
python3 /tests/test_total.py
