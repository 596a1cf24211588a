"""``timeslice up``: a local cluster on this machine (etcd, lockd replicas, one node agent).

    timeslice up                      # 1 etcd member, 3 lockd replicas, 1 agent; Ctrl-C stops it
    timeslice up --etcd-members 3     # try member loss
    timeslice up --detach             # leave it running; `timeslice up --stop` ends it
    timeslice up --backend sim        # the simulated device even when a GPU is present

Defaults come from deploy/local.env; every key there is a flag (LOCKD_REPLICAS
= --lockd-replicas, alias --replicas). Logs, etcd data and cluster.json go to
one folder, <LOG_DIR>/<timestamp>/ unless --run-dir names another. Other
commands find the running cluster from any directory (a pointer in the per-user
state folder, see launcher/state.py). While one runs, a second `up`
refuses (use it, stop it, or pass --another). With --json, `up` prints one JSON
object (the cluster's addresses, metrics ports, pids) instead of the text.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from timeslice.launcher import state as S
from timeslice.launcher.cluster import DEFAULT_GROUP, LaunchError, LocalCluster
from timeslice.launcher.progress import Progress, size_text
from timeslice.launcher.settings import Settings, SettingsError, flag_name, load

_ALIASES = {"LOCKD_REPLICAS": ["--replicas"]}
#: What lockd and the node agent import that a plain (job-client) install lacks: the `server` extra.
SERVER_MODULES = ("aetcd", "grpc_health", "prometheus_client")


def server_extra_missing(command: str) -> str | None:
    """The message for ``timeslice <command>`` when the `server` extra is not installed, else None."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"timeslice {command}: the local cluster runs lockd and the node agent, which need the server extra "
            f"(not installed: {', '.join(missing)}); install it with: pip install 'timeslice[server]'")


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """One flag per local.env key (default: unset, i.e. the file's value), plus --env-file."""
    g = p.add_argument_group("cluster settings (defaults from deploy/local.env)")
    g.add_argument("--env-file", default=None, help="settings file instead of deploy/local.env "
                   "[env TIMESLICE_LOCAL_ENV]")
    for key in Settings.key_names():
        names = [flag_name(key), *_ALIASES.get(key, [])]
        kind = str if key in ("PREFIX", "BACKEND", "LOG_DIR") else int
        extra: dict[str, Any] = {"choices": ["auto", "sim", "cuda-driver", "cuda-checkpoint"]} if key == "BACKEND" else {}
        g.add_argument(*names, dest=f"cfg_{key}", type=kind, default=None, metavar=key, help=f"overrides {key}",
                       **extra)


def settings_from_args(args: argparse.Namespace) -> tuple[Settings, str]:
    overrides = {key: getattr(args, f"cfg_{key}", None) for key in Settings.key_names()}
    return load(args.env_file, overrides)


def new_run_dir(log_dir: str, suffix: str = "") -> Path:
    base = Path(log_dir) / (time.strftime("%Y%m%d-%H%M%S") + suffix)
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("up", parents=[common], help="start a local cluster (etcd, lockd x3, nodeagent)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", "--logdir", dest="logdir", default=None,
                   help="folder for this run's logs, data and cluster.json (default: <LOG_DIR>/<timestamp>; "
                        "--logdir is an older spelling; LOG_DIR / --log-dir is the parent of all runs)")
    p.add_argument("--detach", action="store_true", help="return once the cluster is up and leave it running")
    p.add_argument("--stop", action="store_true",
                   help="stop a detached cluster: the one in --run-dir, else the running one")
    p.add_argument("--another", action="store_true",
                   help="start even though a local cluster is already running (a second, separate one)")
    p.add_argument("--node", default=None, help="the agent's node name (default $TIMESLICE_NODE_NAME, else host name)")
    p.add_argument("--group", default=DEFAULT_GROUP,
                   help=f"create this group over the local node (default {DEFAULT_GROUP!r}; '' for none)")
    add_cluster_flags(p)
    p.set_defaults(func=run)


def summary(c: LocalCluster, took: float) -> str:
    lines = [f"timeslice local cluster is up ({took:.1f}s)", ""]
    lines.append(f"  etcd       {c.etcd_endpoints_str}  ({len(c.etcd)} member{'s' if len(c.etcd) > 1 else ''})")
    lines.append(f"  lockd      {c.target}  (leader {c.leader.get('replica')}, epoch {c.leader.get('epoch')})")
    agent_info = c.agent.info if c.agent else {}
    lines.append("  metrics    lockd " + ", ".join(f"127.0.0.1:{r.info.get('metrics_port')}" for r in c.lockd)
                 + f"; nodeagent 127.0.0.1:{agent_info.get('metrics_port')}")
    agent = f"  nodeagent  node {c.node!r} at 127.0.0.1:{agent_info.get('port')}, backend {c.backend}"
    if c.backend == "sim":
        agent += f" = SIMULATED device, {size_text(c.settings.sim_device_capacity_bytes)} in {c.sim_dir}"
    lines.append(agent)
    if c.group:
        lines.append(f"  group      {c.group!r} over node {c.node!r}")
    lines.append(f"  logs       {c.run_dir}/   (state: {c.state_path})")
    notes = {"TIMESLICE_AGENT_SOCKET": "   # the node agent's channel (found without it too)",
             "TIMESLICE_SIM_DIR": "   # the SIMULATED device a CPU job's memory must be on (found without it too)"}
    lines += [""] + [f"  export {k}={v}{notes.get(k, '')}" for k, v in exports(c).items()]
    lines += ["  " + c.etcdctl_command() + "     # the queues, grants, agents, intents", ""]
    return "\n".join(lines)


def exports(c: LocalCluster) -> dict[str, str]:
    """What a job on this machine may set to use the cluster (it finds each without them too, through the
    cluster's pointer: the client its lockd, the channel its agent, the simulated memory its device)."""
    out = {"TIMESLICE_TARGET": c.target, "TIMESLICE_NODE_NAME": c.node,
           "TIMESLICE_AGENT_SOCKET": str(c.run_dir / "agent.sock")}
    if c.backend == "sim" and c.sim_dir:
        out["TIMESLICE_SIM_DIR"] = str(c.sim_dir)
    return out


def describe(c: LocalCluster) -> dict:
    """The --json view of a running cluster."""
    doc = c.to_state()
    keep = ("status", "run_dir", "target", "lockd_targets", "etcd_endpoints", "leader", "node", "group",
            "backend", "metrics", "prefix", "etcdctl", "agent_socket")
    return {**{k: doc.get(k) for k in keep}, "state_file": str(c.state_path),
            "sim_dir": c.sim_dir if c.backend == "sim" else None, "exports": exports(c),
            "pids": {f"{p['kind']} {p['name']}": p["pid"] for p in doc.get("processes", [])}}


def _say_json(doc: dict) -> None:
    print(json.dumps(doc, sort_keys=True), flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        settings, origin = settings_from_args(args)
    except SettingsError as e:
        print(f"timeslice up: {e}", file=sys.stderr)
        return 2
    if args.stop:
        return stop_detached(args, settings)
    if (msg := server_extra_missing("up")) is not None:   # stopping needs none of it
        print(msg, file=sys.stderr)
        return 1
    if not args.another:
        running = S.find_running_anywhere(settings.log_dir)
        if running is not None:
            path, doc = running
            msg = (f"a local cluster is already running (lockd {doc.get('target')}, run folder {path.parent}); "
                   f"use it (export TIMESLICE_TARGET={doc.get('target')}), stop it (timeslice up --stop), "
                   f"or start a separate one with --another")
            if args.json:
                _say_json({"error": msg, "running": {"target": doc.get("target"), "run_dir": str(path.parent),
                                                     "state_file": str(path)}})
            print(f"timeslice up: {msg}", file=sys.stderr)
            return 1
    run_dir = Path(args.logdir) if args.logdir else new_run_dir(settings.log_dir)
    # With --json, stdout carries the one JSON object; progress goes to stderr.
    progress = Progress(out=(lambda m: print(m, file=sys.stderr, flush=True)) if args.json else None)
    print(f"timeslice up: starting a local cluster in {run_dir}/ (settings: {origin})",
          file=sys.stderr if args.json else sys.stdout, flush=True)
    cluster = LocalCluster(settings, run_dir, node=args.node, group=args.group or None, progress=progress,
                           settings_origin=origin)

    stop_requested = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)
        cluster.interrupt()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    try:
        try:
            cluster.start()
        except KeyboardInterrupt:
            print("timeslice up: interrupted while starting; stopped again", file=sys.stderr)
            return 130
        except LaunchError as e:
            print(f"timeslice up: could not start the cluster: {e}", file=sys.stderr)
            return 1
        if args.json:
            _say_json({**describe(cluster), "detached": bool(args.detach),
                       "stop_with": f"timeslice up --stop --run-dir {run_dir}"})
        else:
            print("\n" + summary(cluster, time.monotonic() - t0), flush=True)
        if args.detach:
            if not args.json:
                print(f"  detached; stop it with: timeslice up --stop --run-dir {run_dir}", flush=True)
            return 0
        if not args.json:
            print("  Ctrl-C stops the cluster (agent, then lockd, then etcd).", flush=True)
        reported: set[str] = set()
        while not stop_requested:
            for child in cluster.dead_children():
                key = f"{child.kind} {child.name}"
                if key not in reported:
                    reported.add(key)
                    progress(f"WARNING: {key} (pid {child.pid}) exited rc={child.returncode()}; "
                             f"see {child.log_path}")
            time.sleep(0.3)
        print(flush=True)
        progress(f"got {signal.Signals(stop_requested[0]).name}; stopping")
        cluster.stop()
        return 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def stop_detached(args: argparse.Namespace, settings: Settings) -> int:
    def fail(msg: str) -> int:
        if args.json:
            _say_json({"error": msg, "stopped": False})
        print(f"timeslice up --stop: {msg}", file=sys.stderr)
        return 1

    if args.logdir:
        path = Path(args.logdir) / S.STATE_FILE
        if not path.is_file():
            return fail(f"no {S.STATE_FILE} in {args.logdir}")
        doc = S.read(path)
    else:
        found = S.find_running_anywhere(settings.log_dir)
        if found is None:
            return fail(f"no running local cluster (none remembered in {S.user_dir()}, none under {settings.log_dir}/)")
        path, doc = found
    out = sys.stderr if args.json else sys.stdout
    print(f"timeslice up --stop: stopping the cluster of {path.parent}/", file=out, flush=True)
    c = LocalCluster.from_state(doc, progress=Progress(out=(lambda m: print(m, file=out, flush=True))))
    c.stop()
    if args.json:
        _say_json({"stopped": True, "run_dir": str(path.parent), "state_file": str(path)})
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m timeslice.launcher.cli_up ...`` (the same as ``timeslice up ...``)."""
    from timeslice.cli import main as cli_main
    return cli_main(["up", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
