"""``timeslice report``: the operator's page of the whole system, as one HTML file.

    timeslice report --since 10m                      # report.html: every group, the last 10 minutes
    timeslice report --since 1h --group rl-a -o a.html --png a.png

It reads etcd directly (the leader's records of finished holds and the groups' state
now: see lockd/report/page.py for what is shown), so it needs the ``server`` extra and
etcd's address: --etcd-endpoints, else $TIMESLICE_ETCD_ENDPOINTS, else the local
cluster's (``timeslice up``), else 127.0.0.1:2379; TLS and credentials as for the
servers (TIMESLICE_ETCD_CA/CERT/KEY, TIMESLICE_ETCD_USER and _PASSWORD or _PASSWORD_FILE).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

from timeslice.common import defaults as D
from timeslice.common.cliout import emit
from timeslice.common.local import running_cluster

PAGE = 500                      # keys per etcd read: a page stays far below gRPC's message limit
MAX_SINCE_S = 7 * 24 * 3600


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 10m, 2h, 1d; got {text!r}")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if not 0 < seconds <= MAX_SINCE_S:
        raise argparse.ArgumentTypeError(f"--since must be more than 0 and at most 7d, got {text!r}")
    return seconds


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("report", parents=[common], help="an HTML page of every group: holds, swaps, waits, duty cycle",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--since", type=_duration, default=600.0, metavar="DURATION",
                   help="how far back: 90s, 10m, 2h, 1d (default: 10m)")
    p.add_argument("-o", "--output", default="report.html", help="the HTML file to write")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="also draw the timeline picture (matplotlib: the demo extra)")
    p.add_argument("--group", action="append", default=[], help="only this group; repeat for more")
    p.add_argument("--etcd-endpoints", default=None, help="comma-separated etcd host:port (default: see above)")
    p.add_argument("--prefix", default=None, help="key prefix in etcd (default: $TIMESLICE_PREFIX, else the local "
                                                  f"cluster's, else {D.KEY_PREFIX})")
    p.set_defaults(func=cmd_report)


def _where(args: argparse.Namespace) -> tuple[str, str]:
    found = running_cluster()
    doc = found[1] if found else {}
    endpoints = (args.etcd_endpoints or os.environ.get(D.ENV_ETCD_ENDPOINTS)
                 or ",".join(doc.get("etcd_endpoints") or []) or D.ETCD_ENDPOINTS)
    prefix = args.prefix or os.environ.get(D.ENV_PREFIX) or doc.get("prefix") or D.KEY_PREFIX
    return endpoints, prefix


async def read_state(endpoints: str, prefix: str, timeout: float):
    """(hold records, specs, grants, queues) from etcd, read at one revision."""
    from timeslice.common.server import records as R
    from timeslice.common.server.etcd import ops
    from timeslice.common.server.etcd.client import EtcdClient, EtcdConfig
    from timeslice.common.server.keys import Keys, prefix_range_end
    from timeslice.common.server.serving import etcd_password

    keys = Keys(prefix)
    cfg = EtcdConfig.parse(endpoints, timeout=timeout, ca_file=os.environ.get(D.ENV_ETCD_CA),
                           cert_file=os.environ.get(D.ENV_ETCD_CERT), key_file=os.environ.get(D.ENV_ETCD_KEY),
                           username=os.environ.get(D.ENV_ETCD_USER), password=etcd_password())
    client = EtcdClient(cfg)
    await client.connect()
    try:
        kvs, revision = [], 0
        for base in (keys.history(), keys.groups()):
            start, end = base, prefix_range_end(base)
            while True:
                req = ops.range_req(start, limit=PAGE, revision=revision)
                req.range_end = end
                resp = await client.range(req)
                revision = revision or resp.header.revision
                kvs += resp.kvs
                if not resp.more or not resp.kvs:
                    break
                start = resp.kvs[-1].key + b"\0"
    finally:
        await client.close()
    records: list[R.HoldRecord] = []
    specs: dict[str, R.GroupSpec] = {}
    grants: dict[str, list[R.GrantValue]] = {}        # group -> every holder's grant (fit groups: several)
    queues: dict[str, list[tuple[int, R.QueueValue]]] = {}
    for kv in kvs:
        parts = keys.parse(kv.key)
        try:
            if parts[0] == "history" and len(parts) == 3:
                records.append(R.HoldRecord.load(kv.value))
            elif parts[0] == "groups" and len(parts) == 3 and parts[2] == "spec":
                specs[parts[1]] = R.GroupSpec.load(kv.value)
            elif keys.grant_of(kv.key) is not None:
                grants.setdefault(parts[1], []).append(R.GrantValue.load(kv.value))
            elif parts[0] == "groups" and len(parts) == 4 and parts[2] == "queue":
                queues.setdefault(parts[1], []).append((kv.create_revision, R.QueueValue.load(kv.value)))
        except (ValueError, TypeError):
            continue                        # a value written by a newer or broken writer: left out
    ordered = {g: [v for _, v in sorted(q, key=lambda e: e[0])] for g, q in queues.items()}
    return records, specs, grants, ordered


def cmd_report(args: argparse.Namespace) -> int:
    from timeslice.lockd.report import page as rpt
    try:
        import aetcd  # noqa: F401 - the server extra
    except ModuleNotFoundError:
        print("timeslice report: reading etcd needs the server extra (pip install 'timeslice[server]')",
              file=sys.stderr)
        return 2
    endpoints, prefix = _where(args)
    until = time.time()
    from timeslice.common.errors import TimesliceError
    try:
        records, specs, grants, queues = asyncio.run(read_state(endpoints, prefix, args.timeout))
    except (TimesliceError, OSError) as e:
        print(f"timeslice report: cannot read etcd at {endpoints}: {e}", file=sys.stderr)
        return 1
    rep = rpt.build(records, specs, grants, queues, since=until - args.since, until=until, prefix=prefix,
                    only=args.group)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(rpt.html(rep), encoding="utf-8")
    png = None
    if args.png and not rep.groups:
        print("timeslice report: no group to draw; no picture written", file=sys.stderr)
    elif args.png:
        try:
            from timeslice.lockd.report.timeline import draw
        except ModuleNotFoundError:
            print("timeslice report: --png needs matplotlib (the demo extra)", file=sys.stderr)
            return 2
        start = time.strftime("%H:%M:%S", time.localtime(rep.drawn_from))
        png = str(draw(rpt.timeline_runs(rep), args.png, title="timeslice report: who held each group when",
                       subtitle=f"from {start} (the first activity of the last {args.since:.0f} s) to "
                                f"{time.strftime('%H:%M:%S', time.localtime(rep.until))}, prefix {prefix}",
                       phases=(("hold", "held"),), xlabel=f"seconds since {start}"))
    summary = {"html": str(out), "png": png, "groups": len(rep.groups),
               "holds": sum(len(g.holds) for g in rep.groups), "since": rep.since, "until": rep.until}
    emit(args, summary, lambda: f"wrote {out} ({summary['groups']} groups, {summary['holds']} holds)"
         + (f" and {png}" if png else ""))
    return 0
