"""The world of one chaos scenario: lockd replicas on etcd, client processes, faults, a verdict.

    world = World(etcd3, key_prefix, tmp_path, proc_reaper, seed=7, name="leader-kill")
    world.start()                     # 3 lockd replicas, groups, client processes
    world.fault("kill lockd leader", ...)   # the scenario injects faults, noting each
    report = world.finish()           # stop clients, merge histories, check, print figures
    assert report.violations == []

Everything random in a scenario comes from ``world.rng`` (``random.Random(seed)``);
a failing seed reruns the same fault schedule with ``CHAOS_SEED=<seed>``.

Length: by default (what CI runs) a scenario repeats its faults fewer times, every kind of
fault it injects still at least once; ``TIMESLICE_CHAOS_LONG=1`` runs each at full length
(``repeats``). A seed replays the same schedule in the same mode.
Timings are deliberately short (leader lease 2 s, client sessions 3 s) so that
each scenario sees many grants and several faults within its time bound.

The test process is also a history writer: ``abandoned`` for clients it
SIGKILLs, ``fault`` and ``heal`` events (with a ``fault_id``: the checker's
recovery, quorum and parked-orphan rules measure from them), and ``settled``
once the agents had their chance to clean up at the end.

``kinds`` mixes clients of several sorts in one world (``ClientKind``: their
own arguments, groups and environment), e.g. checkpointed and cooperative jobs
on a simulated node beside plain jobs on a group without devices.

``sharing="fit"`` makes every group a fit group (lockd/weights.py): a group without nodes of its
own gets one, a SIMULATED device of ``FIT_CAPACITY`` bytes with its agent, one node per group (a
fit group admits against its own holders), and the clients declare footprints of 2-6 MiB (a client
with a device of its own declares it), a tenth of their turns asking exclusive=True. The checker
then judges the groups by chaos_tests/fitrules.py, and in either policy the grants are judged
once more from etcd's revision order (holders.py: tokens increasing, fit holders within capacity).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from chaos_tests.checker import Report, check
from chaos_tests.faultrules import HEAL_BOUND_S
from chaos_tests.clients import ClientProc, ClientsView
from chaos_tests.figures import fault_recoveries, print_figures
from chaos_tests.history import HistoryRecorder, load_history
from timeslice.auth import metadata_for
from timeslice.launcher import pids
from timeslice.proto import lockd_pb2 as pb
from timeslice.proto import lockd_pb2_grpc as pbg
from timeslice.testing.lockd import LockdCluster, LockdProcess
from timeslice.testing.ports import free_port
from timeslice.testing.procs import signal_tree

LEASE_TTL, RENEW_DEADLINE, RETRY_PERIOD = 2, 1.5, 0.5
LOCKD_FLAGS = ["--lease-ttl", str(LEASE_TTL), "--renew-deadline", str(RENEW_DEADLINE),
               "--retry-period", str(RETRY_PERIOD), "--etcd-timeout", "2", "--session-ttl", "3",
               "--log-level", "info"]
SESSION_TTL = 3
FIT_CAPACITY = 10 << 20        # a fit world's simulated GPU per group: two or three 2-6 MiB footprints at once
FIT_CLIENT_ARGS = ["--fit", "--exclusive-p", "0.1"]
FIT_HINTS = ["--hint-mib", "2,6"]

#: TIMESLICE_CHAOS_LONG=1: every scenario at full length (more repetitions of its faults).
LONG = os.environ.get("TIMESLICE_CHAOS_LONG", "") not in ("", "0")


def repeats(full: int, short: int) -> int:
    """How many times a scenario repeats a fault: ``full`` in the long mode, else ``short``."""
    return full if LONG else short


def _node_spec(spec: str) -> pb.NodeSpec:
    """``node`` (all its GPUs) or ``node:0,1`` (those GPUs of it)."""
    node, _, gpus = spec.partition(":")
    return pb.NodeSpec(node=node, gpus=[int(g) for g in gpus.split(",")] if gpus else [])


def _gpu_key(spec: str) -> str:
    """The checker's "<node>/<gpu>" of a group's node spec: ``node`` (its GPU 0) or ``node:1`` (one GPU)."""
    node, _, gpus = spec.partition(":")
    return f"{node}/{gpus or 0}"


def scenario_seed(default: int) -> int:
    """The seed: $CHAOS_SEED when set (to replay a failure), else the scenario's own."""
    return int(os.environ.get("CHAOS_SEED", default))


@dataclass
class ClientKind:
    """``count`` clients with these extra arguments, on ``groups`` (default: every group of the world)."""

    count: int
    args: list[str] = field(default_factory=list)
    groups: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Fault:
    what: str
    t0: float              # monotonic s, fault injected
    t1: float | None = None   # fault healed (None: instantaneous)
    detail: dict = field(default_factory=dict)
    fault_id: int = 0


class World(ClientsView):
    def __init__(self, etcd, prefix: str, workdir, reaper, *, seed: int, name: str,
                 groups: int = 2, clients: int = 6, lockd_flags: list[str] | None = None,
                 client_args: list[str] | None = None, group_nodes: list[str] | dict[str, list[str]] | None = None,
                 client_env: dict[str, str] | None = None, library: bool = False, observe: bool = False,
                 kinds: list[ClientKind] | None = None, orphan_bound_s: float = 10.0,
                 recovery_bound_s: float = 30.0, max_overtakes: int | None = None,
                 heal_bound_s: float | None = HEAL_BOUND_S, lockd_base: list[str] | None = None,
                 session_ttl: int = SESSION_TTL, sharing: str = "exclusive",
                 fit_capacity: dict[str, int] | None = None):
        """``sharing``: every group's policy; ``fit_capacity``: node -> its GPU's bytes, for the fit
        groups' checker (default: the fit nodes this world makes)."""
        self.etcd, self.prefix, self.reaper, self.seed, self.name = etcd, prefix, reaper, seed, name
        self.rng = random.Random(seed)
        self.dir = str(workdir)
        self.history_dir = os.path.join(self.dir, "history")
        self.fence_dir = os.path.join(self.dir, "fence")
        self.log_dir = os.path.join(self.dir, "logs")
        for d in (self.history_dir, self.fence_dir, self.log_dir):
            os.makedirs(d, exist_ok=True)
        self.groups = [f"g{i}" for i in range(groups)]
        self.group_nodes = group_nodes or []      # every group's nodes, or {group: nodes}
        self.n_clients = clients
        self.kinds = kinds or [ClientKind(clients)]
        self.orphan_bound_s, self.recovery_bound_s = orphan_bound_s, recovery_bound_s
        self.heal_bound_s = heal_bound_s          # the first grant after each heal (faultrules.py)
        # max_overtakes: the groups have priority classes with this bound (judged by priorityrules.py)
        self.max_overtakes = max_overtakes
        self.sharing = sharing
        self.fit_capacity = dict(fit_capacity or {})
        self.fit_nodes: list = []                 # the SimNodes a fit world made for its groups
        self.client_args = client_args or []
        self.client_env = client_env or {}
        # library=True: clients drive timeslice.OrchestratorClient (lib_client.py), and an
        # observer records the server's grants for the checker's ghost rule (claims.py).
        self.library = library
        # lockd_base: lockd's flags in place of the short LOCKD_FLAGS ([]: lockd's own defaults, as
        # `timeslice up` runs it); session_ttl: the clients' (the library's default is 10 s).
        self.session_ttl = session_ttl
        self.ghost_bound_s = 2 * session_ttl + 2 if library else 10.0
        # observe=True: the observer runs with raw clients too (the agents' statuses, sessions).
        self.observe = library or observe or sharing == "fit"
        self.observer = None
        self.on_stop: list = []           # callables run by stop() (agents, relays, ...)
        self.lockd = LockdCluster(etcd.endpoints_str, prefix, n=3, logdir=self.log_dir,
                                  extra=(LOCKD_FLAGS if lockd_base is None else lockd_base) + (lockd_flags or []))
        # Fixed ports, so a restarted replica comes back where the clients look for it.
        for r in self.lockd.replicas:
            r.listen_port = free_port()
        self._addrs = [f"{r.host}:{r.listen_port}" for r in self.lockd.replicas]
        self.rec = HistoryRecorder(self.history_dir, name="test")
        self.clients: list[ClientProc] = []
        self.faults: list[Fault] = []
        self._next_job = 0
        self.t_start = time.monotonic()
        self._mu = threading.Lock()       # client bookkeeping: the test thread and the monitor
        self._monitor_stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- set-up ---------------------------------------------------------------------
    @property
    def targets(self) -> list[str]:
        return list(self._addrs)

    def replace_replica(self, i: int, proc: LockdProcess) -> None:
        """Run replica ``i`` as ``proc`` (e.g. inside a network namespace), before ``start``."""
        self.lockd.replicas[i] = proc
        self._addrs[i] = f"{proc.host}:{proc.listen_port}"

    def start(self, order: list[int] | None = None, duration: float = 20.0) -> World:
        for i in order or range(len(self.lockd.replicas)):
            self.lockd.replicas[i].start()
        if self.sharing == "fit" and not self.group_nodes:
            self._make_fit_nodes()
        self.create_groups()
        if self.observe:
            from chaos_tests.observer import GrantObserver

            self.observer = GrantObserver(self.etcd.endpoints_str, self.prefix, self.history_dir,
                                          enqueued=self.max_overtakes is not None or self.sharing == "fit").start()
        for kind in self.kinds:
            for _ in range(kind.count):
                self.spawn_client(duration, kind=kind)
        self.wait_clients_ready()
        self.t_start = time.monotonic()
        self.rec.record("start", name=self.name, seed=self.seed)
        self.duration = duration
        self._monitor = threading.Thread(target=self._watch_clients, daemon=True, name="chaos-monitor")
        self._monitor.start()
        return self

    def _watch_clients(self) -> None:
        """A client that dies on its own (a crash, not our SIGKILL) is recorded at once.

        Its open attempt or section is closed with ``abandoned`` within a few
        ms of its death, as for a client we kill, so the checker judges the
        others correctly; the crash itself fails the scenario (``crashes``).
        """
        while not self._monitor_stop.wait(0.02):
            with self._mu:
                for c in self.clients:
                    if c.killed or c.crashed is not None or c.proc.poll() is None or c.proc.returncode == 0:
                        continue
                    c.crashed = c.proc.returncode
                    group = self._open_group(c)
                    if group:
                        self.rec.abandoned(group, c.job, crashed=c.crashed)
                    tail = self._read(c.log_path).decode(errors="replace").splitlines()[-15:]
                    print(f"[{self.name}] +{self.elapsed():6.2f}s client {c.job} (pid {c.pid}) DIED rc={c.crashed} "
                          f"with {group or 'nothing'} open:\n  " + "\n  ".join(tail), flush=True)

    @property
    def crashes(self) -> list[str]:
        return [f"client {c.job} pid {c.pid} died rc={c.crashed}" for c in self.clients if c.crashed is not None]

    def _make_fit_nodes(self) -> None:
        """One SIMULATED device and its agent per group (a fit group admits against its own holders)."""
        from chaos_tests.simnode import SimNode

        nodes = {}
        for g in self.groups:
            node = SimNode(self, self.etcd.endpoints_str, node=f"fit-{g}", capacity=FIT_CAPACITY)
            node.agent.start()
            self.fit_nodes.append(node)
            nodes[g] = [node.node]
            self.fit_capacity.setdefault(node.node, FIT_CAPACITY)
        self.group_nodes = nodes

    def _nodes_of(self, g: str) -> list[str]:
        return self.group_nodes.get(g, []) if isinstance(self.group_nodes, dict) else self.group_nodes

    def create_groups(self) -> None:
        for g in self.groups:
            req = pb.CreateGroupRequest(group_id=g, nodes=[_node_spec(n) for n in self._nodes_of(g)],
                                        priorities=self.max_overtakes is not None,
                                        max_overtakes=self.max_overtakes or 0, sharing=self.sharing)
            self.call_any("CreateGroup", req)

    def fit_spec(self) -> dict[str, dict] | None:
        """The checker's fit groups: each with its GPUs' capacities (index 0 of each node: one
        simulated device per node)."""
        if self.sharing != "fit":
            return None
        return {g: {"capacity": {_gpu_key(n): self.fit_capacity[n] for n in self._nodes_of(g) if n in self.fit_capacity},
                    "margin": 0} for g in self.groups}

    def call_any(self, method: str, req, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while True:
            for t in self.targets:
                with grpc.insecure_channel(t) as ch:
                    try:
                        return getattr(pbg.LockdStub(ch), method)(req, timeout=2, metadata=metadata_for(method))
                    except grpc.RpcError as e:
                        if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                            return None
                        last = e
            if time.monotonic() > deadline:
                raise last
            time.sleep(0.2)

    def spawn_client(self, duration: float, extra: list[str] | None = None, job: str | None = None,
                     kind: ClientKind | None = None) -> ClientProc:
        """A new client process; ``job``: reuse a job id (a restarted job), else a new one;
        ``kind``: its sort (default: the world's first)."""
        kind = kind or self.kinds[0]
        if job is None:
            job = f"c{self._next_job}"
        self._next_job += 1
        log_path = os.path.join(self.log_dir, f"client-{job}-{self._next_job}.log")
        argv = [sys.executable, "-m", "chaos_tests.client_proc", "--targets", ",".join(self.targets),
                "--job", job, "--groups", ",".join(kind.groups or self.groups), "--history", self.history_dir,
                "--fence-dir", self.fence_dir, "--seed", str(self.seed * 1000 + self._next_job),
                "--duration", str(duration), "--ttl", str(self.session_ttl), *self.client_args, *kind.args,
                *(extra or [])]
        if self.sharing == "fit":
            own = "--sim-bytes" in argv or "--coop-regions" in argv       # a device of its own: its footprint
            argv += FIT_CLIENT_ARGS + ([] if own else FIT_HINTS)
        if self.library:
            argv += ["--library", "--etcd", self.etcd.endpoints_str, "--error-pause", str(self.ghost_bound_s + 2)]
        with open(log_path, "ab") as log:
            proc = self.reaper.spawn(argv, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.client_env, **kind.env})
        c = ClientProc(job, proc, log_path, kind=kind)
        self.clients.append(c)
        return c

    def wait_clients_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for c in self.clients:
            while b"CLIENT_READY" not in self._read(c.log_path):
                if c.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"client {c.job} did not start:\n{self._read(c.log_path).decode()}")
                time.sleep(0.05)

    @staticmethod
    def _read(path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    # -- time and faults ---------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def remaining(self) -> float:
        return self.duration - self.elapsed()

    def sleep(self, lo: float, hi: float | None = None) -> None:
        time.sleep(self.rng.uniform(lo, hi if hi is not None else lo))

    def fault(self, what: str, no_quorum: bool = False, **detail) -> Fault:
        """Note a fault injected now; ``no_quorum``: it takes an etcd majority away (until healed)."""
        f = Fault(what, time.monotonic(), detail=detail, fault_id=len(self.faults))
        self.faults.append(f)
        self.rec.record("fault", what=what, fault_id=f.fault_id, **({"no_quorum": True} if no_quorum else {}),
                        **detail)
        print(f"[{self.name}] +{self.elapsed():6.2f}s fault: {what} {detail or ''}", flush=True)
        return f

    def healed(self, f: Fault, what: str = "") -> None:
        f.t1 = time.monotonic()
        self.rec.record("heal", what=what or f.what, fault_id=f.fault_id)
        print(f"[{self.name}] +{self.elapsed():6.2f}s healed: {what or f.what} "
              f"after {f.t1 - f.t0:.2f}s", flush=True)

    def lockd_leader(self, timeout: float = 15.0) -> tuple[LockdProcess, int]:
        return self.lockd.leader(self.etcd, timeout)

    def wait_new_leader(self, old_epoch: int, timeout: float = 15.0) -> tuple[LockdProcess, int]:
        deadline = time.monotonic() + timeout
        while True:
            rep, epoch = self.lockd_leader(timeout)
            if epoch != old_epoch and not self._paused(rep):
                return rep, epoch
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new lockd leader after epoch {old_epoch}")
            time.sleep(0.1)

    @staticmethod
    def _paused(rep: LockdProcess) -> bool:
        return pids.state(rep.pid) == "T"

    def replica_at(self, target: str) -> LockdProcess:
        return self.lockd.replicas[self._addrs.index(target)]

    # -- the end ------------------------------------------------------------------------
    def finish(self, tail: float = 2.0, grace: float = 30.0) -> Report:
        """After ``tail`` s more of normal running, let every client finish its turn, kill
        stragglers, merge the histories, check, and print the figures."""
        time.sleep(tail)
        for r in self.lockd.replicas:
            if r.alive() and self._paused(r):
                r.resume()
        live = self.live_clients()
        for c in live:
            signal_tree(c.pid, signal.SIGCONT)
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] client {c.job} did not finish its turn in time; killing it", flush=True)
                self.kill_client(c)
        time.sleep(0.1)                   # the monitor's last look
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join()
        if self.observer is not None:
            time.sleep(0.5)               # the last grant deletions reach the observer
            self.settle()
            self.observer.stop()
        self.rec.close()
        events = load_history(self.history_dir)
        self.all_events = events
        report = check(events, ghost_bound_s=self.ghost_bound_s, orphan_bound_s=self.orphan_bound_s,
                       recovery_bound_s=self.recovery_bound_s, heal_bound_s=self.heal_bound_s,
                       priorities=None if self.max_overtakes is None else dict.fromkeys(self.groups, self.max_overtakes),
                       fit=self.fit_spec())
        report.violations += self.revision_order_violations()
        self.print_figures(report, events)
        return report

    def max_holders(self) -> int:
        """The most holders one group had at once, as the observer saw the grants come and go."""
        held: dict[str, set] = {}
        most = 0
        for e in sorted(getattr(self, "all_events", []), key=lambda e: e["t"]):
            if e["ev"] in ("grant_put", "grant_end"):
                h = held.setdefault(e.get("group"), set())
                (h.add if e["ev"] == "grant_put" else h.discard)(e.get("job"))
                most = max(most, len(h))
        return most

    def revision_order_violations(self) -> list[str]:
        """The grants judged from etcd's own revision history (holders.py), both policies: tokens, fit
        holders within capacity, backfills that leave the head its room."""
        import asyncio

        from chaos_tests.holders import check_backfills_spare_the_head, check_grants_in_revision_order, etcd_history
        from timeslice.common.server.etcd import EtcdClient, EtcdConfig
        from timeslice.common.server.keys import Keys

        async def read():
            keys = Keys(self.prefix)
            async with EtcdClient(EtcdConfig.parse(self.etcd.endpoints_str, timeout=10)) as client:
                history = await etcd_history(client, keys)
                return check_grants_in_revision_order(history, keys) + check_backfills_spare_the_head(history, keys)
        return asyncio.run(read())

    def settle(self) -> None:
        """Give the agents up to the orphan bound (and a little) to clean up after the jobs that
        left, so that the checker's ``[parked-orphan]`` rule can judge the end; then ``settled``."""
        deadline = time.monotonic() + self.orphan_bound_s + 2
        left = self.observer.orphans()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.observer.orphans()
        self.rec.record("settled", orphans=[list(k) for k in left])
        if left:
            print(f"[{self.name}] still parked without a session at the end: {left}", flush=True)

    def respawn(self, c: ClientProc, duration: float) -> ClientProc:
        """A new process of the same sort as ``c`` (a new job id), e.g. after killing it."""
        return self.spawn_client(duration, kind=c.kind)  # type: ignore[arg-type]

    def stop(self) -> None:
        self._monitor_stop.set()
        if self.observer is not None and self.observer._thread.is_alive():
            self.observer.stop()
        for fn in self.on_stop:
            try:
                fn()
            except Exception as e:
                print(f"[{self.name}] teardown: {e!r}", flush=True)
        self.lockd.stop()

    def fault_recoveries(self, events: list[dict]) -> list[float | None]:
        """For each fault: seconds from its injection to the next grant in any group."""
        return fault_recoveries(self.faults, events)

    def print_figures(self, report: Report, events: list[dict]) -> None:
        print_figures(self, report, events)

