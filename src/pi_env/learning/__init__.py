"""A model learns through pi-env on the CPU: baseline eval, SFT warm-up on oracle rollouts,
on-policy GRPO through the real Pi, eval after each (`bash scripts/learn_on_cpu.sh`; docs/learning.md).

`pipeline` holds the resumable stages (pi-env only); `trainer` the torch side (SFT, GRPO, the
shared-prefix scoring), imported only by the stages that train.
"""
