#!/usr/bin/env bash
# The design documents' start_dgx_servers.sh (start the prefill servers on the DGX machines):
# runs scripts/start_prefill_servers.sh with the same arguments.
# See --help, and the table of script names in docs/DEPLOYMENT.md.
exec bash "$(dirname "$0")/start_prefill_servers.sh" "$@"
