"""etcd members on loopback: the binary, the command line, health, and a start that survives port races.

A member keeps its name, ports and data dir for its whole life, so a restart
(``launch("existing")``) comes back as the same raft member and rejoins its
cluster with its old data. Health and leadership are read over etcd's HTTP
endpoints (``/health`` and the gRPC gateway's ``/v3/...``), which 3.4 and 3.5
serve on the client port: a poll costs one local HTTP request.

Ports are picked free (``timeslice.common.server.netutil.free_port``) and may be taken by
someone else before etcd binds them; ``start_members`` then starts the
members again on fresh ones (tenacity: a bounded number of attempts).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import TypeVar

import tenacity

from timeslice.common.server.netutil import http_json
from timeslice.launcher.procs import Child, ChildFailed

ETCD_BIN_ENV = "TIMESLICE_ETCD_BIN"


class EtcdNotFound(RuntimeError):
    """No etcd binary (the message says how to get one)."""


class PortTaken(ChildFailed):
    """A member could not bind its port: someone took it after we picked it."""


def find_etcd() -> str:
    """$TIMESLICE_ETCD_BIN, else ``etcd`` on PATH."""
    explicit = os.environ.get(ETCD_BIN_ENV)
    if explicit:
        return explicit
    found = shutil.which("etcd")
    if not found:
        raise EtcdNotFound("etcd not found on PATH: install it (Debian/Ubuntu: "
                           "sudo apt-get install -y etcd-server etcd-client; scripts/demo.sh does it) "
                           f"or point {ETCD_BIN_ENV} at the binary")
    return found


def etcd_env(**extra: str) -> dict[str, str]:
    """Our environment minus ETCD_*/ETCDCTL_* variables.

    etcd and etcdctl read every flag from the environment too and refuse to start when
    a variable and a flag both set one, so a developer's shell settings would otherwise
    break or silently redirect the cluster.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "ETCDCTL_"))}
    env.update(extra)
    return env


def initial_cluster(names: list[str], peer_ports: list[int]) -> str:
    return ",".join(f"{n}=http://127.0.0.1:{pp}" for n, pp in zip(names, peer_ports))


class EtcdMember(Child):
    """One etcd server on 127.0.0.1; ``cluster_args`` are the flags all members share."""

    def __init__(self, name: str, client_port: int, peer_port: int, data_dir: str, log_path: str,
                 cluster_args: list[str], binary: str | None = None):
        super().__init__("etcd", name, [], log_path)
        self.client_port, self.peer_port, self.data_dir = client_port, peer_port, data_dir
        self.cluster_args = list(cluster_args)
        self.binary = binary
        self.info.update(client_port=client_port, peer_port=peer_port, endpoint=self.endpoint)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def command(self, state: str) -> list[str]:
        client_url, peer_url = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        return [self.binary or find_etcd(), "--name", self.name, "--data-dir", self.data_dir,
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster-state", state, *self.cluster_args]

    def launch(self, state: str = "new") -> EtcdMember:
        """Start the process; ``state`` is etcd's --initial-cluster-state (new | existing)."""
        self.argv, self.env = self.command(state), etcd_env()
        self.spawn()
        return self

    def healthy(self, timeout: float = 1.0) -> bool:
        """True if the member answers /health with health=true (it has a leader, no alarm)."""
        reply = http_json(self.client_port, "/health", None, timeout)
        return reply is not None and reply.get("health") in ("true", True)

    def status(self, timeout: float = 1.0) -> dict | None:
        """The Maintenance.Status reply as JSON (ids are decimal strings), or None."""
        return http_json(self.client_port, "/v3/maintenance/status", b"{}", timeout)

    def collided(self) -> bool:
        """It exited because a port it was given is taken."""
        return not self.alive() and "address already in use" in self.log_tail(60)

    def wait_healthy(self, timeout: float, interrupted: Callable[[], bool] = lambda: False) -> None:
        try:
            self.wait_ready(probe_healthy, timeout, interrupted)
        except ChildFailed as e:
            if self.collided():
                raise PortTaken(str(e)) from None
            raise


def probe_healthy(m: Child) -> dict | None:
    """Readiness probe of a member (also of one known only from cluster.json)."""
    reply = http_json(int(m.info["client_port"]), "/health", None, 1.0)
    if reply and reply.get("health") in ("true", True):
        return {"healthy": True}
    return None


M = TypeVar("M", bound=EtcdMember)   # the harness passes its subclass (kill, pause, restart on top)


def start_members(attempt: Callable[[], list[M]], wait: Callable[[list[M]], None],
                  discard: Callable[[list[M]], None], attempts: int,
                  on_retry: Callable[[], None] = lambda: None) -> list[M]:
    """``attempt()`` makes the members (fresh ports), they are launched, ``wait`` until they serve.

    When a member lost a port race (``PortTaken``), ``discard`` stops them and removes what
    they wrote, and a new attempt is made, up to ``attempts`` in all; any other failure
    discards and raises at once.
    """
    def once() -> list[M]:
        members = attempt()
        try:
            for m in members:
                m.launch("new")
            wait(members)
        except BaseException:
            discard(members)
            raise
        return members

    retrying = tenacity.Retrying(retry=tenacity.retry_if_exception_type(PortTaken),
                                 stop=tenacity.stop_after_attempt(attempts), reraise=True,
                                 before_sleep=lambda _state: on_retry())
    return retrying(once)
