"""Starting a local cluster, step by step: etcd, then the lockd replicas and the agent, then the group.

Each step fills in the ``LocalCluster`` handle (cluster.py) as it goes, so that
a failure part-way leaves a handle that stops exactly what started.
"""
from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from timeslice.common.server.auth import (
    ENV_ADMIN_TOKEN,
    ENV_ADMIN_TOKEN_FILE,
    TOKEN_FILE_NAME,
    write_token_file,
)
from timeslice.common.server.netutil import free_port
from timeslice.launcher.etcd import (
    EtcdMember,
    find_etcd,
    initial_cluster,
    start_members,
)
from timeslice.launcher.procs import ChildFailed
from timeslice.launcher.progress import clip, size_text
from timeslice.launcher.servers import LockdReplica, NodeAgent, read_leader

if TYPE_CHECKING:
    from timeslice.launcher.cluster import LocalCluster


class LeaderTimeout(RuntimeError):
    """No lockd replica became leader in time."""


def start_etcd(c: LocalCluster, timeout: float) -> None:
    s = c.settings
    binary = find_etcd()
    n = s.etcd_members
    c.progress(f"etcd: starting {n} member{'s' if n > 1 else ''} ({binary})")
    names = [f"m{i}" for i in range(n)]
    attempt_no = iter(range(1 << 30))

    def attempt() -> list[EtcdMember]:
        cports = [s.etcd_client_port + i if s.etcd_client_port else free_port() for i in range(n)]
        pports = [s.etcd_peer_port + i if s.etcd_peer_port else free_port() for i in range(n)]
        shared = ["--initial-cluster", initial_cluster(names, pports),
                  "--initial-cluster-token", f"timeslice-{c.run_dir.name}-{next(attempt_no)}",
                  # compact history older than an hour: a long-running local
                  # cluster (the agent refreshes its key) stays small
                  "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h",
                  "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
        members = [EtcdMember(nm, cp, pp, str(c.run_dir / "etcd" / f"{nm}.etcd"), str(c.run_dir / f"etcd-{nm}.log"),
                              shared, binary) for nm, cp, pp in zip(names, cports, pports)]
        c.etcd = []
        c.etcd.extend(members)         # the handle stops what started, should the start fail
        return members

    def wait(members: list[EtcdMember]) -> None:
        for m in members:
            m.wait_healthy(timeout, c.interrupted)

    def discard(members: list[EtcdMember]) -> None:
        for m in members:
            m.stop(2)
        shutil.rmtree(c.run_dir / "etcd", ignore_errors=True)

    fixed = bool(s.etcd_client_port or s.etcd_peer_port)
    start_members(attempt, wait, discard, attempts=1 if fixed else 3,
                  on_retry=lambda: c.progress("etcd: a port was taken meanwhile; trying fresh ports"))
    c.progress(f"etcd: healthy at {c.etcd_endpoints_str}")


def start_lockd_and_agent(c: LocalCluster, timeout: float) -> None:
    s = c.settings
    eps = c.etcd_endpoints_str
    env = {**os.environ, "PYTHONUNBUFFERED": "1", ENV_ADMIN_TOKEN_FILE: admin_token_file(c)}
    env.pop(ENV_ADMIN_TOKEN, None)         # the file is the one source: lockd, the agent and the CLI share it
    n = s.lockd_replicas
    c.progress(f"lockd: starting {n} replica{'s' if n > 1 else ''}; "
               f"nodeagent: starting on node {c.node!r} (backend {s.backend})")
    replicas: list[LockdReplica] = []
    for i in range(n):                     # all of them at once; then wait for each
        replicas.append(LockdReplica(
            f"r{i}", eps, s.prefix, str(c.run_dir / f"lockd-r{i}.log"),
            listen_port=s.lockd_port + i if s.lockd_port else 0,
            metrics_port=s.lockd_metrics_port + i if s.lockd_metrics_port else free_port(),
            env=env, python=c.python).spawn())
        c.lockd.append(replicas[-1])
    agent = c.agent = agent_child(c, eps, env).spawn()
    for r in replicas:
        r.wait_serving(timeout, c.interrupted)
        c.progress(f"lockd {r.name}: ready at 127.0.0.1:{r.info['port']} "
                   f"(metrics :{r.info['metrics_port']}, pid {r.pid})")
    c.leader = wait_leader(c, timeout)
    c.progress(f"lockd: leader is {c.leader['replica']} (epoch {c.leader['epoch']})")
    agent.wait_serving(timeout, c.interrupted)
    why, _, passed = agent.info.get("why", "").partition(" (passed over: ")
    c.progress(f"nodeagent {c.node}: ready at 127.0.0.1:{agent.info['port']} "
               f"(metrics :{agent.info['metrics_port']}), "
               f"backend {c.backend}" + (f": {why}" if why else ""))
    if passed:
        c.progress(f"nodeagent: passed over {clip(passed.rstrip(')'), 150)}")
    if c.backend == "sim":
        c.progress(f"nodeagent: SIMULATED device of {size_text(s.sim_device_capacity_bytes)} in {c.sim_dir} "
                   f"(snapshot {s.sim_snapshot_bytes_per_s / 1e9:g} GB/s, "
                   f"restore {s.sim_restore_bytes_per_s / 1e9:g} GB/s)")


def admin_token_file(c: LocalCluster) -> str:
    """The admin token of this cluster, in <run_dir>/admin-token (mode 0600): $TIMESLICE_ADMIN_TOKEN
    if set, else a fresh random one. This process's own admin calls use it too."""
    path = c.run_dir / TOKEN_FILE_NAME
    write_token_file(path, os.environ.get(ENV_ADMIN_TOKEN, "").strip() or secrets.token_urlsafe(32))
    if not os.environ.get(ENV_ADMIN_TOKEN):
        os.environ[ENV_ADMIN_TOKEN_FILE] = str(path)
    return str(path)


def agent_child(c: LocalCluster, eps: str, env: dict) -> NodeAgent:
    s = c.settings
    c.sim_dir = pick_sim_dir(c)
    socket = str(c.run_dir / "agent.sock")
    agent = NodeAgent(
        c.node, eps, s.prefix, str(c.run_dir / "nodeagent.log"), state_dir=str(c.run_dir / "nodeagent-state"),
        backend=s.backend, listen_port=s.nodeagent_port or 0, metrics_port=s.nodeagent_metrics_port or free_port(),
        sim_dir=c.sim_dir, sim_capacity_bytes=s.sim_device_capacity_bytes,
        sim_checkpoint_gbps=s.sim_snapshot_bytes_per_s / 1e9, sim_restore_gbps=s.sim_restore_bytes_per_s / 1e9,
        # The cooperative channel lives in the run dir: jobs find it through $TIMESLICE_AGENT_SOCKET
        # (`timeslice up` prints it) or the cluster's per-user pointer (timeslice.common.local). Attestation
        # is required, as in deploy/: the agent acts only on processes that proved over the channel
        # that they are the registering job's.
        channel_socket=socket, extra=["--require-attestation"] if c.require_attestation else [],
        env={**env, "TIMESLICE_SIM_HOST_DIR": str(Path(c.sim_dir) / "host")}, python=c.python)
    agent.info.update(sim_dir=c.sim_dir, agent_socket=socket, sim_capacity_bytes=s.sim_device_capacity_bytes)
    return agent


def pick_sim_dir(c: LocalCluster) -> str:
    """RAM (/dev/shm) when it has room for the device and its host copies, else the run dir."""
    if c.sim_dir_wanted:
        return c.sim_dir_wanted
    local = c.run_dir / "sim"
    shm = Path("/dev/shm")
    need = 3 * c.settings.sim_device_capacity_bytes
    try:
        st = os.statvfs(shm)
        roomy = os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize > need
    except OSError:
        roomy = False
    c.sim_dir_ours = True
    if not roomy:
        local.mkdir(parents=True, exist_ok=True)
        return str(local)
    d = shm / f"timeslice-sim-{c.run_dir.name}-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    try:
        if not local.exists():
            local.symlink_to(d)
    except OSError:
        pass
    return str(d)


def wait_leader(c: LocalCluster, timeout: float) -> dict:
    """The lowest election key under <prefix>leader/ (read over etcd's JSON gateway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = read_leader([int(m.info["client_port"]) for m in c.etcd], c.settings.prefix)
        if found:
            return found
        for r in c.lockd:
            if not r.alive():
                raise ChildFailed(f"lockd {r.name} exited (rc={r.returncode()}); "
                                  f"last lines of {r.log_path}:\n{r.log_tail()}")
        if c.interrupted():
            raise KeyboardInterrupt
        time.sleep(0.1)
    raise LeaderTimeout(f"no lockd replica became leader within {timeout:.0f}s; see {c.run_dir}/lockd-*.log")


def create_group(c: LocalCluster, group: str) -> None:
    from timeslice.client import OrchestratorClient
    with OrchestratorClient(c.target, job_id="timeslice-up", timeout=20.0) as client:
        client.create_group(group, nodes=[c.node], sharing=c.settings.group_sharing)
    c.progress(f"group {group!r} over node {c.node!r} created (sharing: {c.settings.group_sharing})")
