"""The project's servers as children: lockd replicas and node agents, and who leads.

Each is ``python -m timeslice.lockd.cli serve ...`` / ``python -m timeslice.nodeagent.cli serve ...``
on a loopback port (0: a free one, which the server reports), logging JSON to
its own file; ready once it prints ``LOCKD_READY port=N`` /
``NODEAGENT_READY port=N node=NAME backend=B``. The command line is built
when the process is spawned, so a restart picks up changed settings.
"""
from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from timeslice.common.server.keys import Keys, prefix_range_end
from timeslice.common.server.netutil import http_json
from timeslice.launcher.procs import Child, log_events, read_ready_line


def _metrics(port: int | None) -> list[str]:
    # None: no metrics endpoint (tests start many servers; none needs one)
    return ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"] if port else ["--metrics-port", "-1"]


S = TypeVar("S", bound="_Server")


@dataclass(frozen=True)
class Launch:
    """How a server child is started, besides what it serves: its ports, extra flags, environment, interpreter."""

    listen_port: int = 0                    # 0: a free one, which the server reports
    metrics_port: int | None = None         # None: no metrics endpoint
    extra: Iterable[str] = ()               # more flags, last on the command line
    env: dict[str, str] | None = None
    python: str = sys.executable
    wrapper: Iterable[str] = ()             # e.g. ``ip netns exec NS``: it execs the server (same pid)


@dataclass(frozen=True)
class SimFlags:
    """The SIMULATED device's flags of a node agent (None: the agent's default)."""

    dir: str | None = None
    capacity_bytes: int | None = None
    checkpoint_gbps: float | None = None
    restore_gbps: float | None = None


class _Server(Child):
    """A server that reports the port it serves on in its ready line (read by ``probe``)."""

    host = "127.0.0.1"

    def __init__(self, kind: str, name: str, log_path: str, launch: Launch, probe: Callable[[Child], dict | None]):
        super().__init__(kind, name, [], log_path, launch.env)
        self.metrics_port, self._probe = launch.metrics_port, probe
        self.listen_port, self.extra, self.python = launch.listen_port, list(launch.extra), launch.python
        self.wrapper = list(launch.wrapper)
        if launch.metrics_port:
            self.info["metrics_port"] = launch.metrics_port

    def command(self) -> list[str]:
        raise NotImplementedError

    def spawn(self: S) -> S:
        self.argv = self.command()           # built now: a restart picks up changed settings
        super().spawn()
        return self

    def wait_serving(self, timeout: float, interrupted: Callable[[], bool] = lambda: False) -> dict:
        return self.wait_ready(self._probe, timeout, interrupted)

    @property
    def port(self) -> int:
        """The port it serves on (0 until it said so)."""
        return int(self.info.get("port") or 0)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


class LockdReplica(_Server):
    """One lockd replica against ``etcd_endpoints``, serving on ``host:listen_port``."""

    def __init__(self, replica_id: str, etcd_endpoints: str, prefix: str, log_path: str, launch: Launch = Launch(),
                 *, host: str = "127.0.0.1"):
        super().__init__("lockd", replica_id, log_path, launch, probe_lockd)
        self.etcd_endpoints, self.prefix, self.host = etcd_endpoints, prefix, host

    @property
    def replica_id(self) -> str:
        return self.name

    def command(self) -> list[str]:
        return [*self.wrapper, self.python, "-m", "timeslice.lockd.cli", "serve", "--etcd-endpoints", self.etcd_endpoints,
                "--prefix", self.prefix, "--listen", f"{self.host}:{self.listen_port}", *_metrics(self.metrics_port),
                "--replica-id", self.replica_id, *self.extra]



class NodeAgent(_Server):
    """The node agent of ``node``; ``state_dir`` is where it keeps what must survive a restart."""

    def __init__(self, node: str, etcd_endpoints: str, prefix: str, log_path: str, launch: Launch = Launch(), *,
                 state_dir: str, backend: str = "sim", sim: SimFlags = SimFlags(), channel_socket: str | None = None):
        super().__init__("nodeagent", node, log_path, launch, probe_agent)
        self.etcd_endpoints, self.prefix, self.state_dir, self.backend = etcd_endpoints, prefix, state_dir, backend
        self.sim_dir = sim.dir
        self.sim = {"--sim-capacity-bytes": sim.capacity_bytes, "--sim-checkpoint-gbps": sim.checkpoint_gbps,
                    "--sim-restore-gbps": sim.restore_gbps}
        self.channel_socket = channel_socket
        self.info.update(node=node)

    @property
    def node(self) -> str:
        return self.name

    def command(self) -> list[str]:
        argv = [self.python, "-m", "timeslice.nodeagent.cli", "serve", "--node", self.node,
                "--etcd-endpoints", self.etcd_endpoints, "--prefix", self.prefix,
                "--listen", f"127.0.0.1:{self.listen_port}", *_metrics(self.metrics_port),
                "--backend", self.backend, "--state-dir", self.state_dir]
        if self.sim_dir:
            argv += ["--sim-dir", self.sim_dir]
        for flag, value in self.sim.items():
            if value is not None:
                argv += [flag, repr(value) if isinstance(value, float) else str(value)]
        if self.channel_socket and "--channel-socket" not in self.extra:
            argv += ["--channel-socket", self.channel_socket]
        return argv + self.extra



# -- readiness probes (Child -> info dict, or None while not ready) ------------------------------

def probe_lockd(r: Child) -> dict | None:
    got = read_ready_line(r.log_path, b"LOCKD_READY", r.log_offset)
    return {"port": int(got["port"])} if got else None


def probe_agent(a: Child) -> dict | None:
    got = read_ready_line(a.log_path, b"NODEAGENT_READY", a.log_offset)
    if not got:
        return None
    info = {"port": int(got["port"]), "backend": got.get("backend", "?")}
    why = _event_field(a, "agent_started", "why") or _event_field(a, "backend_picked", "why")
    if why:
        info["why"] = why
    return info


def _event_field(c: Child, event: str, key: str) -> str | None:
    for ev in log_events(c.log_path, c.log_offset):
        if ev.get("event") == event and key in ev:
            return str(ev[key])
    return None


# -- who leads ---------------------------------------------------------------------------------------

def read_leader(etcd_ports: Iterable[int], prefix: str, timeout: float = 1.0) -> dict | None:
    """``{"replica", "epoch"}`` of the lowest election key under <prefix>leader/, or None if there is none.

    Read over etcd's JSON gateway (a linearizable range), from the first member that answers.
    """
    key = Keys(prefix).election()
    body = json.dumps({"key": _b64(key), "range_end": _b64(prefix_range_end(key))}).encode()
    for port in etcd_ports:
        reply = http_json(port, "/v3/kv/range", body, timeout)
        if reply is None:
            continue
        kvs = reply.get("kvs") or []
        if not kvs:
            return None
        head = min(kvs, key=lambda kv: int(kv["create_revision"]))
        try:
            who = json.loads(base64.b64decode(head["value"])).get("replica", "?")
        except ValueError:
            who = "?"
        return {"replica": who, "epoch": int(head["create_revision"])}
    return None


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()
