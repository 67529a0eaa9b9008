#!/usr/bin/env bash
# Stop an engine started by serve_vllm.sh / serve_llama.sh, by its PID: SIGTERM to its process
# group (the server runs in its own session, so its group id is its PID), then SIGKILL after
# --grace seconds (default 20). Refuses a PID that is not an engine we start.
set -euo pipefail
grace=20
[ "${1:-}" = --grace ] && { grace=$2; shift 2; }
pid=${1:?usage: stop_engine.sh [--grace S] PID}
case "$pid" in ''|*[!0-9]*) echo "[stop_engine] not a PID: '$pid'" >&2; exit 2 ;; esac
if ! kill -0 "$pid" 2>/dev/null; then
  echo "[stop_engine] PID $pid is not running" >&2; exit 0
fi
cmd=$(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null || true)
case "$cmd" in
  *vllm.entrypoints*|*llama-server*) ;;
  *) echo "[stop_engine] PID $pid is not an engine started by serve_*.sh: $cmd" >&2; exit 2 ;;
esac
pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
if [ "$pgid" = "$pid" ]; then target=-$pid; else target=$pid; fi
kill -TERM -- "$target" 2>/dev/null || true
for _ in $(seq $((grace * 5))); do
  kill -0 -- "$target" 2>/dev/null || { echo "[stop_engine] stopped PID $pid" >&2; exit 0; }
  sleep 0.2
done
echo "[stop_engine] PID $pid still up after ${grace}s; SIGKILL" >&2
kill -KILL -- "$target" 2>/dev/null || true
exit 0
