"""Worker registration: which processes of a job hold device memory on which node.

A worker key lives under the job and is attached to the job's session lease,
so a job that dies takes its worker records with it; the node agent reads
them to know which pids to snapshot and restore.
"""
from __future__ import annotations

from timeslice.common import records as R
from timeslice.common.errors import InvalidIdError
from timeslice.common.etcd import ops
from timeslice.common.etcd.client import EtcdClient
from timeslice.common.ids import check_id
from timeslice.common.keys import Keys
from timeslice.lockd.errors import LimitExceeded, NotOwner
from timeslice.lockd.index import StateIndex
from timeslice.lockd.ownership import Ownership
from timeslice.proto import lockd_pb2 as pb

MAX_PID = 2**22          # Linux pid_max upper bound
MAX_GPUS = 64            # GPU indexes per worker
MAX_TAGS = 32            # memory regions per cooperative worker
MAX_ENDPOINT = 512       # characters of an inference server's base URL
MAX_WORKERS_PER_JOB = 256   # registered processes of one job, all nodes together


class Workers:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, ownership: Ownership | None = None):
        self.client, self.keys, self.index = client, keys, index
        self.ownership = ownership or Ownership(client, keys)

    @staticmethod
    def _check(node: str, pid: int) -> None:
        check_id("node", node)
        if not 0 < pid <= MAX_PID:
            raise InvalidIdError(f"pid must be in 1..{MAX_PID}, got {pid}")

    @staticmethod
    def _swap(swap: str, gpus, endpoint: str, tags) -> tuple[str, list[int], dict]:
        """Validate how the agent is to move the worker; returns (swap, gpus, tags)."""
        swap = swap or R.SWAP_CHECKPOINT
        if swap not in R.SWAP_KINDS:
            raise InvalidIdError(f"swap must be one of {sorted(R.SWAP_KINDS)}, got {swap[:32]!r}")
        gpus = list(gpus)
        if len(gpus) > MAX_GPUS or any(not 0 <= g < 1024 for g in gpus):
            raise InvalidIdError(f"gpus: at most {MAX_GPUS} indexes in 0..1023")
        if len(endpoint) > MAX_ENDPOINT:
            raise InvalidIdError(f"endpoint longer than {MAX_ENDPOINT} characters")
        if swap in (R.SWAP_VLLM, R.SWAP_SGLANG) and not endpoint.startswith(("http://", "https://")):
            raise InvalidIdError(f"swap={swap} needs the server's http(s) base URL in endpoint")
        if len(tags) > MAX_TAGS:
            raise InvalidIdError(f"at most {MAX_TAGS} tags")
        out = {}
        for t in tags:
            check_id("tag", t.tag)
            if t.policy not in R.TAG_POLICIES:
                raise InvalidIdError(f"tag {t.tag!r}: policy must be one of {sorted(R.TAG_POLICIES)}")
            out[t.tag] = t.policy
        return swap, sorted(set(gpus)), out

    async def register(self, job: str, lease: int, node: str, pid: int, device_bytes: int,
                       swap: str = "", gpus=(), endpoint: str = "", tags=(), collective: bool = False) -> None:
        self._check(node, pid)
        if device_bytes < 0:
            raise InvalidIdError("device_bytes must be >= 0")
        swap, gpus, tagmap = self._swap(swap, gpus, endpoint, tags)
        claim = await self.ownership.claim(job, node, pid)
        squatters = self._check_owner(job, node, pid, claim.attested_by == job)
        val = R.WorkerValue(pid, node, device_bytes, R.now_ms(), swap=swap, gpus=gpus, endpoint=endpoint,
                            tags=tagmap, collective=collective)
        # Re-registering overwrites: a plain put is idempotent here. Another job's registration of a pid
        # that attested for this job is a squatter's: deleted with it (lockd/ownership.py, rule 3).
        await self.client.txn([], [ops.put(self.keys.worker(job, node, pid), val.dump(), lease),
                                   *(ops.delete(k) for k in squatters)])

    def _check_owner(self, job: str, node: str, pid: int, attested_mine: bool) -> list[bytes]:
        """Refuse a pid another job registered on that node (unless it attested for this job: then
        the other registrations' keys, to delete), and a job past its worker limit.

        The index mirrors every worker key; a pid two jobs claim would let one
        job's intents freeze or move the other's process. The other job is not
        named: which process belongs to whom is that job's business.
        """
        squatters = []
        for other, js in self.index.jobs.items():
            if other != job and (node, pid) in js.workers:
                if not attested_mine:
                    raise NotOwner(f"pid {pid} on node {node!r} is a registered worker of another job; "
                                   "a job registers only its own processes")
                squatters.append(self.keys.worker(other, node, pid))
        mine = self.index.jobs.get(job)
        if mine is not None and (node, pid) not in mine.workers and len(mine.workers) >= MAX_WORKERS_PER_JOB:
            raise LimitExceeded(f"limit max_workers_per_job: job {job!r} has {MAX_WORKERS_PER_JOB} registered "
                                "workers already; unregister some first")
        return squatters

    async def unregister(self, job: str, node: str, pid: int) -> None:
        self._check(node, pid)
        await self.client.txn([], [ops.delete(self.keys.worker(job, node, pid))])

    def job_list(self) -> list[pb.JobInfo]:
        out = []
        for job, js in sorted(self.index.jobs.items()):
            if js.session is None:
                continue
            lease = R.SessionValue.load(js.session.value).lease
            out.append(pb.JobInfo(job_id=job, lease_id=lease, groups=self.index.groups_of_job(job),
                                  workers=len(js.workers), tenant=R.SessionValue.load(js.session.value).tenant))
        return out
