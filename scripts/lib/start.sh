# shellcheck shell=bash
# start_prefill_servers.sh and start_decode_servers.sh: one implementation, the role as argument.
# Needs lib/common.sh sourced first.

start_usage() {  # ROLE
  cat <<EOF
Usage: $SCRIPT [options]

Start every $1 server of the cluster config, then wait until each has loaded its model.

  local servers (127.0.0.1, ...): run 'disagg serve --config FILE --server NAME' in the
      background; pid file and log in the run directory (NAME.pid, NAME.log). A server
      whose pid file points at a live process is left alone.
  remote servers: over ssh, 'sudo -n systemctl start $(systemd_unit "$1" NAME)' on Linux,
      or launchctl bootstrap/kickstart of system/$(launchd_label "$1" NAME) on macOS.
      The units must be installed first (deploy/README.md).

Options:
  --timeout SECONDS  how long to wait for the models to load (default: 900)
  --no-wait          start, but do not wait for /health to say "loaded"
$COMMON_HELP

Exit status: 0 when every server is up and loaded, 1 when one could not be started or
reached (each named in the message), 2 for a bad config or bad options.
EOF
}

WAITS=""  # name<TAB>url<TAB>pidfile<TAB>log, one line per server to wait for

start_local() {  # ROLE NAME HOST PORT URL
  local role=$1 name=$2 host=$3 port=$4 url=$5 pidfile log state pid
  pidfile=$RUN_DIR/$name.pid
  log=$RUN_DIR/$name.log
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ %s >> %s 2>&1 &   # in its own session; pid file %s\n' \
      "$(quote_args "$PY" -m disaggregated_inference serve --config "$CONFIG" --server "$name")" \
      "$(quote_args "$log")" "$(quote_args "$pidfile")"
    return 0
  fi
  mkdir -p "$RUN_DIR"
  state=$("$PY" "$OPSUTIL" pid-status --pidfile "$pidfile")
  case "$state" in
    running*)
      say "$role $name is already running (pid ${state#running }); log: $log"
      ;;
    *)
      if ! pid=$("$PY" "$OPSUTIL" spawn --pidfile "$pidfile" --log "$log" --bind "$host:$port" -- \
        "$PY" -m disaggregated_inference serve --config "$CONFIG" --server "$name"); then
        record_failure "could not start $role server $name on $host:$port"
        return 0
      fi
      say "started $role $name (pid $pid) for $url; log: $log"
      ;;
  esac
  WAITS="${WAITS}${name}	${url}	${pidfile}	${log}
"
}

start_remote() {  # ROLE NAME HOST URL
  local role=$1 name=$2 host=$3 url=$4 kind
  show_detect "$host" "$role"
  if ! kind=$(service_kind "$host" "$role"); then
    record_failure "cannot reach $host over ssh (server $name): the machine is down, unreachable, or ssh is not set up for $(ssh_target "$host")"
    return 0
  fi
  if ! remote "$host" "$(service_command start "$kind" "$role" "$name")"; then
    record_failure "starting $role server $name on $host with $kind failed (unit installed? may $(ssh_target "$host") run it with 'sudo -n'? see docs/DEPLOYMENT.md)"
    return 0
  fi
  [ "$DRY_RUN" = 1 ] || say "asked $host to start $role $name ($kind)"
  WAITS="${WAITS}${name}	${url}	-	-
"
}

start_main() {  # ROLE ARGS...
  local role=$1 timeout=${DISAGG_START_TIMEOUT:-900} wait=1
  local name host port url local_ log pidfile
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      -h | --help) start_usage "$role"; exit 0 ;;
      --timeout) need_value "$@"; timeout=$2; shift 2; continue ;;
      --timeout=*) timeout=${1#*=}; shift; continue ;;
      --no-wait) wait=0; shift; continue ;;
    esac
    parse_common "$@"
    shift "$CONSUMED"
  done
  setup
  load_servers "$role"
  if [ -z "$SERVERS" ]; then
    say "no $role servers in $CONFIG${ONLY:+ among:$ONLY}"
    exit 0
  fi
  say "starting $role servers from $CONFIG"
  # Start them all first, so that the models load at the same time, then wait for each.
  while IFS='	' read -r _ name host port _ url _ _ local_ <&3; do
    if [ "$local_" = 1 ]; then
      start_local "$role" "$name" "$host" "$port" "$url"
    else
      start_remote "$role" "$name" "$host" "$url"
    fi
  done 3<<EOF
$SERVERS
EOF
  if [ "$wait" = 1 ] && [ "$DRY_RUN" = 0 ] && [ -n "$WAITS" ]; then
    say "waiting for the models to load (up to ${timeout}s)"
    while IFS='	' read -r name url pidfile log <&3; do
      [ -n "$name" ] || continue
      if [ "$pidfile" = - ]; then
        "$PY" "$OPSUTIL" wait --name "$name" --url "$url" --timeout "$timeout" ||
          record_failure "$role server $name ($url) did not become healthy"
      else
        "$PY" "$OPSUTIL" wait --name "$name" --url "$url" --timeout "$timeout" --pidfile "$pidfile" --log "$log" ||
          record_failure "$role server $name ($url) did not become healthy (log: $log)"
      fi
    done 3<<EOF
$WAITS
EOF
  fi
  finish
  if [ "$DRY_RUN" = 0 ]; then
    if [ "$wait" = 1 ]; then say "all $role servers are up"; else say "started (not waiting)"; fi
  fi
}
