"""The admin and status subcommands: groups, group create|delete, status, watch, jobs."""
from __future__ import annotations

import argparse
import json
import sys
import time

from timeslice import render
from timeslice.cli import admin_client, emit, to_jsonable
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
    w.set_defaults(func=cmd_watch)

    j = sub.add_parser("jobs", parents=[common], help="jobs with a live session")
    j.set_defaults(func=cmd_jobs)


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
            except Exception:  # noqa: BLE001 - deleted in between: shown as unknown
                pass
    data = [{**g.to_dict(), "holder": statuses[g.group_id].holder.job_id
             if g.group_id in statuses and statuses[g.group_id].holder else None,
             "waiting": len(statuses[g.group_id].waiters) if g.group_id in statuses else None}
            for g in groups]
    emit(args, data, lambda: render.groups_table(groups, statuses))
    return 0


def cmd_group_create(args) -> int:
    with admin_client(args) as c:
        g = c.create_group(args.name, args.node)
    emit(args, g, lambda: f"group {g.group_id} created (nodes: {' '.join(map(str, g.nodes)) or 'none'})")
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
    tty = sys.stdout.isatty() and not args.json
    n = 0
    with admin_client(args) as c:
        for st in c.watch(args.group):
            n += 1
            if args.json:
                print(json.dumps(to_jsonable(st), sort_keys=True), flush=True)   # JSON Lines
            else:
                head = f"{time.strftime('%H:%M:%S')}  update {n}  (^C to stop)"
                if tty:
                    sys.stdout.write("\x1b[H\x1b[2J")                           # redraw in place
                else:
                    head = f"--- {head}"
                print(head + "\n" + render.status_text(st) + "\n", flush=True)
            if args.count and n >= args.count:
                break
    return 0


def cmd_jobs(args) -> int:
    with admin_client(args) as c:
        jobs = c.jobs()
    emit(args, jobs, lambda: render.jobs_table(jobs))
    return 0
