#!/usr/bin/env bash
# Follow the logs of every server of the cluster config, one tmux pane each. See --help.
set -euo pipefail
# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

TMUX_BIN=${DISAGG_TMUX:-tmux}

usage() {
  cat <<EOF
Usage: $SCRIPT [options]

Open a tmux session with one pane per server of the cluster config, each following
that server's log:
  local servers:   tail -F RUN_DIR/NAME.log (written by the start scripts)
  remote, systemd: ssh -t HOST journalctl -f -u disagg-ROLE@NAME.service
                   (the ssh user must be allowed to read the journal: group systemd-journal or adm)
  remote, launchd: ssh -t HOST tail -F $LAUNCHD_LOG_DIR/NAME.log
A pane whose command ends stays open and says so. Detach with Ctrl-b d; the session
keeps running (tmux attach -t SESSION to come back, tmux kill-session -t SESSION to end it).

Options:
  --session NAME   tmux session name (default: disagg-logs); if it exists, it is attached
  --socket NAME    use a separate tmux server (tmux -L NAME)
  --lines N        lines of history per pane (default: 200)
  --no-attach      create the session but do not attach to it
$COMMON_HELP
  With --dry-run, the command of each pane is printed instead.

Exit status: 0 on success, 1 when tmux is missing or a host could not be reached (named
in the message), 2 for a bad config or bad options.
EOF
}

session=disagg-logs
socket=""
lines=200
attach=1
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --session) need_value "$@"; session=$2; shift 2; continue ;;
    --socket) need_value "$@"; socket=$2; shift 2; continue ;;
    --lines) need_value "$@"; lines=$2; shift 2; continue ;;
    --no-attach) attach=0; shift; continue ;;
  esac
  parse_common "$@"
  shift "$CONSUMED"
done
case "$lines" in '' | *[!0-9]*) die "--lines must be a number, not '$lines'" 2 ;; esac
setup
if [ "$DRY_RUN" = 0 ] && ! command -v "$TMUX_BIN" >/dev/null 2>&1; then
  die "tmux is not installed (apt-get install tmux / brew install tmux); without it, follow one log with: tail -F $RUN_DIR/NAME.log, or ssh HOST journalctl -f -u disagg-ROLE@NAME.service"
fi
load_servers ""
[ -n "$SERVERS" ] || die "no servers in $CONFIG${ONLY:+ among:$ONLY}" 2

tmux_() {
  if [ -n "$socket" ]; then "$TMUX_BIN" -L "$socket" "$@"; else "$TMUX_BIN" "$@"; fi
}

# One line per pane: title<TAB>command.
PANES=""
while IFS='	' read -r role name host port _ _ _ _ local_ <&3; do
  [ -n "$name" ] || continue
  title="$role $name ($host:$port)"
  if [ "$local_" = 1 ]; then
    cmd=$(quote_args tail -n "$lines" -F "$RUN_DIR/$name.log")
  else
    show_detect "$host" "$role"
    if ! kind=$(service_kind "$host" "$role"); then
      record_failure "cannot reach $host over ssh (server $name): the machine is down, unreachable, or ssh is not set up for $(ssh_target "$host")"
      continue
    fi
    if [ "$kind" = systemd ]; then
      follow="journalctl -f -n $lines -u $(systemd_unit "$role" "$name")"
    else
      follow="tail -n $lines -F $LAUNCHD_LOG_DIR/$name.log"
    fi
    # shellcheck disable=SC2086
    cmd=$(quote_args $SSH_CMD -t "$(ssh_target "$host")" "$follow")
  fi
  PANES="${PANES}${title}	${cmd}
"
done 3<<EOF
$SERVERS
EOF
finish

if [ "$DRY_RUN" = 1 ]; then
  while IFS='	' read -r title cmd <&3; do
    [ -n "$title" ] && printf '+ [%s] %s\n' "$title" "$cmd"
  done 3<<EOF
$PANES
EOF
  exit 0
fi

if tmux_ has-session -t "=$session" 2>/dev/null; then
  say "tmux session '$session' already exists"
else
  first=1
  while IFS='	' read -r title cmd <&3; do
    [ -n "$title" ] || continue
    # The pane says when its command ends and stays until Enter is pressed.
    pane="printf '%s\\n' $(quote_args "== $title ==") ; $cmd; echo; echo \"[log command ended with status \$?; press Enter to close]\"; read _"
    if [ "$first" = 1 ]; then
      tmux_ new-session -d -s "$session" -n logs -x 220 -y 60 "$pane"
      tmux_ set-option -t "$session" pane-border-status top >/dev/null 2>&1 || true
      tmux_ set-option -t "$session" pane-border-format ' #{pane_title} ' >/dev/null 2>&1 || true
      first=0
    else
      tmux_ split-window -t "$session:logs" "$pane"
      tmux_ select-layout -t "$session:logs" tiled >/dev/null
    fi
    tmux_ select-pane -t "$session:logs" -T "$title" 2>/dev/null || true
  done 3<<EOF
$PANES
EOF
  tmux_ select-layout -t "$session:logs" tiled >/dev/null
  say "tmux session '$session' created with one pane per server"
fi

attach_hint="tmux${socket:+ -L $socket} attach -t $session"
if [ "$attach" = 0 ]; then
  say "attach with: $attach_hint"
elif [ -n "${TMUX:-}" ] && [ -z "$socket" ]; then
  tmux_ switch-client -t "$session"
elif [ -t 0 ] && [ -t 1 ]; then
  tmux_ attach -t "$session"
else
  say "not on a terminal; attach with: $attach_hint"
fi
