#!/usr/bin/env bash
# Install everything timeslice needs on a fresh Debian/Ubuntu machine (Python >= 3.10):
# etcd from Debian's packages when no `etcd` is on PATH (and, for the test extra as root, Slurm
# and munge for tests/slurm), a virtualenv in .venv, and the
# project with the extras given as arguments (default: test,demo). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-test,demo}"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v etcd >/dev/null 2>&1 || ! command -v etcdctl >/dev/null 2>&1; then
    echo "==> installing etcd-server and etcd-client from apt"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null
    # Debian starts a system etcd on 2379; we start our own on free ports instead.
    as_root systemctl disable --now etcd >/dev/null 2>&1 || true
fi

# The chaos suite cuts a lockd replica off from etcd with iptables inside a network
# namespace it creates (root only; skipped with the reason otherwise).
if [ "$(id -u)" -eq 0 ] && [[ "$EXTRAS" == *test* ]] && ! command -v iptables >/dev/null 2>&1; then
    echo "==> installing iptables (chaos partition scenario)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables iproute2 >/dev/null \
        || echo "    (iptables unavailable: that scenario will be skipped)"
fi

# tests/slurm/ starts a real munge + slurmctld + slurmd of its own (Debian's Slurm 22.05 packages);
# the services the packages would start are not enabled (the test runs its own on free ports).
if [ "$(id -u)" -eq 0 ] && [[ "$EXTRAS" == *test* ]] && ! command -v slurmctld >/dev/null 2>&1; then
    echo "==> installing slurmctld, slurmd, slurm-client and munge (tests/slurm)"
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            slurmctld slurmd slurm-client munge >/dev/null; then
        systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true
    else
        echo "    (Slurm unavailable: tests/slurm will be skipped, saying so)"
    fi
fi

PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
    echo "timeslice needs Python >= 3.10 (found $("$PY" --version))" >&2
    exit 1
fi
if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    echo "==> installing python3-venv"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "$PY" -m venv .venv
fi
echo "==> installing timeslice[server,$EXTRAS] into .venv"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# server: lockd, the node agent and the launcher; a job-only install is `pip install .`
# test: also PyTorch (pinned to the version whose CPU build CI's index holds), TRL, transformers,
# datasets and accelerate, for the real-framework tests on the simulated device
.venv/bin/python -m pip install -q -e ".[server,$EXTRAS]"
echo "==> ready: etcd $(etcd --version | head -1 | awk '{print $3}'), $(.venv/bin/python --version)"
