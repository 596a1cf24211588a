"""The local cluster: etcd, N lockd replicas and one node agent on this machine.

    cluster = LocalCluster(settings, run_dir="runs/20250101-120000")
    cluster.start()          # progress on stdout; raises (after stopping what started) on failure
    cluster.target           # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3", ready for TIMESLICE_TARGET
    cluster.stop()           # agent, then lockd, then etcd; the logs stay in run_dir

Everything of one run lives in ``run_dir``: one ``<kind>-<name>.log`` per
process, etcd's data (``etcd/``), the agent's state (``nodeagent-state/``) and
``cluster.json`` (endpoints, pids, backend) through which ``timeslice demo``
and ``timeslice up --stop`` find the cluster. The simulated device, when the
agent uses it, lives in RAM (``/dev/shm``) if there is room, linked from
``run_dir/sim``; it is removed when the cluster stops, as a GPU's memory
would be.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from timeslice.common.server.auth import TOKEN_FILE_NAME
from timeslice.launcher import start as _start
from timeslice.launcher import state as S
from timeslice.launcher.etcd import EtcdNotFound, probe_healthy
from timeslice.launcher.procs import Child, ChildFailed, stop_all
from timeslice.launcher.progress import Progress, size_text
from timeslice.launcher.settings import Settings

__all__ = ["DEFAULT_GROUP", "LaunchError", "LocalCluster", "Progress"]

DEFAULT_GROUP = "local"
_size = size_text                      # the older name (timeslice demo uses it)


class LaunchError(RuntimeError):
    """The cluster could not start; what started has been stopped again."""


class LocalCluster:
    def __init__(self, settings: Settings, run_dir: str | os.PathLike, *, node: str | None = None,
                 group: str | None = DEFAULT_GROUP, progress: Callable[[str], None] | None = None,
                 python: str = sys.executable, sim_dir: str | None = None, settings_origin: str = "",
                 require_attestation: bool = True):
        from timeslice.config import node_name
        self.settings = settings
        # The agent acts only on attested workers, as in deploy/; a test whose jobs register
        # processes they cannot attest (several jobs in one process) turns it off.
        self.require_attestation = require_attestation
        self.run_dir = Path(run_dir).absolute()
        self.node = node or node_name()
        self.group = group
        self.progress = progress if progress is not None else Progress()
        self.python = python
        self.settings_origin = settings_origin
        self.sim_dir_wanted = sim_dir
        self.sim_dir: str | None = None
        self.sim_dir_ours = False
        self.etcd: list[Child] = []
        self.lockd: list[Child] = []
        self.agent: Child | None = None
        self.leader: dict = {}
        self.started_at = 0.0
        self.state_path = self.run_dir / S.STATE_FILE
        self.status = "new"
        self._interrupted = threading.Event()

    # -- addresses ------------------------------------------------------------------
    @property
    def etcd_endpoints(self) -> list[str]:
        return [f"127.0.0.1:{m.info['client_port']}" for m in self.etcd]

    @property
    def etcd_endpoints_str(self) -> str:
        return ",".join(self.etcd_endpoints)

    @property
    def lockd_targets(self) -> list[str]:
        return [f"127.0.0.1:{r.info['port']}" for r in self.lockd if r.info.get("port")]

    @property
    def target(self) -> str:
        return ",".join(self.lockd_targets)

    @property
    def backend(self) -> str:
        return self.agent.info.get("backend", "") if self.agent else ""

    def children(self) -> list[Child]:
        return [*self.etcd, *self.lockd, *([self.agent] if self.agent else [])]

    def interrupt(self) -> None:
        """Make a start in progress give up (from a signal handler)."""
        self._interrupted.set()

    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    # -- start -----------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalCluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        self.status = "starting"
        try:
            _start.start_etcd(self, timeout)
            _start.start_lockd_and_agent(self, timeout)
            if self.group:
                _start.create_group(self, self.group)
        except BaseException as e:
            self.progress(f"start failed: {e.__class__.__name__}; stopping what started")
            self.stop(quiet=True)
            if isinstance(e, (ChildFailed, EtcdNotFound, _start.LeaderTimeout)):
                raise LaunchError(str(e)) from None
            raise
        self.status = "running"
        self.write_state()
        return self

    # -- state file --------------------------------------------------------------------
    def to_state(self) -> dict:
        s = self.settings
        return {
            "version": S.VERSION, "status": self.status, "run_dir": str(self.run_dir),
            "launcher_pid": os.getpid(), "started_unix": self.started_at, "updated_unix": time.time(),
            "settings_from": self.settings_origin,
            "prefix": s.prefix, "node": self.node, "group": self.group,
            "target": self.target, "lockd_targets": self.lockd_targets,
            "etcd_endpoints": self.etcd_endpoints, "leader": self.leader,
            "metrics": {"lockd": [f"127.0.0.1:{r.info.get('metrics_port')}" for r in self.lockd],
                        "nodeagent": f"127.0.0.1:{self.agent.info.get('metrics_port')}" if self.agent else ""},
            "backend": self.backend, "backend_why": self.agent.info.get("why", "") if self.agent else "",
            "sim": {"dir": self.sim_dir, "capacity_bytes": s.sim_device_capacity_bytes,
                    "snapshot_bytes_per_s": s.sim_snapshot_bytes_per_s,
                    "restore_bytes_per_s": s.sim_restore_bytes_per_s} if self.backend == "sim" else None,
            "processes": [c.to_dict() for c in self.children()],
            "etcdctl": self.etcdctl_command(),
            "admin_token_file": str(self.run_dir / TOKEN_FILE_NAME),
            # Jobs on this machine reach the node agent's channel here ($TIMESLICE_AGENT_SOCKET).
            "agent_socket": str(self.run_dir / "agent.sock"),
        }

    def write_state(self) -> None:
        S.write(self.state_path, self.to_state())
        S.remember(self.state_path)          # found from any directory (timeslice status, up)

    def etcdctl_command(self) -> str:
        return f"ETCDCTL_API=3 etcdctl --endpoints {self.etcd_endpoints_str} get --prefix {self.settings.prefix}"

    @classmethod
    def from_state(cls, doc: dict, progress: Callable[[str], None] | None = None) -> LocalCluster:
        """A handle on a cluster another process started (to stop it, or to look at it)."""
        sim = doc.get("sim") or {}
        settings = Settings(prefix=doc.get("prefix", "/timeslice/"),
                            sim_device_capacity_bytes=int(sim.get("capacity_bytes") or (64 << 20)))
        c = cls(settings, doc["run_dir"], node=doc.get("node"), group=doc.get("group"), progress=progress,
                sim_dir=sim.get("dir"))
        c.sim_dir = sim.get("dir")
        c.sim_dir_ours = bool(c.sim_dir)
        c.status, c.leader, c.started_at = doc.get("status", "?"), doc.get("leader", {}), doc.get("started_unix", 0)
        c.etcd, c.lockd, agents = S.children(doc)
        c.agent = agents[0] if agents else None
        return c

    # -- health -----------------------------------------------------------------------------
    def health(self) -> dict[str, bool]:
        out = {}
        for m in self.etcd:
            out[f"etcd {m.name}"] = m.alive() and probe_healthy(m) is not None
        for r in self.lockd:
            out[f"lockd {r.name}"] = r.alive()
        if self.agent:
            out[f"nodeagent {self.agent.name}"] = self.agent.alive()
        return out

    def dead_children(self) -> list[Child]:
        return [c for c in self.children() if not c.alive()]

    # -- stop ------------------------------------------------------------------------------
    def stop(self, quiet: bool = False) -> None:
        """Agent (finishes an op in flight), then the lockd replicas (the leader resigns), then etcd."""
        say = (lambda _m: None) if quiet else self.progress
        if self.agent is not None and (self.agent.alive() or self.agent.proc is not None):
            say(f"nodeagent {self.agent.name}: stopping")
            self.agent.stop(grace=30)
        if self.lockd:
            say(f"lockd: stopping {len(self.lockd)} replica{'s' if len(self.lockd) > 1 else ''}")
            stop_all(self.lockd, grace=10)
        if self.etcd:
            say("etcd: stopping")
            for m in self.etcd:               # one at a time: no leadership ping-pong
                m.stop(grace=10)
        if self.sim_dir and self.sim_dir_ours:
            shutil.rmtree(self.sim_dir, ignore_errors=True)
            link = self.run_dir / "sim"
            if link.is_symlink():
                link.unlink(missing_ok=True)
        if self.status in ("running", "starting") or self.state_path.exists():
            self.status = "stopped"
            if self.state_path.exists() or self.etcd:
                doc = self.to_state()
                doc["stopped_unix"] = time.time()
                S.write(self.state_path, doc)
            S.forget(self.state_path)
        say(f"stopped; logs are in {self.run_dir}")
