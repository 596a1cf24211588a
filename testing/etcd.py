"""Real etcd servers for tests: one member or a 3-member cluster on loopback.

The members are the launcher's (``timeslice.launcher.etcd``, what ``timeslice
up`` runs), with test settings (fast elections, temp dirs) and the fault
injection of ``member.py``.

The lock's correctness rests on etcd's own semantics (revisions, leases, watch
delivery, failover), which a fake would get subtly wrong, so every test talks to
real ``etcd`` processes. Members can be stopped, killed, paused (SIGSTOP: the
process is alive but silent, like a GC pause or a hung VM) and restarted on the
same data dir and ports, which is what the chaos tests need; ``lose_quorum`` takes
a majority away at once (killed or paused) and ``regain_quorum`` brings it back.

Health and leadership are read over etcd's HTTP endpoints (``/health`` and the
gRPC gateway's ``/v3/maintenance/status``), which both 3.4 and 3.5 serve on the
client port: a poll costs one local HTTP request instead of an etcdctl process.
Data dirs go to /dev/shm when it is writable, because etcd fsyncs every commit
and a disk fsync would dominate test time.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import secrets
import shutil
import tempfile
import time

from timeslice.launcher.etcd import initial_cluster, start_members
from timeslice.testing.ctl import EtcdHarnessError, PortCollision, etcdctl_run
from timeslice.testing.member import HarnessMember
from timeslice.testing.ports import free_port

_live: list[EtcdCluster] = []  # started and not yet stopped; see live_clusters()


def live_clusters() -> list[EtcdCluster]:
    """Clusters started in this process and not stopped yet (for failure log dumps)."""
    return list(_live)


def _default_tmp_root() -> str | None:
    root = os.environ.get("TIMESLICE_ETCD_TMPDIR")
    if root:
        return root
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class EtcdCluster:
    """``size`` etcd members forming one cluster; start with ``start()`` or ``with``."""

    def __init__(self, size: int = 1, workdir: str | None = None, name_prefix: str = "m",
                 heartbeat_ms: int = 50, election_ms: int = 500, log_level: str = "warn"):
        if size < 1:
            raise ValueError("a cluster needs at least one member")
        self.size = size
        self.name_prefix = name_prefix
        self.settings = ["--heartbeat-interval", str(heartbeat_ms),
                         "--election-timeout", str(election_ms),
                         "--auto-compaction-retention", "0",
                         "--logger", "zap", "--log-outputs", "stderr", "--log-level", log_level]
        self._root = workdir or _default_tmp_root()
        self._dir: str | None = None
        self.members: list[HarnessMember] = []

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member and wait until the cluster serves; retries port collisions."""
        start_members(self._create_members, lambda _ms: self.wait_healthy(timeout),
                      lambda _ms: self.stop(grace=0), attempts=5)
        return self

    def _create_members(self) -> list[HarnessMember]:
        # A fresh cluster token per attempt, so members of a dead attempt or of
        # another test cluster that reuses a port can never join this one.
        self._dir = tempfile.mkdtemp(prefix="timeslice-etcd-", dir=self._root)
        names = [f"{self.name_prefix}{i}" for i in range(self.size)]
        ports = [(free_port(), free_port()) for _ in names]
        cluster_args = ["--initial-cluster", initial_cluster(names, [pp for _, pp in ports]),
                        "--initial-cluster-token", f"ts-{secrets.token_hex(6)}", *self.settings]
        self.members = [HarnessMember(n, cp, pp, self._dir, cluster_args)
                        for n, (cp, pp) in zip(names, ports)]
        _live.append(self)
        return self.members

    def stop(self, grace: float = 2.0) -> None:
        """End every member (SIGTERM, SIGKILL after ``grace``) and remove the temp dir.

        One member at a time: members told to stop together each wait for the
        others to take over leadership, which takes seconds, while one by one
        each stop takes tens of milliseconds.
        """
        for m in self.members:
            m.stop(grace)
        if self in _live:
            _live.remove(self)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- addresses ---------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoints_str(self) -> str:
        return ",".join(self.endpoints)

    # -- health ------------------------------------------------------------

    def _active(self) -> list[HarnessMember]:
        return [m for m in self.members if m.is_running() and not m.paused]

    def wait_healthy(self, timeout: float = 15.0) -> None:
        """Block until every running, unpaused member reports healthy (it sees a leader).

        Fails fast, with the logs, if a member that nobody stopped has died.
        """
        deadline = time.monotonic() + timeout
        while True:
            for m in self.members:
                m.check_not_crashed()
            active = self._active()
            if active and all(m.healthy() for m in active):
                return
            if time.monotonic() >= deadline:
                raise EtcdHarnessError(
                    f"etcd not healthy within {timeout}s\n{self.dump_logs()}")
            time.sleep(0.05)

    async def wait_healthy_async(self, timeout: float = 15.0) -> None:
        """``wait_healthy`` off the event loop, so clients' keepalives keep running."""
        await asyncio.to_thread(self.wait_healthy, timeout)

    def heal(self, timeout: float = 30.0) -> None:
        """Resume paused and restart stopped members, then wait until all serve.

        Shared fixtures call it before each test so one test's faults never leak.
        """
        for m in self.members:
            if m.paused:
                m.resume()
            if not m.is_running():
                m.restart()
        self.wait_healthy(timeout)

    def leader(self, timeout: float = 10.0) -> HarnessMember:
        """The member that is raft leader, as the running members report it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            by_id, leader_ids = {}, set()
            for m in self._active():
                st = m.status()
                if st:
                    by_id[int(st["header"]["member_id"])] = m
                    leader_ids.add(int(st.get("leader", 0)))
            if len(leader_ids) == 1 and (lid := leader_ids.pop()) in by_id:
                return by_id[lid]
            time.sleep(0.05)
        raise EtcdHarnessError(f"no agreed leader within {timeout}s\n{self.dump_logs()}")

    def followers(self, timeout: float = 10.0) -> list[HarnessMember]:
        """The running, unpaused members that are not raft leader."""
        leader = self.leader(timeout)
        return [m for m in self._active() if m is not leader]

    # -- losing the quorum -------------------------------------------------

    def lose_quorum(self, how: str = "kill", with_leader: bool = True) -> list[HarnessMember]:
        """Take a majority of the members away: SIGKILL (``how="kill"``) or SIGSTOP (``"pause"``)
        them, the raft leader among them if ``with_leader``. The rest cannot commit anything
        until ``regain_quorum``. Returns the members taken."""
        if how not in ("kill", "pause"):
            raise ValueError("how must be 'kill' or 'pause'")
        leader = self.leader()
        others = [m for m in self._active() if m is not leader]
        victims = ([leader] if with_leader else []) + others
        victims = victims[: self.size // 2 + 1]
        for m in victims:
            m.kill() if how == "kill" else m.pause()
        return victims

    def regain_quorum(self, members: list[HarnessMember]) -> None:
        """Bring back what ``lose_quorum`` took (restart or SIGCONT); ``wait_healthy`` waits for service."""
        for m in members:
            if m.paused:
                m.resume()
            elif not m.is_running():
                m.restart()

    # -- etcdctl -----------------------------------------------------------

    def etcdctl(self, *args: str, endpoints: list[str] | None = None,
                timeout: float = 10.0) -> str:
        """Run ``etcdctl`` (API v3) against the running members; returns stdout."""
        eps = endpoints or [m.endpoint for m in self._active()] or self.endpoints
        return etcdctl_run(eps, list(args), timeout)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease now, deleting its keys, as an expiry would (fast session loss)."""
        self.etcdctl("lease", "revoke", format(lease_id, "x"))

    def leases(self) -> list[int]:
        """Ids of every granted lease."""
        lines = self.etcdctl("lease", "list").splitlines()
        return [int(line.strip(), 16) for line in lines[1:] if line.strip()]

    def dump_logs(self, max_lines: int = 200) -> str:
        """The tail of every member's log, headed by member name, endpoint and pid."""
        parts = []
        for m in self.members:
            parts.append(f"===== etcd {m.name} {m.endpoint} pid={m.pid} "
                         f"running={m.is_running()} paused={m.paused} =====")
            parts.append(m.log_tail(max_lines))
        return "\n".join(parts)


@atexit.register
def _stop_leftovers() -> None:
    for cluster in live_clusters():
        cluster.stop(grace=0)


__all__ = ["EtcdCluster", "EtcdHarnessError", "HarnessMember", "PortCollision", "live_clusters"]
