"""The admin and status subcommands: groups, group create|delete, status, watch, jobs."""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time

from timeslice import render
from timeslice.cli import admin_client
from timeslice.common.cliout import emit, to_jsonable
from timeslice.errors import TimesliceClientError
from timeslice.model import NodeSpec


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("groups", parents=[common], help="list groups with their holder and queue length")
    p.set_defaults(func=cmd_groups)

    g = sub.add_parser("group", help="create or delete a group")
    gsub = g.add_subparsers(dest="group_command", metavar="ACTION", required=True)
    c = gsub.add_parser("create", parents=[common], help="create a group of nodes (and GPUs)")
    c.add_argument("name")
    c.add_argument("--node", action="append", default=[], metavar="NODE[:GPU,GPU]", type=_node_spec,
                   help="a node of the group, optionally with GPU indices; repeat for more nodes")
    c.add_argument("--isolation", choices=isolation_choices(), default=NO_ISOLATION,
                   help="how far a parked job is moved off the group's devices (lockd's policies; "
                        f"{NO_ISOLATION!r}: cooperative workers keep their CUDA context)")
    c.add_argument("--tenant", action="append", default=[], metavar="TENANT",
                   help="a tenant whose jobs may acquire the group ('*': every tenant; needed where lockd "
                        "runs with tenants); repeat for more")
    c.add_argument("--admin-tenant", action="append", default=[], metavar="TENANT",
                   help="a tenant that administers the group (may delete it, sees all its jobs); repeat for more")
    c.add_argument("--priorities", action="store_true",
                   help="let jobs acquire with a priority class 0..9 (highest first, FIFO within a class); "
                        "off: pure FIFO")
    c.add_argument("--max-overtakes", type=int, default=0, metavar="K",
                   help="with --priorities: a waiter goes first once K grants were made since it joined "
                        "(0: lockd's default, 4)")
    c.add_argument("--max-wait-s", type=int, default=0, metavar="S",
                   help="with --priorities: ... or once it waited S seconds (0: no time bound)")
    c.add_argument("--sharing", choices=sharing_choices(), default="exclusive",
                   help="exclusive (default): one holder at a time; fit: jobs whose declared footprints "
                        "(device_bytes_hint) fit on the GPUs hold the group side by side, and what does not "
                        "fit is time-sliced (a job that declares nothing, or asks exclusive=True, is alone)")
    c.set_defaults(func=cmd_group_create)
    d = gsub.add_parser("delete", parents=[common], help="delete a group")
    d.add_argument("name")
    d.add_argument("--force", action="store_true", help="delete even while jobs are queued")
    d.set_defaults(func=cmd_group_delete)

    s = sub.add_parser("status", parents=[common],
                       help="holder, grant, waiters in order, and per-node residency of a group")
    s.add_argument("group")
    s.set_defaults(func=cmd_status)

    w = sub.add_parser("watch", parents=[common], help="live view of a group, redrawn on every change")
    w.add_argument("group")
    w.add_argument("--count", type=int, default=0, metavar="N", help="exit after N updates (0: run until ^C)")
    w.add_argument("--refresh", type=float, default=1.0, metavar="S",
                   help="redraw every S seconds between updates, so ages stay current (not with --json)")
    w.add_argument("--frames", type=int, default=0, metavar="N",
                   help="exit after N screens, redraws included (0: no limit)")
    w.set_defaults(func=cmd_watch)

    j = sub.add_parser("jobs", parents=[common], help="jobs with a live session")
    j.set_defaults(func=cmd_jobs)


#: How the CLI spells the default isolation policy (records.ISOLATION_NONE, the empty string).
NO_ISOLATION = "none"


def isolation_choices() -> list[str]:
    """The group isolation policies lockd knows (records.ISOLATIONS, read here, never copied)."""
    from timeslice.common.server import records as R
    return sorted(v or NO_ISOLATION for v in R.ISOLATIONS)


def sharing_choices() -> list[str]:
    """The sharing policies lockd knows (records.SHARINGS, read here, never copied)."""
    from timeslice.common.server import records as R
    return sorted(R.SHARINGS)


def _isolation(choice: str) -> str:
    from timeslice.common.server import records as R
    return R.ISOLATION_NONE if choice == NO_ISOLATION and NO_ISOLATION not in R.ISOLATIONS else choice


def _node_spec(text: str) -> NodeSpec:
    try:
        return NodeSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_groups(args) -> int:
    with admin_client(args) as c:
        groups = c.groups()
        statuses = {}
        for g in groups:
            try:
                statuses[g.group_id] = c.status(g.group_id)
            except Exception:  # deleted in between: shown as unknown
                pass
    data = [{**g.to_dict(), "holder": statuses[g.group_id].holder.job_id
             if g.group_id in statuses and statuses[g.group_id].holder else None,
             "waiting": len(statuses[g.group_id].waiters) if g.group_id in statuses else None}
            for g in groups]
    emit(args, data, lambda: render.groups_table(groups, statuses))
    return 0


def cmd_group_create(args) -> int:
    with admin_client(args) as c:
        g = c.create_group(args.name, args.node, isolation=_isolation(args.isolation), tenants=args.tenant,
                           admins=args.admin_tenant, priorities=args.priorities, max_overtakes=args.max_overtakes,
                           max_wait_s=args.max_wait_s, sharing=args.sharing)
        try:
            alive = {n.node for n in c.status(g.group_id).node_status if n.agent_alive}
        except TimesliceClientError:          # deleted in between: nothing to warn about
            alive = None
    lonely = [] if alive is None else [n.node for n in g.nodes if n.node not in alive]
    warnings = [f"node {n!r} has no live node agent: jobs will wait on this group until an agent "
                f"registers there (is the node name right? `timeslice status {g.group_id}` shows the agents)"
                for n in lonely]
    for w in warnings:
        print(f"timeslice: warning: {w}", file=sys.stderr, flush=True)
    iso = ", sharing: fit" if g.sharing == "fit" else ""
    iso += f", isolation: {g.isolation}" if g.isolation else ""
    iso += f", tenants: {' '.join(g.tenants)}" if g.tenants else ""
    iso += f", administered by: {' '.join(g.admins)}" if g.admins else ""
    iso += (f", priorities: a waiter goes first after {g.max_overtakes} grants"
            + (f" or {g.max_wait_s}s" if g.max_wait_s else "")) if g.priorities else ""
    emit(args, {**g.to_dict(), "warnings": warnings},
         lambda: f"group {g.group_id} created (nodes: {' '.join(map(str, g.nodes)) or 'none'}{iso})")
    return 0


def cmd_group_delete(args) -> int:
    with admin_client(args) as c:
        deleted = c.delete_group(args.name, force=args.force)
    emit(args, {"group_id": args.name, "deleted": deleted},
         f"group {args.name} deleted" if deleted else f"group {args.name} was already gone")
    return 0


def cmd_status(args) -> int:
    with admin_client(args) as c:
        st = c.status(args.group)
    emit(args, st, lambda: render.status_text(st))
    return 0


def cmd_watch(args) -> int:
    """Redraw on every change, and every --refresh seconds in between (ages move on)."""
    tty = sys.stdout.isatty() and not args.json
    updates: queue.Queue = queue.Queue()
    n = frames = 0
    with admin_client(args) as c:
        def pump() -> None:                  # the blocking stream, in its own thread
            try:
                for st in c.watch(args.group):
                    updates.put(("status", st))
            except BaseException as e:  # handed to the main thread
                updates.put(("error", e))
            else:
                updates.put(("end", None))
        threading.Thread(target=pump, name="watch", daemon=True).start()
        last = None
        while True:
            wait = None if (args.json or last is None or args.refresh <= 0) else args.refresh
            try:
                kind, value = updates.get(timeout=wait)
            except queue.Empty:
                kind, value = "redraw", last
            if kind == "error":
                raise value
            if kind == "end":
                break
            if kind == "status":
                n, last = n + 1, value
            frames += 1
            if last is None:
                continue
            if args.json:
                print(json.dumps(to_jsonable(last), sort_keys=True), flush=True)   # JSON Lines, changes only
            else:
                head = f"{time.strftime('%H:%M:%S')}  update {n}  (^C to stop)"
                if tty:
                    sys.stdout.write("\x1b[H\x1b[2J")                           # redraw in place
                else:
                    head = f"--- {head}"
                print(head + "\n" + render.status_text(last) + "\n", flush=True)
            if (args.count and n >= args.count and kind == "status") or (args.frames and frames >= args.frames):
                break
    return 0


def cmd_jobs(args) -> int:
    with admin_client(args) as c:
        jobs = c.jobs()
    emit(args, jobs, lambda: render.jobs_table(jobs))
    return 0
