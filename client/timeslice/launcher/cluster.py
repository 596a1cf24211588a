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

import base64
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from timeslice.launcher import state as S
from timeslice.launcher.procs import Child, ChildFailed, read_ready_line
from timeslice.launcher.settings import Settings
from timeslice.common.auth import ENV_ADMIN_TOKEN, ENV_ADMIN_TOKEN_FILE, TOKEN_FILE_NAME, write_token_file
from timeslice.common.keys import prefix_range_end

DEFAULT_GROUP = "local"
ETCD_BIN_ENV = "TIMESLICE_ETCD_BIN"


class LaunchError(RuntimeError):
    """The cluster could not start; what started has been stopped again."""


def free_port() -> int:
    from timeslice.common.netutil import free_port as _free
    return _free()


def find_etcd() -> str:
    explicit = os.environ.get(ETCD_BIN_ENV)
    if explicit:
        return explicit
    found = shutil.which("etcd")
    if not found:
        raise LaunchError("etcd not found on PATH: install it (Debian/Ubuntu: "
                          "sudo apt-get install -y etcd-server etcd-client; scripts/demo.sh does it) "
                          f"or point {ETCD_BIN_ENV} at the binary")
    return found


def _etcd_env() -> dict[str, str]:
    # etcd reads ETCD_* variables as flags and refuses a flag given twice.
    return {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "ETCDCTL_"))}


def _http(port: int, path: str, body: dict | None = None, timeout: float = 1.0) -> dict | None:
    from timeslice.common.netutil import http_json
    return http_json(port, path, None if body is None else json.dumps(body).encode(), timeout)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


class Progress:
    """Timestamped progress lines ("[ 1.2s] lockd r0: ready at 127.0.0.1:40123")."""

    def __init__(self, out: Callable[[str], None] | None = None):
        self.t0 = time.monotonic()
        self._out = out or (lambda s: print(s, flush=True))

    def __call__(self, msg: str) -> None:
        self._out(f"  [{time.monotonic() - self.t0:5.1f}s] {msg}")


class LocalCluster:
    def __init__(self, settings: Settings, run_dir: str | os.PathLike, *, node: str | None = None,
                 group: str | None = DEFAULT_GROUP, progress: Callable[[str], None] | None = None,
                 python: str = sys.executable, sim_dir: str | None = None, settings_origin: str = ""):
        from timeslice.config import node_name
        self.settings = settings
        self.run_dir = Path(run_dir).absolute()
        self.node = node or node_name()
        self.group = group
        self.progress = progress if progress is not None else Progress()
        self.python = python
        self.settings_origin = settings_origin
        self._sim_dir_wanted = sim_dir
        self.sim_dir: str | None = None
        self._sim_dir_ours = False
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

    # -- start -----------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalCluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        self.status = "starting"
        try:
            self._start_etcd(timeout)
            self._start_lockd_and_agent(timeout)
            if self.group:
                self._create_group()
        except BaseException as e:
            self.progress(f"start failed: {e.__class__.__name__}; stopping what started")
            self.stop(quiet=True)
            if isinstance(e, (ChildFailed, LaunchError)):
                raise LaunchError(str(e)) from None
            raise
        self.status = "running"
        self.write_state()
        return self

    def _start_etcd(self, timeout: float) -> None:
        s = self.settings
        binary = find_etcd()
        n = s.etcd_members
        self.progress(f"etcd: starting {n} member{'s' if n > 1 else ''} ({binary})")
        for attempt in range(3):
            names = [f"m{i}" for i in range(n)]
            cports = [s.etcd_client_port + i if s.etcd_client_port else free_port() for i in range(n)]
            pports = [s.etcd_peer_port + i if s.etcd_peer_port else free_port() for i in range(n)]
            initial = ",".join(f"{nm}=http://127.0.0.1:{pp}" for nm, pp in zip(names, pports))
            token = f"timeslice-{self.run_dir.name}-{attempt}"
            self.etcd = []
            for nm, cp, pp in zip(names, cports, pports):
                url_c, url_p = f"http://127.0.0.1:{cp}", f"http://127.0.0.1:{pp}"
                argv = [binary, "--name", nm, "--data-dir", str(self.run_dir / "etcd" / f"{nm}.etcd"),
                        "--listen-client-urls", url_c, "--advertise-client-urls", url_c,
                        "--listen-peer-urls", url_p, "--initial-advertise-peer-urls", url_p,
                        "--initial-cluster", initial, "--initial-cluster-token", token,
                        "--initial-cluster-state", "new",
                        # compact history older than an hour: a long-running local
                        # cluster (the agent refreshes its key) stays small
                        "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h",
                        "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
                child = Child("etcd", nm, argv, str(self.run_dir / f"etcd-{nm}.log"), env=_etcd_env())
                child.info.update(client_port=cp, peer_port=pp, endpoint=f"127.0.0.1:{cp}")
                self.etcd.append(child.spawn())
            try:
                for m in self.etcd:
                    m.wait_ready(_etcd_healthy, timeout, self._interrupted.is_set)
                break
            except ChildFailed as e:
                collision = "address already in use" in str(e)
                for m in self.etcd:
                    m.stop(2)
                if not collision or s.etcd_client_port or s.etcd_peer_port or attempt == 2:
                    raise
                shutil.rmtree(self.run_dir / "etcd", ignore_errors=True)
                self.progress("etcd: a port was taken meanwhile; trying fresh ports")
        self.progress(f"etcd: healthy at {self.etcd_endpoints_str}")

    def _start_lockd_and_agent(self, timeout: float) -> None:
        s = self.settings
        eps = self.etcd_endpoints_str
        env = {**os.environ, "PYTHONUNBUFFERED": "1", ENV_ADMIN_TOKEN_FILE: self._admin_token_file()}
        env.pop(ENV_ADMIN_TOKEN, None)         # the file is the one source: lockd, the agent and the CLI share it
        n = s.lockd_replicas
        self.progress(f"lockd: starting {n} replica{'s' if n > 1 else ''}; "
                      f"nodeagent: starting on node {self.node!r} (backend {s.backend})")
        for i in range(n):
            port = s.lockd_port + i if s.lockd_port else 0
            mport = s.lockd_metrics_port + i if s.lockd_metrics_port else free_port()
            rid = f"r{i}"
            argv = [self.python, "-m", "timeslice.lockd.cli", "serve", "--etcd-endpoints", eps, "--prefix", s.prefix,
                    "--listen", f"127.0.0.1:{port}", "--metrics-port", str(mport), "--metrics-host", "127.0.0.1",
                    "--replica-id", rid]
            child = Child("lockd", rid, argv, str(self.run_dir / f"lockd-{rid}.log"), env=env)
            child.info.update(metrics_port=mport)
            self.lockd.append(child.spawn())
        self.agent = self._agent_child(eps, env).spawn()
        for r in self.lockd:
            r.wait_ready(_lockd_ready, timeout, self._interrupted.is_set)
            self.progress(f"lockd {r.name}: ready at 127.0.0.1:{r.info['port']} "
                          f"(metrics :{r.info['metrics_port']}, pid {r.pid})")
        self.leader = self._wait_leader(timeout)
        self.progress(f"lockd: leader is {self.leader['replica']} (epoch {self.leader['epoch']})")
        self.agent.wait_ready(_agent_ready, timeout, self._interrupted.is_set)
        why, _, passed = self.agent.info.get("why", "").partition(" (passed over: ")
        self.progress(f"nodeagent {self.node}: ready at 127.0.0.1:{self.agent.info['port']} "
                      f"(metrics :{self.agent.info['metrics_port']}), "
                      f"backend {self.backend}" + (f": {why}" if why else ""))
        if passed:
            self.progress(f"nodeagent: passed over {_clip(passed.rstrip(')'), 150)}")
        if self.backend == "sim":
            self.progress(f"nodeagent: SIMULATED device of {_size(s.sim_device_capacity_bytes)} in {self.sim_dir} "
                          f"(snapshot {s.sim_snapshot_bytes_per_s / 1e9:g} GB/s, "
                          f"restore {s.sim_restore_bytes_per_s / 1e9:g} GB/s)")

    def _admin_token_file(self) -> str:
        """The admin token of this cluster, in <run_dir>/admin-token (mode 0600): $TIMESLICE_ADMIN_TOKEN
        if set, else a fresh random one. This process's own admin calls use it too."""
        path = self.run_dir / TOKEN_FILE_NAME
        write_token_file(path, os.environ.get(ENV_ADMIN_TOKEN, "").strip() or secrets.token_urlsafe(32))
        if not os.environ.get(ENV_ADMIN_TOKEN):
            os.environ[ENV_ADMIN_TOKEN_FILE] = str(path)
        return str(path)

    def _agent_child(self, eps: str, env: dict) -> Child:
        s = self.settings
        self.sim_dir = self._pick_sim_dir()
        port = s.nodeagent_port or 0
        mport = s.nodeagent_metrics_port or free_port()
        argv = [self.python, "-m", "timeslice.nodeagent.cli", "serve", "--node", self.node, "--etcd-endpoints", eps,
                "--prefix", s.prefix, "--listen", f"127.0.0.1:{port}", "--metrics-port", str(mport),
                "--metrics-host", "127.0.0.1",
                "--backend", s.backend, "--state-dir", str(self.run_dir / "nodeagent-state"),
                "--sim-dir", self.sim_dir, "--sim-capacity-bytes", str(s.sim_device_capacity_bytes),
                "--sim-checkpoint-gbps", repr(s.sim_snapshot_bytes_per_s / 1e9),
                "--sim-restore-gbps", repr(s.sim_restore_bytes_per_s / 1e9),
                # The cooperative channel lives in the run dir (jobs find it through the state's
                # agent_socket / $TIMESLICE_AGENT_SOCKET). Attestation is checked (an attested process
                # is never acted on for another job) but not required here: a local cluster serves
                # one user; deploy/ requires it (--require-attestation).
                "--channel-socket", str(self.run_dir / "agent.sock")]
        child = Child("nodeagent", self.node, argv, str(self.run_dir / "nodeagent.log"),
                      env={**env, "TIMESLICE_SIM_HOST_DIR": str(Path(self.sim_dir) / "host")})
        child.info.update(metrics_port=mport, node=self.node, sim_dir=self.sim_dir,
                          agent_socket=str(self.run_dir / "agent.sock"),
                          sim_capacity_bytes=s.sim_device_capacity_bytes)
        return child

    def _pick_sim_dir(self) -> str:
        """RAM (/dev/shm) when it has room for the device and its host copies, else the run dir."""
        if self._sim_dir_wanted:
            return self._sim_dir_wanted
        local = self.run_dir / "sim"
        shm = Path("/dev/shm")
        need = 3 * self.settings.sim_device_capacity_bytes
        try:
            st = os.statvfs(shm)
            roomy = os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize > need
        except OSError:
            roomy = False
        if not roomy:
            local.mkdir(parents=True, exist_ok=True)
            self._sim_dir_ours = True
            return str(local)
        d = shm / f"timeslice-sim-{self.run_dir.name}-{os.getpid()}"
        d.mkdir(parents=True, exist_ok=True)
        self._sim_dir_ours = True
        try:
            if not local.exists():
                local.symlink_to(d)
        except OSError:
            pass
        return str(d)

    def _wait_leader(self, timeout: float) -> dict:
        """The lowest election key under <prefix>leader/ (read over etcd's JSON gateway)."""
        prefix = (self.settings.prefix + "leader/").encode()
        body = {"key": _b64(prefix), "range_end": _b64(prefix_range_end(prefix))}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.etcd:
                reply = _http(m.info["client_port"], "/v3/kv/range", body)
                kvs = (reply or {}).get("kvs") or []
                if kvs:
                    head = min(kvs, key=lambda kv: int(kv["create_revision"]))
                    try:
                        who = json.loads(base64.b64decode(head["value"])).get("replica", "?")
                    except ValueError:
                        who = "?"
                    return {"replica": who, "epoch": int(head["create_revision"])}
            for r in self.lockd:
                if not r.alive():
                    raise ChildFailed(f"lockd {r.name} exited (rc={r.returncode()}); "
                                      f"last lines of {r.log_path}:\n{r.log_tail()}")
            if self._interrupted.is_set():
                raise KeyboardInterrupt
            time.sleep(0.1)
        raise LaunchError(f"no lockd replica became leader within {timeout:.0f}s; see {self.run_dir}/lockd-*.log")

    def _create_group(self) -> None:
        from timeslice.client import OrchestratorClient
        with OrchestratorClient(self.target, job_id="timeslice-up", timeout=20.0) as c:
            c.create_group(self.group, nodes=[self.node])
        self.progress(f"group {self.group!r} over node {self.node!r} created")

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
        from timeslice.launcher.settings import Settings as _S
        sim = doc.get("sim") or {}
        settings = _S(prefix=doc.get("prefix", "/timeslice/"),
                      sim_device_capacity_bytes=int(sim.get("capacity_bytes") or (64 << 20)))
        c = cls(settings, doc["run_dir"], node=doc.get("node"), group=doc.get("group"), progress=progress,
                sim_dir=sim.get("dir"))
        c.sim_dir = (sim or {}).get("dir")
        c._sim_dir_ours = bool(c.sim_dir)
        c.status, c.leader, c.started_at = doc.get("status", "?"), doc.get("leader", {}), doc.get("started_unix", 0)
        for p in doc["processes"]:
            child = Child.from_dict(p)
            if p["kind"] == "etcd":
                c.etcd.append(child)
            elif p["kind"] == "lockd":
                c.lockd.append(child)
            else:
                c.agent = child
        return c

    # -- health -----------------------------------------------------------------------------
    def health(self) -> dict[str, bool]:
        out = {}
        for m in self.etcd:
            out[f"etcd {m.name}"] = m.alive() and _etcd_healthy(m) is not None
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
            for r in self.lockd:              # signal all, then wait: one grace period in all
                if r.alive():
                    r._signal(signal.SIGTERM)
            for r in self.lockd:
                r.stop(grace=10)
        if self.etcd:
            say("etcd: stopping")
            for m in self.etcd:               # one at a time: no leadership ping-pong
                m.stop(grace=10)
        if self.sim_dir and self._sim_dir_ours:
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


# -- readiness probes (Child -> info dict, or None while not ready) ------------------------------

def _etcd_healthy(m: Child) -> dict | None:
    reply = _http(m.info["client_port"], "/health")
    if reply and reply.get("health") in ("true", True):
        return {"healthy": True}
    return None


def _lockd_ready(r: Child) -> dict | None:
    got = read_ready_line(r.log_path, b"LOCKD_READY", r.log_offset)
    return {"port": int(got["port"])} if got else None


def _agent_ready(a: Child) -> dict | None:
    got = read_ready_line(a.log_path, b"NODEAGENT_READY", a.log_offset)
    if not got:
        return None
    info = {"port": int(got["port"]), "backend": got.get("backend", "?")}
    why = _log_event_field(a, "agent_started", "why") or _log_event_field(a, "backend_picked", "why")
    if why:
        info["why"] = why
    return info


def _log_event_field(c: Child, event: str, key: str) -> str | None:
    try:
        with open(c.log_path, "rb") as f:
            f.seek(c.log_offset)
            for line in f:
                if line.startswith(b"{") and event.encode() in line:
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if ev.get("event") == event and key in ev:
                        return str(ev[key])
    except FileNotFoundError:
        pass
    return None


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"
