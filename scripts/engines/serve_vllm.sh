#!/usr/bin/env bash
# Start vLLM (CPU) serving SmolLM2-135M-Instruct on 127.0.0.1:PORT in the background, wait until
# /health answers, and print its PID (the only line on stdout; progress goes to stderr).
#
#   pid=$(bash scripts/engines/serve_vllm.sh --port 8011)
#   curl -s 127.0.0.1:8011/v1/models
#   bash scripts/engines/stop_engine.sh "$pid"
#
# Options: --port N (default $ENGINE_PORT or 8011), --timeout S to wait for /health (default
# 300), --log FILE (default .engines/logs/vllm-PORT.log); anything after `--` goes to vLLM.
# Another checkpoint (e.g. one fine-tuned from the tier's model): --model DIR (or --model-dir; a Hugging Face
# model directory: config.json + weights + tokenizer) and --served-name NAME (the model id
# clients ask for; default: the directory's name). Its chat template is DIR/chat_template.jinja,
# else the one in its tokenizer_config.json, else --chat-template FILE.
# The server runs in its own session (process group = PID), so stop_engine.sh ends vLLM and
# its engine-core child together.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ENGINES_DIR=${PI_ENV_ENGINES_DIR:-$ROOT/.engines}
VENV=$ENGINES_DIR/vllm-venv
MODEL_DIR=$ENGINES_DIR/models/smollm2-135m-instruct
SERVED_NAME=${ENGINE_MODEL_NAME:-}
CHAT_TEMPLATE=
OWN_MODEL=
PORT=${ENGINE_PORT:-8011}
TIMEOUT=300
LOG=
CUSTOM_MODEL=
extra=()
die() { echo "[serve_vllm] ERROR: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --log) LOG=$2; shift 2 ;;
    --model|--model-dir) MODEL_DIR=$2; OWN_MODEL=1; shift 2 ;;
    --served-name) SERVED_NAME=$2; shift 2 ;;
    --chat-template) CHAT_TEMPLATE=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1' (see the header of $0)" ;;
  esac
done
LOG=${LOG:-$ENGINES_DIR/logs/vllm-$PORT.log}

if [ -z "$OWN_MODEL" ]; then
  [ -f "$MODEL_DIR/.installed" ] || die "the model is not in $MODEL_DIR: run bash scripts/engines/install.sh"
  SERVED_NAME=${SERVED_NAME:-smollm2-135m-instruct}
else
  [ -f "$MODEL_DIR/config.json" ] || die "--model $MODEL_DIR: no config.json there (a Hugging Face model directory is needed)"
  MODEL_DIR=$(cd "$MODEL_DIR" && pwd)
  SERVED_NAME=${SERVED_NAME:-$(basename "$MODEL_DIR")}
fi
if [ -z "$CHAT_TEMPLATE" ] && [ -f "$MODEL_DIR/chat_template.jinja" ]; then
  CHAT_TEMPLATE=$MODEL_DIR/chat_template.jinja
fi
if [ -z "$CHAT_TEMPLATE" ] && ! grep -qs '"chat_template"' "$MODEL_DIR/tokenizer_config.json"; then
  die "--model $MODEL_DIR has no chat template (no chat_template.jinja, none in tokenizer_config.json): pass --chat-template FILE"
fi
[ -z "$CHAT_TEMPLATE" ] || [ -f "$CHAT_TEMPLATE" ] || die "--chat-template $CHAT_TEMPLATE: no such file"
[ -f "$VENV/.installed" ] || die "vLLM is not installed in $VENV: run bash scripts/engines/install.sh"
if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health"; then
  die "something already answers on 127.0.0.1:$PORT"
fi
mkdir -p "$(dirname "$LOG")"

# 2 cores here: bind vLLM's OpenMP threads to both; 2 GiB of KV cache is plenty for a 135M
# model at 8k context. --enforce-eager skips torch.compile/graph capture (36 s start, not 150 s).
# float32: the converted weights are float32, and the logprobs then match transformers' closely.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export LD_PRELOAD=$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

started=$SECONDS
setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" \
  --served-model-name "$SERVED_NAME" \
  --host 127.0.0.1 --port "$PORT" \
  --dtype float32 \
  --enforce-eager \
  --max-model-len 8192 \
  --seed 0 \
  ${CHAT_TEMPLATE:+--chat-template "$CHAT_TEMPLATE"} \
  --enable-auto-tool-choice --tool-call-parser hermes \
  "${extra[@]}" \
  </dev/null >"$LOG" 2>&1 &
pid=$!
echo "[serve_vllm] started vLLM, PID $pid, log $LOG; waiting for http://127.0.0.1:$PORT/health" >&2

while :; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "[serve_vllm] vLLM exited during start-up; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  if curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health"; then
    break
  fi
  if [ $((SECONDS - started)) -ge "$TIMEOUT" ]; then
    echo "[serve_vllm] no /health after ${TIMEOUT}s; stopping PID $pid. The end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    bash "$HERE/stop_engine.sh" "$pid" >&2 || true
    exit 1
  fi
  sleep 1
done
echo "[serve_vllm] ready in $((SECONDS - started)) s: http://127.0.0.1:$PORT/v1 model '$SERVED_NAME' PID $pid" >&2
echo "$pid"
