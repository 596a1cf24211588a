"""Slurm: which groups a partition's GPU layout makes, and what a job's tasks are told.

Sans-IO: the functions here read text Slurm printed and environments given to
them, and return what to do; ``timeslice slurm ...`` (``cli_slurm.py``) runs
``sinfo``, talks to lockd and prints.

* Groups come from the nodes' GPUs as ``sinfo`` reports them (``%G``, e.g.
  ``gpu:h200:8(S:0-1),shard:h200:64(S:0-1)``): one group per node over all its
  GPUs (``per="node"``, named after the node), or one per GPU (``per="gpu"``,
  ``<node>-gpu<k>``), optionally prefixed. Every job that shares a GPU must use
  the same group: a group is the unit of mutual exclusion.
* A task's environment (the TaskProlog's ``export`` lines): the lockd target and
  the agent's socket from the site's settings file, the node name from
  ``SLURMD_NODENAME`` (the agent of that node is named so), and the group:
  the job's own ``TIMESLICE_GROUP`` if it set one (``sbatch
  --export=ALL,TIMESLICE_GROUP=...``), else the group of its node (per GPU: of the
  one GPU it was given). The job id needs nothing: the client takes
  ``SLURM_JOB_ID`` itself (``timeslice/config.py``).
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from timeslice.common import defaults as D
from timeslice.common.ids import check_id
from timeslice.model import NodeSpec

PER_NODE, PER_GPU = "node", "gpu"
SCHEMES = (PER_NODE, PER_GPU)

#: The site settings a task prolog reads (KEY=VALUE lines; ``timeslice slurm task-env --env-file``).
ENV_FILE = "/etc/timeslice/jobs.env"
KEY_SCHEME = "TIMESLICE_SLURM_GROUPS"          # node | gpu
KEY_PREFIX = "TIMESLICE_SLURM_GROUP_PREFIX"    # prepended to every group name ("" by default)
ENV_GROUP = "TIMESLICE_GROUP"                  # the job's group: a job option, else derived
#: What the site's file may hand to every task, verbatim (the site's value wins over the job's:
#: sbatch exports the submitter's environment, which must not point a job at another cluster).
SITE_KEYS = (D.ENV_TARGET, D.ENV_AGENT_SOCKET)
SINFO_FORMAT = "%N|%G|%b"                      # node, generic resources, active features
MAX_SETTINGS_BYTES = 64 << 10


class SlurmError(ValueError):
    """Slurm's output or the site's settings could not be understood (the message says where)."""


@dataclass(frozen=True)
class SlurmNode:
    name: str
    gpus: int
    features: frozenset[str] = field(default_factory=frozenset)


def gpu_count(gres: str) -> int:
    """GPUs in a ``%G`` / ``Gres=`` string: the sum over its ``gpu[:type]:count`` entries."""
    text = re.sub(r"\([^)]*\)", "", gres or "")       # socket bindings "(S:0-1)" may hold commas
    total = 0
    for item in text.split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 else "1"
        if not count.isdigit():                         # "gpu:h200" (a type, no count) is one GPU
            count = "1"
        total += int(count)
    return total


def parse_sinfo(text: str) -> list[SlurmNode]:
    """Nodes from ``sinfo --noheader --Node --format='%N|%G|%b'`` (a node listed once per partition)."""
    seen: dict[str, SlurmNode] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.strip().split("|")
        if len(parts) != 3:
            raise SlurmError(f"sinfo line {n}: expected NODE|GRES|FEATURES, got {line[:200]!r}")
        name, gres, feats = (p.strip() for p in parts)
        features = frozenset(f for f in feats.split(",") if f and f != "(null)")
        seen.setdefault(name, SlurmNode(name, gpu_count(gres), features))
    return list(seen.values())


def group_name(node: str, gpu: int | None = None, prefix: str = "") -> str:
    """The group of a node (``<prefix><node>``) or of one of its GPUs (``<prefix><node>-gpu<k>``)."""
    name = f"{prefix}{node}" + ("" if gpu is None else f"-gpu{gpu}")
    return check_id("group", name)


def plan_groups(nodes: Iterable[SlurmNode], per: str = PER_NODE, prefix: str = "",
                feature: str | None = None) -> list[tuple[str, NodeSpec]]:
    """(group, its node spec) for every node with a GPU (and ``feature``, when given)."""
    if per not in SCHEMES:
        raise SlurmError(f"groups per {per!r}: expected one of {', '.join(SCHEMES)}")
    out: list[tuple[str, NodeSpec]] = []
    for node in sorted(nodes, key=lambda n: n.name):
        if node.gpus <= 0 or (feature and feature not in node.features):
            continue
        check_id("node", node.name)
        if per == PER_NODE:
            out.append((group_name(node.name, prefix=prefix), NodeSpec(node.name)))
        else:
            out += [(group_name(node.name, k, prefix), NodeSpec(node.name, (k,))) for k in range(node.gpus)]
    return out


def read_settings(text: str, where: str = ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines (``#`` comments, optional ``export``, shell quoting), as systemd's EnvironmentFile."""
    if len(text) > MAX_SETTINGS_BYTES:
        raise SlurmError(f"{where}: larger than {MAX_SETTINGS_BYTES} bytes")
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise SlurmError(f"{where}:{n}: expected KEY=VALUE, got {raw[:200]!r}")
        try:
            words = shlex.split(value, comments=True)
        except ValueError as e:
            raise SlurmError(f"{where}:{n}: {e}") from None
        out[key.strip()] = " ".join(words)
    return out


def visible_gpus(env: Mapping[str, str]) -> list[int]:
    """The GPU indices Slurm gave the job on this node (``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES``)."""
    for var in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        raw = env.get(var, "").strip()
        if raw and all(p.strip().isdigit() for p in raw.split(",")):
            return [int(p) for p in raw.split(",")]
    return []


def task_env(env: Mapping[str, str], settings: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """(variables to export into the task, warnings) for a task whose environment is ``env``."""
    out: dict[str, str] = {k: settings[k] for k in SITE_KEYS if settings.get(k)}
    warnings: list[str] = []
    node = env.get("SLURMD_NODENAME", "").strip()
    if node:
        out[D.ENV_NODE_NAME] = check_id("node", node)
    own = env.get(ENV_GROUP, "").strip()
    if own:
        out[ENV_GROUP] = check_id("group", own)          # the job's option, kept as it said
        return out, warnings
    if not node:
        return out, ["SLURMD_NODENAME is not set: no group derived (not inside a Slurm task?)"]
    per = settings.get(KEY_SCHEME, PER_NODE) or PER_NODE
    if per not in SCHEMES:
        raise SlurmError(f"{KEY_SCHEME}={per!r}: expected one of {', '.join(SCHEMES)}")
    prefix = settings.get(KEY_PREFIX, "")
    if per == PER_NODE:
        out[ENV_GROUP] = group_name(node, prefix=prefix)
        return out, warnings
    gpus = visible_gpus(env)
    if len(gpus) == 1:
        out[ENV_GROUP] = group_name(node, gpus[0], prefix)
    else:
        warnings.append(f"groups are per GPU but this job has {len(gpus) or 'no'} GPU indices "
                        f"({', '.join(map(str, gpus)) or 'none visible'}): set {ENV_GROUP} yourself")
    return out, warnings


def export_lines(variables: Mapping[str, str]) -> list[str]:
    """What a TaskProlog prints: ``export NAME=value`` (Slurm takes the value up to the line's end)."""
    lines = []
    for k, v in sorted(variables.items()):
        if "\n" in v or "\r" in v:
            raise SlurmError(f"{k}: a value with a line break cannot be exported by a task prolog")
        lines.append(f"export {k}={v}")
    return lines
