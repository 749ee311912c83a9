#!/usr/bin/env bash
# The design documents' deploy_to_machines.sh (deploy the code to every machine):
# runs scripts/deploy.sh with the same arguments.
# See --help, and the table of script names in docs/DEPLOYMENT.md.
exec bash "$(dirname "$0")/deploy.sh" "$@"
