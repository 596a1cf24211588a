#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole suite
# (unit, integration and chaos tests, all against real etcd processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo
exec .venv/bin/python -m pytest tests chaos_tests -q -p no:cacheprovider "$@"
