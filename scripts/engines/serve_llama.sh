#!/usr/bin/env bash
# Start llama.cpp's llama-server serving SmolLM2-135M-Instruct (the GGUF itself, Q4_1) on
# 127.0.0.1:PORT in the background, wait until /health answers, and print its PID (the only
# line on stdout; progress goes to stderr). Same interface as serve_vllm.sh:
#
#   pid=$(bash scripts/engines/serve_llama.sh --port 8012)
#   bash scripts/engines/stop_engine.sh "$pid"
#
# Options: --port N (default $ENGINE_PORT or 8012), --timeout S (default 120), --log FILE
# (default .engines/logs/llama-PORT.log); anything after `--` goes to llama-server.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ENGINES_DIR=${PI_ENV_ENGINES_DIR:-$ROOT/.engines}
SERVER=$ENGINES_DIR/llama-venv/bin/llama-server
GGUF=$ENGINES_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf
SERVED_NAME=${ENGINE_MODEL_NAME:-smollm2-135m-instruct}
PORT=${ENGINE_PORT:-8012}
TIMEOUT=120
LOG=
extra=()
die() { echo "[serve_llama] ERROR: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --log) LOG=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1' (see the header of $0)" ;;
  esac
done
LOG=${LOG:-$ENGINES_DIR/logs/llama-$PORT.log}

[ -f "$ENGINES_DIR/llama-venv/.installed" ] || die "llama-server is not built in $ENGINES_DIR/llama-venv: run bash scripts/engines/install.sh llama"
[ -f "$GGUF" ] || die "$GGUF missing: run bash scripts/engines/install.sh"
if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health"; then
  die "something already answers on 127.0.0.1:$PORT"
fi
mkdir -p "$(dirname "$LOG")"

# One slot (-np 1) so the whole 8k context is one conversation's; the same tool-aware ChatML
# template as vLLM (--jinja), so both engines render the same prompts.
started=$SECONDS
setsid "$SERVER" \
  -m "$GGUF" \
  --alias "$SERVED_NAME" \
  --host 127.0.0.1 --port "$PORT" \
  -c 8192 -np 1 -t "$(nproc)" \
  --jinja --chat-template-file "$HERE/chatml_tools.jinja" \
  --no-webui \
  "${extra[@]}" \
  </dev/null >"$LOG" 2>&1 &
pid=$!
echo "[serve_llama] started llama-server, PID $pid, log $LOG; waiting for http://127.0.0.1:$PORT/health" >&2

while :; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "[serve_llama] llama-server exited during start-up; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  if curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/health"; then
    break
  fi
  if [ $((SECONDS - started)) -ge "$TIMEOUT" ]; then
    echo "[serve_llama] no /health after ${TIMEOUT}s; stopping PID $pid. The end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    bash "$HERE/stop_engine.sh" "$pid" >&2 || true
    exit 1
  fi
  sleep 0.5
done
echo "[serve_llama] ready in $((SECONDS - started)) s: http://127.0.0.1:$PORT/v1 model '$SERVED_NAME' PID $pid" >&2
echo "$pid"
