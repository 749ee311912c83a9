#!/usr/bin/env bash
# The design documents' stop_all_servers.sh (stop every server):
# runs scripts/stop_all.sh with the same arguments.
# See --help, and the table of script names in docs/DEPLOYMENT.md.
exec bash "$(dirname "$0")/stop_all.sh" "$@"
