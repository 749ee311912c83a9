# shellcheck shell=bash disable=SC2034  # the variables here are used by the scripts that source this
# Shared by the operations scripts (scripts/*.sh): config, options, ssh, service names.
# Written for bash 3.2 too (the Macs' /bin/bash): no associative arrays, no mapfile,
# no expansion of possibly empty arrays under `set -u`.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SCRIPT=$(basename "$0")
PY=${DISAGG_PYTHON:-$REPO/.venv/bin/python}
OPSUTIL=$REPO/scripts/lib/opsutil.py

CONFIG=${DISAGG_CONFIG:-}
ONLY=""                     # space-separated server names (--only, repeatable)
DRY_RUN=0
RUN_DIR=${DISAGG_RUN_DIR:-$REPO/runs/servers}
SSH_USER=${DISAGG_SSH_USER:-}
MANAGER=${DISAGG_SERVICE_MANAGER:-auto}   # auto | systemd | launchd
REMOTE_PATH_PREFIX="/opt/homebrew/bin:/usr/local/bin:/usr/local/cuda/bin"
LAUNCHD_DIR=/Library/LaunchDaemons
LAUNCHD_LOG_DIR=/Library/Logs/disaggregated-inference
FAILED=""                   # what went wrong, one item per line; the scripts exit 1 if set

say() { printf '[%s] %s\n' "${SCRIPT%.*}" "$*" >&2; }
warn() { printf '[%s] warning: %s\n' "${SCRIPT%.*}" "$*" >&2; }
die() {  # die MESSAGE [EXIT_CODE]
  printf '%s: error: %s\n' "$SCRIPT" "$1" >&2
  exit "${2:-1}"
}
record_failure() {  # remember a failure, keep going with the other servers
  printf '%s: error: %s\n' "$SCRIPT" "$*" >&2
  FAILED="${FAILED}${FAILED:+
}$*"
}
finish() {  # exit 1 with a summary if anything failed
  if [ -n "$FAILED" ]; then
    printf '%s: FAILED:\n' "$SCRIPT" >&2
    printf '%s\n' "$FAILED" | sed 's/^/  - /' >&2
    exit 1
  fi
}

# Quote arguments for display, the way a shell would read them back.
quote_args() {
  local out="" arg
  for arg in "$@"; do
    case "$arg" in
      "" | *[!A-Za-z0-9_@%+=:,./-]*) arg="'$(printf '%s' "$arg" | sed "s/'/'\\\\''/g")'" ;;
    esac
    out="${out}${out:+ }$arg"
  done
  printf '%s' "$out"
}

# Run a command, or only print it with --dry-run.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ %s\n' "$(quote_args "$@")"
    return 0
  fi
  "$@"
}

need_value() {  # need_value OPTION VALUE...: the option must be followed by a value
  [ $# -ge 2 ] || die "$1 needs a value (see --help)" 2
}

# Options every script takes, after its own: sets CONSUMED to the number of words used; any other
# option is an error (exit 2).
parse_common() {
  CONSUMED=1
  case "$1" in
    --config) need_value "$@"; CONFIG=$2; CONSUMED=2 ;;
    --config=*) CONFIG=${1#*=} ;;
    --only) need_value "$@"; ONLY="$ONLY $2"; CONSUMED=2 ;;
    --only=*) ONLY="$ONLY ${1#*=}" ;;
    -n | --dry-run) DRY_RUN=1 ;;
    --run-dir) need_value "$@"; RUN_DIR=$2; CONSUMED=2 ;;
    --run-dir=*) RUN_DIR=${1#*=} ;;
    --ssh-user) need_value "$@"; SSH_USER=$2; CONSUMED=2 ;;
    --ssh-user=*) SSH_USER=${1#*=} ;;
    --manager) need_value "$@"; MANAGER=$2; CONSUMED=2 ;;
    --manager=*) MANAGER=${1#*=} ;;
    *) die "unknown option: $1 (see --help)" 2 ;;
  esac
}

COMMON_HELP="Common options:
  --config FILE      cluster config (default: \$DISAGG_CONFIG, else ./config_current.json,
                     else the repository's config_current.json)
  --only NAME        only this server (repeatable; for deploy.sh: only this server's host)
  -n, --dry-run      print the commands instead of running them
  --run-dir DIR      pid files and logs of locally started servers
                     (default: \$DISAGG_RUN_DIR or <repo>/runs/servers)
  --ssh-user USER    user for ssh to remote hosts (default: \$DISAGG_SSH_USER or ssh's own)
  --manager KIND     service manager on remote hosts: auto (ask 'uname -s' over ssh:
                     Linux -> systemd, Darwin -> launchd), systemd or launchd
  -h, --help         this help

Servers on 127.0.0.1/localhost/::1/0.0.0.0 are local: started as background processes
with a pid file and a log under the run directory. Any other host is remote: reached
with ssh (BatchMode, ConnectTimeout 5 s; extra options in \$DISAGG_SSH_OPTS) and managed
through its service units (deploy/systemd, deploy/launchd)."

# Check the Python, the config and the manager choice; make CONFIG absolute.
setup() {
  [ -x "$PY" ] || die "no Python at $PY: run scripts/install.sh first (or set DISAGG_PYTHON)" 2
  if [ -z "$CONFIG" ]; then
    if [ -f config_current.json ]; then CONFIG=config_current.json; else CONFIG=$REPO/config_current.json; fi
  fi
  [ -f "$CONFIG" ] || die "config file not found: $CONFIG" 2
  CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
  case "$MANAGER" in auto | systemd | launchd) ;; *) die "--manager must be auto, systemd or launchd, not '$MANAGER'" 2 ;; esac
  case "$RUN_DIR" in /*) ;; *) RUN_DIR="$(pwd)/$RUN_DIR" ;; esac
}

# SERVERS: one line per server of the config (optionally of one role, and --only):
#   role name host port model url data_url backend local(1|0), tab-separated.
load_servers() {
  local role_arg=""
  [ -n "${1:-}" ] && role_arg="--role=$1"
  # shellcheck disable=SC2086  # ONLY holds validated names separated by spaces
  SERVERS=$("$PY" "$OPSUTIL" servers --config "$CONFIG" $role_arg ${ONLY:+--only $ONLY}) || exit 2
}

# -- ssh --------------------------------------------------------------------------------------

ssh_target() {
  if [ -n "$SSH_USER" ]; then printf '%s@%s' "$SSH_USER" "$1"; else printf '%s' "$1"; fi
}

SSH_CMD="ssh -o BatchMode=yes -o ConnectTimeout=${DISAGG_SSH_TIMEOUT:-5}${DISAGG_SSH_OPTS:+ $DISAGG_SSH_OPTS}"

# remote HOST COMMAND: run COMMAND (a shell string) on HOST, stdin closed; --dry-run prints it.
remote() {
  local host=$1 cmd=$2
  # shellcheck disable=SC2086  # SSH_CMD is a command with options
  run $SSH_CMD -n "$(ssh_target "$host")" "$cmd"
}

# remote_os HOST: print Linux/Darwin; on failure print ssh's complaint to stderr and return 1.
remote_os() {
  local host=$1 out
  # shellcheck disable=SC2086
  if ! out=$($SSH_CMD -n "$(ssh_target "$host")" uname -s 2>&1); then
    printf '%s\n' "$out" | tail -n 3 >&2
    return 1
  fi
  printf '%s\n' "$out" | tail -n 1
}

# service_kind HOST ROLE: systemd or launchd for a remote host. With --manager auto it asks
# the host (uname over ssh); in a dry run it prints that question and guesses from the role
# (prefill: a DGX with systemd, decode: a Mac with launchd).
# Returns 1 (ssh's complaint on stderr) when the host cannot be reached.
service_kind() {
  local host=$1 role=$2 os
  if [ "$MANAGER" != auto ]; then printf '%s' "$MANAGER"; return 0; fi
  if [ "$DRY_RUN" = 1 ]; then
    if [ "$role" = prefill ]; then printf systemd; else printf launchd; fi
    return 0
  fi
  os=$(remote_os "$host") || return 1
  case "$os" in
    Linux) printf systemd ;;
    Darwin) printf launchd ;;
    *) echo "unexpected 'uname -s' answer from $host: $os" >&2; return 1 ;;
  esac
}

# In a dry run with --manager auto, show the question service_kind would ask.
show_detect() {  # HOST ROLE
  if [ "$DRY_RUN" = 1 ] && [ "$MANAGER" = auto ]; then
    # shellcheck disable=SC2086
    printf '+ %s   # Linux -> systemd, Darwin -> launchd (guessed here from the role: %s)\n' \
      "$(quote_args $SSH_CMD -n "$(ssh_target "$1")" uname -s)" "$(service_kind "$1" "$2")"
  fi
}

systemd_unit() { printf 'disagg-%s@%s.service' "$1" "$2"; }          # ROLE NAME
launchd_label() { printf 'com.disaggregated-inference.%s.%s' "$1" "$2"; }  # ROLE NAME

# The shell string that starts/stops one server's service on its host.
service_command() {  # ACTION(start|stop) KIND ROLE NAME
  local action=$1 kind=$2 role=$3 name=$4 label
  if [ "$kind" = systemd ]; then
    printf 'sudo -n systemctl %s %s' "$action" "$(systemd_unit "$role" "$name")"
    return
  fi
  label=$(launchd_label "$role" "$name")
  if [ "$action" = start ]; then
    printf 'sudo -n launchctl print system/%s >/dev/null 2>&1 || sudo -n launchctl bootstrap system %s/%s.plist; sudo -n launchctl kickstart system/%s' \
      "$label" "$LAUNCHD_DIR" "$label" "$label"
  else
    printf 'if sudo -n launchctl print system/%s >/dev/null 2>&1; then sudo -n launchctl bootout system/%s; fi' \
      "$label" "$label"
  fi
}
