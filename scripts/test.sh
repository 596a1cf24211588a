#!/usr/bin/env bash
# The README's test command: set everything up, then run the whole suite
# (unit, integration and chaos tests, all against real etcd processes).
#
# On parallel workers (pytest-xdist): the tests mostly wait (leases, elections, process starts),
# so more workers than cores pay off. Each worker has its own etcd, ports and per-user state
# (testing/pytest_plugin.py); tests that must not run beside each other share an xdist_group.
# TIMESLICE_TEST_WORKERS=N sets the count (0: everything in one process, as before).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,demo
WORKERS="${TIMESLICE_TEST_WORKERS:-4}"
exec .venv/bin/python -m pytest tests chaos_tests -q -p no:cacheprovider -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@"
