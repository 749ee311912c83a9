# shellcheck shell=bash disable=SC2034  # the variables here are used by the scripts that source this
# The llama.cpp build the project uses, shared by scripts/install.sh (the llama-cpp-python wheel) and
# scripts/build_llama_server.sh (llama.cpp's own server from the same source, for benchmarks/peer.py):
# one version, one set of CMake flags, one cache key.
#
#   LLAMA_CMAKE_ARGS   build flags for llama.cpp. Default: a portable CPU build
#                      (AVX2, no AVX-512/AMX). On a DGX: "-DGGML_CUDA=on
#                      -DCMAKE_CUDA_ARCHITECTURES=90"; on a Mac: "-DGGML_METAL=on".

LLAMA_VERSION=0.3.36
PORTABLE_CPU="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
if [ "$(uname -s)" = "Darwin" ]; then PORTABLE_CPU="-DGGML_METAL=on"; fi
CMAKE_FLAGS="${LLAMA_CMAKE_ARGS:-$PORTABLE_CPU}"
# sha256sum on Linux, shasum on a stock Mac
digest() { if command -v sha256sum >/dev/null; then sha256sum; else shasum -a 256; fi | cut -c1-"$1"; }
flags_id=$(printf '%s %s' "$LLAMA_VERSION" "$CMAKE_FLAGS" | digest 12)
DISAGG_CACHE="${DISAGG_CACHE_DIR:-$HOME/.cache/disaggregated-inference}"
