"""``timeslice slurm``: groups from a partition's GPU layout, and the task prolog's environment.

    timeslice slurm groups --partition gpu            # one group per node of the partition with GPUs
    timeslice slurm groups --per gpu --dry-run        # one per GPU; print, create nothing
    timeslice slurm task-env                          # in a Slurm TaskProlog: `export NAME=value` lines

Both read the site's settings (``--env-file``, default /etc/timeslice/jobs.env:
TIMESLICE_TARGET, TIMESLICE_AGENT_SOCKET, TIMESLICE_SLURM_GROUPS=node|gpu,
TIMESLICE_SLURM_GROUP_PREFIX), so the groups an admin creates and the group a
job is told are named by one rule (``timeslice/slurm.py``). deploy/slurm/
has the task prolog, the systemd units and a researcher's sbatch script.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from timeslice import slurm
from timeslice.cli import admin_client
from timeslice.common.cliout import emit
from timeslice.common.errors import InvalidIdError
from timeslice.errors import TimesliceClientError

ENV_SETTINGS_FILE = "TIMESLICE_SLURM_JOBS_ENV"     # another settings file (tests, a second cluster)
SINFO_TIMEOUT_S = 30.0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("slurm", help="Slurm: groups from a partition's GPUs, a task prolog's environment",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ssub = p.add_subparsers(dest="slurm_command", metavar="ACTION", required=True)
    env_help = f"site settings, KEY=VALUE lines (default: ${ENV_SETTINGS_FILE}, else {slurm.ENV_FILE})"

    g = ssub.add_parser("groups", parents=[common], help="create a group per node (or GPU) of a partition")
    g.add_argument("--partition", action="append", default=[], metavar="NAME",
                   help="only the nodes of this partition; repeat for more (default: every partition)")
    g.add_argument("--feature", default=None, metavar="NAME", help="only nodes with this active feature")
    g.add_argument("--per", choices=slurm.SCHEMES, default=None,
                   help=f"one group per node or per GPU (default: {slurm.KEY_SCHEME} of the settings, else node)")
    g.add_argument("--sinfo", default="sinfo", metavar="PATH", help="the sinfo command (default: sinfo on PATH)")
    g.add_argument("--dry-run", action="store_true", help="print the groups, create nothing")
    g.add_argument("--env-file", default=None, help=env_help)
    g.add_argument("--sharing", choices=("exclusive", "fit"), default="exclusive",
                   help="the groups' sharing policy (timeslice group create --sharing; default exclusive)")
    g.set_defaults(func=cmd_groups)

    t = ssub.add_parser("task-env", parents=[common],
                        help="print `export NAME=value` lines for a Slurm TaskProlog (target, socket, node, group)")
    t.add_argument("--env-file", default=None, help=env_help)
    t.set_defaults(func=cmd_task_env)


def _settings(args: argparse.Namespace) -> dict[str, str]:
    explicit = args.env_file or os.environ.get(ENV_SETTINGS_FILE)
    path = Path(explicit or slurm.ENV_FILE)
    if not path.is_file():
        if explicit:
            raise slurm.SlurmError(f"settings file {path} not found")
        return {}                                  # no site file: the defaults
    return slurm.read_settings(path.read_text(errors="replace"), str(path))


def _sinfo(args: argparse.Namespace) -> str:
    argv = [args.sinfo, "--noheader", "--Node", f"--format={slurm.SINFO_FORMAT}"]
    if args.partition:
        argv.append("--partition=" + ",".join(args.partition))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SINFO_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise slurm.SlurmError(f"{' '.join(argv)}: {e}") from None
    if done.returncode != 0:
        raise slurm.SlurmError(f"{' '.join(argv)} failed (rc={done.returncode}): {done.stderr.strip()[:500]}")
    return done.stdout


def cmd_groups(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
        per = args.per or settings.get(slurm.KEY_SCHEME) or slurm.PER_NODE
        nodes = slurm.parse_sinfo(_sinfo(args))
        planned = slurm.plan_groups(nodes, per, settings.get(slurm.KEY_PREFIX, ""), args.feature)
    except (slurm.SlurmError, InvalidIdError) as e:
        print(f"timeslice slurm groups: {e}", file=sys.stderr)
        return 2
    rows = [{"group": name, "node": spec.node, "gpus": list(spec.gpus), "result": "planned"}
            for name, spec in planned]
    failed = 0
    if not args.dry_run and planned:
        with admin_client(args) as c:
            existing = {g.group_id: g for g in c.groups()}
            for row, (name, spec) in zip(rows, planned):
                old = existing.get(name)
                if old is not None:
                    same = tuple(old.nodes) == (spec,)
                    row["result"] = "unchanged" if same else "differs"
                    failed += 0 if same else 1
                    continue
                try:
                    c.create_group(name, [spec], sharing=args.sharing)
                    row["result"] = "created"
                except TimesliceClientError as e:
                    row["result"], failed = f"failed: {e}", failed + 1
    text = [f"{r['group']:<32} {r['node']}{':' + ','.join(map(str, r['gpus'])) if r['gpus'] else ''}  {r['result']}"
            for r in rows] or [f"no node with a GPU{' and feature ' + args.feature if args.feature else ''} found"]
    if any(r["result"] == "differs" for r in rows):
        text.append("a group that differs was left as it is: delete it (timeslice group delete) to re-create it")
    emit(args, {"per": per, "groups": rows}, "\n".join(text))
    return 1 if failed else 0


def cmd_task_env(args: argparse.Namespace) -> int:
    # Slurm reads a TaskProlog's stdout: `export NAME=value` sets a variable in the task, and
    # `print TEXT` writes TEXT to the task's output, where the job's author sees it.
    try:
        variables, warnings = slurm.task_env(os.environ, _settings(args))
        lines = slurm.export_lines(variables)
    except (slurm.SlurmError, InvalidIdError) as e:
        print(f"print timeslice slurm task-env: error: {e}", flush=True)
        return 2
    if args.json:
        emit(args, {"export": variables, "warnings": warnings}, "")
        return 0
    lines += [f"print timeslice slurm task-env: warning: {w}" for w in warnings]
    print("\n".join(lines), flush=True)
    return 0
