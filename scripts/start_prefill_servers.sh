#!/usr/bin/env bash
# Start the prefill servers of the cluster config: local ones in the background (pid file + log
# under runs/servers/), remote ones through their service units over ssh. See --help.
set -euo pipefail
# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"
# shellcheck source=lib/start.sh
. "$REPO/scripts/lib/start.sh"
start_main prefill "$@"
