#!/bin/bash
# As terminal-bench verifiers do: lock the tests away from the program under test, then run it
# as nobody (pi_env_check), so it can neither read the expected answers nor write the reward.
chmod -R go-rwx /tests
python3 /tests/check.py
