#!/usr/bin/env bash
# The design documents' start_mac_servers.sh (start the decode servers on the Mac Studios):
# runs scripts/start_decode_servers.sh with the same arguments.
# See --help, and the table of script names in docs/DEPLOYMENT.md.
exec bash "$(dirname "$0")/start_decode_servers.sh" "$@"
