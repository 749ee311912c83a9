#!/usr/bin/env bash
# Copy this repository to every remote host of the cluster config and build its environment
# there (scripts/install.sh) with llama.cpp flags chosen by the host's role. See --help.
set -euo pipefail
# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

CUDA_FLAGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90"
METAL_FLAGS="-DGGML_METAL=on"
PREFILL_FLAGS=${DISAGG_PREFILL_CMAKE_ARGS:-$CUDA_FLAGS}
DECODE_FLAGS=${DISAGG_DECODE_CMAKE_ARGS:-$METAL_FLAGS}
REMOTE_DIR=${DISAGG_REMOTE_DIR:-/opt/disaggregated-inference}
REMOTE_PYTHON=${DISAGG_REMOTE_PYTHON:-}
REMOTE_CONFIG=/etc/disaggregated-inference/config.json
INSTALL_CONFIG=0
RSYNC_EXCLUDES=".venv/ runs/ grades/ .git/ __pycache__/ *.pyc .pytest_cache/ *.egg-info/ build/ dist/ .benchmarks/"

usage() {
  cat <<EOF
Usage: $SCRIPT [options]

For every remote host of the cluster config (servers on loopback are skipped: run
scripts/install.sh on this machine for those):
  1. check over ssh that the host answers and has what scripts/install.sh needs
     (rsync, sha256sum, python3 >= 3.10, a C++ compiler, nvcc for CUDA builds);
  2. rsync this repository to REMOTE_DIR on it (.venv, runs/, .git and caches excluded;
     files deleted here are deleted there);
  3. run scripts/install.sh there with LLAMA_CMAKE_ARGS chosen by the host's role:
       prefill hosts: $CUDA_FLAGS  (CUDA, H100)
       decode hosts:  $METAL_FLAGS  (Metal, Apple Silicon)
     A host with both roles gets the prefill flags.
  4. with --install-config, copy the config to $REMOTE_CONFIG there (sudo -n),
     where the service units read it.
Service units are installed once by hand: deploy/README.md.

Options:
  --remote-dir DIR          where the repository goes (default: $REMOTE_DIR,
                            or \$DISAGG_REMOTE_DIR); must be writable by the ssh user
  --prefill-cmake-args STR  llama.cpp flags for prefill hosts (\$DISAGG_PREFILL_CMAKE_ARGS)
  --decode-cmake-args STR   llama.cpp flags for decode hosts (\$DISAGG_DECODE_CMAKE_ARGS)
  --remote-python PATH      interpreter that creates the remote venv (default: python3 there;
                            on a Mac, e.g. /opt/homebrew/bin/python3.12)
  --install-config          also install the config file as $REMOTE_CONFIG
$COMMON_HELP

Exit status: 0 when every host is deployed, 1 when a host could not be reached or its
install failed (each named in the message), 2 for a bad config or bad options.
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --remote-dir) need_value "$@"; REMOTE_DIR=$2; shift 2; continue ;;
    --prefill-cmake-args) need_value "$@"; PREFILL_FLAGS=$2; shift 2; continue ;;
    --decode-cmake-args) need_value "$@"; DECODE_FLAGS=$2; shift 2; continue ;;
    --remote-python) need_value "$@"; REMOTE_PYTHON=$2; shift 2; continue ;;
    --install-config) INSTALL_CONFIG=1; shift; continue ;;
  esac
  parse_common "$@"
  shift "$CONSUMED"
done
setup
load_servers ""
case "$REMOTE_DIR" in /*) ;; *) die "--remote-dir must be an absolute path, not '$REMOTE_DIR'" 2 ;; esac

# Loopback servers are not deployed; list them so nobody wonders.
LOCAL_NAMES=$(printf '%s\n' "$SERVERS" | awk -F'\t' '$9 == "1" { printf "%s ", $2 }')
if [ -n "$LOCAL_NAMES" ]; then
  say "skipping servers on loopback (this machine: run scripts/install.sh here): $LOCAL_NAMES"
fi
# One line per remote host: host<TAB>roles<TAB>server names, in config order.
HOSTS=$(printf '%s\n' "$SERVERS" | awk -F'\t' '
  $9 == "0" {
    if (!($3 in seen)) { seen[$3] = 1; order[++n] = $3 }
    if (index(" " roles[$3] " ", " " $1 " ") == 0) roles[$3] = roles[$3] (roles[$3] == "" ? "" : " ") $1
    names[$3] = names[$3] (names[$3] == "" ? "" : " ") $2
  }
  END { for (i = 1; i <= n; i++) { h = order[i]; print h "\t" roles[h] "\t" names[h] } }')
if [ -z "$HOSTS" ]; then
  say "no remote hosts in $CONFIG: nothing to deploy"
  exit 0
fi
if [ "$DRY_RUN" = 0 ] && ! command -v rsync >/dev/null 2>&1; then
  die "rsync is not installed on this machine (apt-get install rsync / it ships with macOS)" 2
fi

set -f  # the exclude patterns hold '*': no globbing from here on
EXCLUDE_ARGS=""
for pattern in $RSYNC_EXCLUDES; do EXCLUDE_ARGS="$EXCLUDE_ARGS --exclude=$pattern"; done

preflight() {  # HOST FLAGS: check what install.sh needs; print what is missing
  local host=$1 flags=$2 py=${REMOTE_PYTHON:-python3} check out
  check="export PATH=\"$REMOTE_PATH_PREFIX:\$PATH\"; uname -s"
  check="$check; command -v rsync >/dev/null 2>&1 || echo 'MISSING: rsync'"
  check="$check; command -v sha256sum >/dev/null 2>&1 || echo 'MISSING: sha256sum (scripts/install.sh uses it; macOS: brew install coreutils, gnubin on PATH)'"
  check="$check; command -v c++ >/dev/null 2>&1 || echo 'MISSING: a C++ compiler (Ubuntu: build-essential; macOS: xcode-select --install)'"
  check="$check; $(quote_args "$py") -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || echo 'MISSING: $py is not Python >= 3.10 (use --remote-python)'"
  case "$flags" in
    *GGML_CUDA=on*) check="$check; command -v nvcc >/dev/null 2>&1 || echo 'MISSING: nvcc (the CUDA toolkit) for a CUDA build'" ;;
  esac
  if [ "$DRY_RUN" = 1 ]; then
    remote "$host" "$check"
    return 0
  fi
  # shellcheck disable=SC2086
  if ! out=$($SSH_CMD -n "$(ssh_target "$host")" "$check" 2>&1); then
    printf '%s\n' "$out" | tail -n 3 >&2
    return 1
  fi
  if printf '%s\n' "$out" | grep -q '^MISSING: '; then
    printf '%s\n' "$out" | sed -n 's/^MISSING: /  missing on '"$host"': /p' >&2
    return 2
  fi
  return 0
}

deploy_host() {  # HOST ROLES NAMES
  local host=$1 roles=$2 names=$3 flags install rc=0 group
  case " $roles " in
    *" prefill "*) flags=$PREFILL_FLAGS ;;
    *) flags=$DECODE_FLAGS ;;
  esac
  say "== $host ($roles: $names) llama.cpp flags: $flags"
  preflight "$host" "$flags" || rc=$?
  if [ "$rc" = 1 ]; then
    record_failure "cannot reach $host over ssh (servers: $names): the machine is down, unreachable, or ssh is not set up for $(ssh_target "$host")"
    return 0
  elif [ "$rc" != 0 ]; then
    record_failure "$host (servers: $names) lacks what scripts/install.sh needs (listed above)"
    return 0
  fi
  remote "$host" "mkdir -p $(quote_args "$REMOTE_DIR")" ||
    { record_failure "cannot create $REMOTE_DIR on $host (servers: $names)"; return 0; }
  # shellcheck disable=SC2086  # EXCLUDE_ARGS: one word per pattern, globbing is off
  run rsync -az --delete $EXCLUDE_ARGS -e "$SSH_CMD" "$REPO/" "$(ssh_target "$host"):$REMOTE_DIR/" ||
    { record_failure "rsync of the repository to $host:$REMOTE_DIR failed (servers: $names)"; return 0; }
  install="cd $(quote_args "$REMOTE_DIR") && export PATH=\"$REMOTE_PATH_PREFIX:\$PATH\" && LLAMA_CMAKE_ARGS=$(quote_args "$flags")"
  [ -z "$REMOTE_PYTHON" ] || install="$install PYTHON=$(quote_args "$REMOTE_PYTHON")"
  install="$install bash scripts/install.sh"
  remote "$host" "$install" ||
    { record_failure "scripts/install.sh failed on $host (servers: $names); run it there by hand to see why"; return 0; }
  if [ "$INSTALL_CONFIG" = 1 ]; then
    # readable by the service user only: the file may hold the API token
    # shellcheck disable=SC2016  # expanded by the remote shell
    group='$( [ "$(uname -s)" = Darwin ] && echo staff || echo disagg )'
    local put
    put="sudo -n mkdir -p $(dirname "$REMOTE_CONFIG") && sudo -n tee $REMOTE_CONFIG.new >/dev/null && sudo -n chgrp $group $REMOTE_CONFIG.new && sudo -n chmod 0640 $REMOTE_CONFIG.new && sudo -n mv $REMOTE_CONFIG.new $REMOTE_CONFIG"
    if [ "$DRY_RUN" = 1 ]; then
      # shellcheck disable=SC2086
      printf '+ %s < %s\n' "$(quote_args $SSH_CMD "$(ssh_target "$host")" "$put")" "$(quote_args "$CONFIG")"
    else
      # shellcheck disable=SC2086
      $SSH_CMD "$(ssh_target "$host")" "$put" <"$CONFIG" ||
        { record_failure "could not install the config as $REMOTE_CONFIG on $host (sudo -n allowed? group disagg exists?)"; return 0; }
    fi
  fi
  [ "$DRY_RUN" = 1 ] || say "$host: deployed to $REMOTE_DIR"
}

while IFS='	' read -r host roles names <&3; do
  [ -n "$host" ] || continue
  deploy_host "$host" "$roles" "$names"
done 3<<EOF
$HOSTS
EOF

finish
[ "$DRY_RUN" = 1 ] || say "done. Next: scripts/start_prefill_servers.sh and scripts/start_decode_servers.sh --config $CONFIG"
