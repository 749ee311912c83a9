#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server) from the source the project's llama-cpp-python is built
# from (its sdist vendors llama.cpp), with the same CMake flags, and print the binary's path.
#
# benchmarks/peer.py measures the decode server against it. Built once per version and flags, like
# install.sh's wheel, and kept under ~/.cache/disaggregated-inference/llama-server/<flags_id>/ (the
# wheel's <flags_id>); a second run prints the cached path at once. Only the llama-server target is
# built, statically linked, without HTTPS (no OpenSSL) and without the web UI's assets (nothing is
# downloaded but the sdist, through pip). About 10 minutes on 2 cores.
#
#   LLAMA_CMAKE_ARGS   as for install.sh (scripts/lib/llama_flags.sh); e.g. add -DGGML_OPENMP=OFF
#                      for llama.cpp's own thread pool instead of OpenMP (a separate cache entry)
#   PYTHON             the interpreter whose pip fetches the sdist (default .venv/bin/python)
#   --check            print the cached binary's path, or exit 3 if it is not built (builds nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/llama_flags.sh
. scripts/lib/llama_flags.sh

say() { printf '[build_llama_server] %s\n' "$*" >&2; }
DEST="$DISAGG_CACHE/llama-server/$flags_id"
BIN="$DEST/llama-server"

if [ -x "$BIN" ]; then
  say "llama-server $LLAMA_VERSION ($flags_id) is built: $BIN"
  echo "$BIN"
  exit 0
fi
if [ "${1:-}" = "--check" ]; then
  say "llama-server $LLAMA_VERSION ($flags_id) is not built (run scripts/build_llama_server.sh)"
  exit 3
fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { say "cannot build llama-server: $tool is not installed"; exit 2; }
done

PY="${PYTHON:-.venv/bin/python}"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say "fetching the llama-cpp-python $LLAMA_VERSION source distribution"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  -d "$WORK" "llama-cpp-python==$LLAMA_VERSION" 2>"$WORK/pip.log" || { cat "$WORK/pip.log" >&2; exit 2; }
tar -xzf "$WORK"/llama_cpp_python-"$LLAMA_VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
[ -f "$SRC/tools/server/CMakeLists.txt" ] || { say "the sdist has no vendor/llama.cpp/tools/server"; exit 2; }

GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
JOBS=$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu)
say "building llama-server (once per machine and flags; about 10 minutes on 2 cores)"
say "  flags: $CMAKE_FLAGS"
# shellcheck disable=SC2086  # the flags are a list of words, as install.sh passes them
cmake -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release $CMAKE_FLAGS \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$WORK/cmake.log" 2>&1 \
  || { tail -30 "$WORK/cmake.log" >&2; exit 2; }
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log" >&2; exit 2; }
mkdir -p "$DEST"
cp "$WORK/build/bin/llama-server" "$BIN.tmp"
printf '%s %s\n' "$LLAMA_VERSION" "$CMAKE_FLAGS" > "$DEST/flags.txt"
mv "$BIN.tmp" "$BIN"
say "built: $BIN"
echo "$BIN"
