#!/usr/bin/env bash
# A model learns to code through pi-env on this CPU (docs/learning.md): SmolLM2-135M-Instruct,
# base eval -> SFT on oracle rollouts -> a probe of the SFT policy per family -> paired evals
# (unseen templates, primary; in-distribution held out) -> on-policy GRPO through the real Pi ->
# the same evals, then the curve checkpoints' and the SFT retest's, then report.json (the paired
# differences with their 95 % CIs; docs/learning_protocol.md) and learning_curve.png in the run
# directory. The RL seeds (RL_SEEDS, default the protocol's three: 0 1 2) each start from the same
# SFT checkpoint, one after the other; the stages a seed shares with the others (tasks to eval_sft)
# run once, then the curve of the first seed and the SFT retest. Every stage resumes from its
# outputs: run the same command again after an interruption.
#
#   bash scripts/learn_on_cpu.sh                       # the full run (RUN_DIR=runs/learn_on_cpu)
#   RL_SEEDS=0 RUN_DIR=/tmp/tiny bash scripts/learn_on_cpu.sh --n-train 4 --n-eval 2 --n-heldout 4 --rl-steps 2
#   RL_SEEDS=0 bash scripts/learn_on_cpu.sh --rl-algorithm raft  # the RAFT arm on the same run directory
#   RUN_DIR=runs/learn_v3 STATE_DIR=runs/learn_v3.state bash scripts/learn_on_cpu.sh  # carried across machines
#
# Options go to `python -m pi_env.learning` (see its --help): sizes, budgets, learning rates.
# The trainer runs in the engine venv (torch + transformers + vLLM; bash scripts/engines/install.sh),
# with pi-env from src/; the report's plot with the main venv (matplotlib). Training and rollouts
# run under `nice -n 10` (the machine is shared).
set -euo pipefail
cd "$(dirname "$0")/.."
export PI_ENV_ENGINES_DIR=${PI_ENV_ENGINES_DIR:-$PWD/.engines}
RUN_DIR=${RUN_DIR:-runs/learn_on_cpu}
ENGINE_PY=$PI_ENV_ENGINES_DIR/vllm-venv/bin/python
[ -x .venv/bin/python ] || bash scripts/bootstrap.sh            # Pi, bubblewrap, the main venv
bash scripts/engines/install.sh vllm   # idempotent: the engine venv (renderers for token-in) and the model
mkdir -p "$RUN_DIR"
SEEDS=(${RL_SEEDS:-0 1 2})
# STATE_DIR (e.g. runs/learn_v3.state, committed): the run's records without its weights, restored
# before each invocation and packed after it, so the run goes on on another machine (the
# checkpoints are rebuilt there and checked against their digests: pi_env.learning.state).
STATE=()
if [ -n "${STATE_DIR:-}" ]; then
  STATE=(--state-dir "$STATE_DIR")
  PYTHONPATH=$PWD/src .venv/bin/python -m pi_env.learning restore --run-dir "$RUN_DIR" "${STATE[@]}"
fi
RUN_ARGS="$*"
# Every start and end of this script in the run directory's log, which the report lists (the
# protocol reports every run started, stopped or failed ones too), with the code it ran.
log_run() {
  local commit
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD 2>/dev/null || commit="$commit+uncommitted"
  echo "$(date -u +%FT%TZ) $1 commit $commit rl_seeds ${RL_SEEDS:-0 1 2} load $(cut -d' ' -f1-3 /proc/loadavg) args: $RUN_ARGS" \
    >> "$RUN_DIR/runs_started.txt"
}
log_run start
end_run() {
  local code=$?
  log_run "end exit=$code"
  # the end line too goes with the state
  [ -z "${STATE_DIR:-}" ] || PYTHONPATH=$PWD/src .venv/bin/python -m pi_env.learning pack --run-dir "$RUN_DIR" "${STATE[@]}"
}
trap end_run EXIT
trap 'exit 143' TERM  # stopped by its process group (kill -TERM -- -PGID): logged as exit=143
trap 'exit 130' INT
export PYTHONPATH=$PWD/src HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# What decides first (protocol version 3): SFT and its eval, then each seed's RL and eval; the
# curve (the first seed's kept checkpoints) and the SFT retest decide nothing and come last.
for seed in "${SEEDS[@]}"; do
  nice -n 10 "$ENGINE_PY" -m pi_env.learning tasks oracle eval_base sft probe eval_sft rl eval_rl \
    --run-dir "$RUN_DIR" --rl-seed "$seed" "${STATE[@]}" "$@"
done
nice -n 10 "$ENGINE_PY" -m pi_env.learning eval_curve retest_sft --run-dir "$RUN_DIR" --rl-seed "${SEEDS[0]}" \
  "${STATE[@]}" "$@"
PYTHONPATH=$PWD/src .venv/bin/python -m pi_env.learning report --run-dir "$RUN_DIR" "${STATE[@]}" "$@"
echo "[learn] report: $RUN_DIR/report.json, plot: $RUN_DIR/learning_curve.png"
