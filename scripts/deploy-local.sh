#!/usr/bin/env bash
# A real Flower deployment on this machine: one flower-superlink and N flower-supernode
# processes on loopback, TLS and SuperNode authentication on, the run submitted with `flwr run`.
#
#   scripts/deploy-local.sh --clients N --rounds R [--dataset D] [--subset M] [--method M]
#       [--epsilon E] [--batch-size B] [--run-config "k=v ..."] [--work DIR] --out DIR
#   scripts/deploy-local.sh --clients 3 --rounds 4 --secure-aggregation --noise distributed --isolate
#       --client-data DIR --node-config "max-epsilon=10" [--node-config-for K "k=v ..."] --out DIR
#   scripts/deploy-local.sh --recipe NAME [flags in place of its values] --out DIR
#
# Writes DIR/result.json (the schema of `fedsd simulate`, plus "tls": true, "node_auth": true)
# and stops every process it started, also on failure, Ctrl-C or SIGTERM. Uses the project's
# venv (`make venv`) unless PYTHON names another interpreter.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$here/.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
    case "${1:-}" in -h|--help)  # the usage above, without the venv (the full option list needs it)
        sed -n '2,14s/^# \{0,1\}//p' "$0"
        echo "(every option: $0 --help, once 'make venv' has made the environment)"
        exit 0;;
    esac
    echo "deploy-local: no $PYTHON; run 'make venv' first (or set PYTHON)" >&2
    exit 2
fi
# exec: Ctrl-C and SIGTERM reach the Python process, which stops what it started.
exec "$PYTHON" -m fedsd.deployment.deploy_local "$@"
