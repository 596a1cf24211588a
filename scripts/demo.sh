#!/usr/bin/env bash
# The first command of the README: install what is missing, then run `timeslice demo`.
#
#   scripts/demo.sh                    # on a fresh Debian/Ubuntu machine with Python >= 3.10
#   scripts/demo.sh --iterations 2     # extra arguments go to `timeslice demo`
#
# Steps, each skipped when already done (so running it again is cheap):
#   1. etcd: when no `etcd` is on PATH (and $TIMESLICE_ETCD_BIN is unset),
#      apt-get install etcd-server etcd-client (with sudo unless root);
#   2. a Python >= 3.10 virtual environment in .venv (python3-venv from apt if needed);
#   3. pip install -e '.[demo]' (again only when pyproject.toml changed);
#   4. timeslice demo: starts a local cluster (etcd, 3 lockd replicas, a node
#      agent) unless one is running, runs two RL jobs without and with
#      time-slicing, stops the cluster, and writes the timeline picture.
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

say() { printf '\n==> %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        echo "demo.sh: need root for: $* (no sudo found)" >&2
        exit 1
    fi
}

apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "demo.sh: no apt-get here; install $* yourself and run me again" >&2
        exit 1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@"
}

# -- 1. etcd -------------------------------------------------------------------
if [ -n "${TIMESLICE_ETCD_BIN:-}" ]; then
    say "etcd: using $TIMESLICE_ETCD_BIN"
elif command -v etcd >/dev/null 2>&1; then
    say "etcd: found $(command -v etcd)"
else
    say "etcd: not found; installing etcd-server and etcd-client with apt"
    apt_install etcd-server etcd-client
    command -v etcd >/dev/null 2>&1 || { echo "demo.sh: etcd still not on PATH" >&2; exit 1; }
fi

# -- 2. Python and the virtual environment ----------------------------------------
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "demo.sh: $PYTHON not found; install Python >= 3.10 (or set PYTHON=...)" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "demo.sh: $("$PYTHON" -V 2>&1) is too old; timeslice needs Python >= 3.10 (set PYTHON=...)" >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    say "creating the virtual environment $VENV"
    if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        say "python venv support missing; installing python3-venv with apt"
        apt_install python3-venv
        "$PYTHON" -m venv "$VENV"
    fi
else
    say "virtual environment: $VENV"
fi

# -- 3. the project -----------------------------------------------------------------
stamp="$VENV/.timeslice-demo-installed"
want="$(sha256sum pyproject.toml | cut -d" " -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ] || ! "$VENV/bin/python" -c 'import timeslice.cli, matplotlib' 2>/dev/null; then
    say "installing timeslice with the demo extra (pip install -e '.[demo]')"
    "$VENV/bin/python" -m pip install --quiet -e '.[demo]'
    echo "$want" > "$stamp"
else
    say "timeslice is installed in $VENV"
fi

# -- 4. the demo ---------------------------------------------------------------------
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
