#!/usr/bin/env bash
# Stop the servers of the cluster config: local ones through the pid files the start scripts
# wrote (never a process they did not start), remote ones through their service units. See --help.
set -euo pipefail
# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

usage() {
  cat <<EOF
Usage: $SCRIPT [options]

Stop every server of the cluster config, decode servers first.

  local servers: the process recorded in RUN_DIR/NAME.pid (written by the start scripts) and
      its children get SIGTERM (gunicorn's graceful stop), then SIGKILL after the grace period.
      A pid file whose process is gone, or whose PID now belongs to another process (the
      pid file records the creation time), is removed without signalling anything.
      Processes not started by the start scripts are never touched.
  remote servers: over ssh, 'sudo -n systemctl stop disagg-ROLE@NAME.service' on Linux, or
      'launchctl bootout system/com.disaggregated-inference.ROLE.NAME' on macOS.

Options:
  --timeout SECONDS  grace period before SIGKILL for local servers (default: 30)
  --local-only       leave remote servers alone
  --remote-only      leave local servers alone
  --all-local        also stop servers with a pid file in the run directory that are not
                     in this config (still only processes the start scripts started)
$COMMON_HELP

Exit status: 0 when everything asked for is stopped, 1 when a host could not be reached
or a server would not stop (each named in the message), 2 for a bad config or bad options.
EOF
}

timeout=30
do_local=1
do_remote=1
all_local=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --timeout) need_value "$@"; timeout=$2; shift 2; continue ;;
    --timeout=*) timeout=${1#*=}; shift; continue ;;
    --local-only) do_remote=0; shift; continue ;;
    --remote-only) do_local=0; shift; continue ;;
    --all-local) all_local=1; shift; continue ;;
  esac
  parse_common "$@"
  shift "$CONSUMED"
done
setup
load_servers ""

STOPPED_PIDFILES=" "

stop_local() {  # NAME
  local name=$1 pidfile=$RUN_DIR/$1.pid out
  STOPPED_PIDFILES="$STOPPED_PIDFILES$pidfile "
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ %s\n' "$(quote_args "$PY" "$OPSUTIL" stop --pidfile "$pidfile" --timeout "$timeout")"
    return 0
  fi
  if out=$("$PY" "$OPSUTIL" stop --pidfile "$pidfile" --timeout "$timeout"); then
    say "$name: $out"
  else
    record_failure "could not stop local server $name (pid file $pidfile)"
  fi
}

stop_remote() {  # ROLE NAME HOST
  local role=$1 name=$2 host=$3 kind
  show_detect "$host" "$role"
  if ! kind=$(service_kind "$host" "$role"); then
    record_failure "cannot reach $host over ssh (server $name): the machine is down, unreachable, or ssh is not set up for $(ssh_target "$host")"
    return 0
  fi
  if remote "$host" "$(service_command stop "$kind" "$role" "$name")"; then
    [ "$DRY_RUN" = 1 ] || say "$name: stopped on $host ($kind)"
  else
    record_failure "stopping $role server $name on $host with $kind failed"
  fi
}

for wanted in decode prefill; do
  while IFS='	' read -r role name host _ _ _ _ _ local_ <&3; do
    if [ -z "$role" ] || [ "$role" != "$wanted" ]; then continue; fi
    if [ "$local_" = 1 ]; then
      [ "$do_local" = 0 ] || stop_local "$name"
    else
      [ "$do_remote" = 0 ] || stop_remote "$role" "$name" "$host"
    fi
  done 3<<EOF
$SERVERS
EOF
done

if [ "$all_local" = 1 ] && [ "$do_local" = 1 ]; then
  for pidfile in "$RUN_DIR"/*.pid; do
    [ -e "$pidfile" ] || continue
    case "$STOPPED_PIDFILES" in *" $pidfile "*) continue ;; esac
    stop_local "$(basename "$pidfile" .pid)"
  done
fi

finish
