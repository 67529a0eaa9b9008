#!/bin/bash
# pytest comes from the environment's image (pip RUN step), datamash from its apt step. The tests
# run stats.sh as nobody through pi_env_check, which kills whatever it left before returning, so
# nothing of the agent's is running when the reward is written.
mkdir -p /logs/verifier
cd /
if python3 -m pytest -q -p no:cacheprovider /tests/test_stats.py; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
