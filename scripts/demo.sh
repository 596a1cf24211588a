#!/usr/bin/env bash
# The first command of the README: install what is missing, then run `timeslice demo`.
#
#   scripts/demo.sh                    # on a fresh Debian/Ubuntu machine with Python >= 3.10
#   scripts/demo.sh --iterations 2     # extra arguments go to `timeslice demo`
#
# Steps:
#   1. scripts/setup.sh demo: etcd from apt when no `etcd` is on PATH, a Python >= 3.10
#      virtual environment in .venv, the project with the demo extra (each step idempotent);
#   2. timeslice demo: starts a local cluster (etcd, 3 lockd replicas, a node
#      agent) unless one is running, runs two RL jobs without and with
#      time-slicing, stops the cluster, and writes the timeline picture.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
VENV=.venv

say() { printf '\n==> %s\n' "$*"; }

bash scripts/setup.sh demo

# -- the demo ------------------------------------------------------------------------
say "running: timeslice demo $*"
log="$(mktemp -t timeslice-demo.XXXXXX)"
trap 'rm -f "$log"' EXIT
set +e
"$VENV/bin/timeslice" demo "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
picture="$(sed -n 's/^timeline: //p' "$log" | tail -n 1)"
if [ "$rc" -ne 0 ]; then
    echo "demo.sh: timeslice demo failed (exit $rc)" >&2
    exit "$rc"
fi
say "done. The timeline picture: ${picture:-(not written)}"
