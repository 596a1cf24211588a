"""Worker registration: which processes of a job hold device memory on which node.

A worker key lives under the job and is attached to the job's session lease,
so a job that dies takes its worker records with it; the node agent reads
them to know which pids to snapshot and restore. Each worker also holds one
of its job's ``max_workers_per_job`` slots (lockd/slots.py), written with it,
so parallel registrations on any number of replicas cannot go past the limit.
"""
from __future__ import annotations

import random

from timeslice.common.errors import EtcdUnavailable, InvalidIdError
from timeslice.common.ids import check_id
from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.client import EtcdClient
from timeslice.common.server.keys import Keys
from timeslice.lockd import slots as S
from timeslice.lockd.errors import LimitExceeded, NotOwner
from timeslice.lockd.index import StateIndex
from timeslice.lockd.ownership import Ownership
from timeslice.proto import lockd_pb2 as pb

MAX_PID = 2**22          # Linux pid_max upper bound
MAX_GPUS = 64            # GPU indexes per worker
MAX_TAGS = 32            # memory regions per cooperative worker
MAX_ENDPOINT = 512       # characters of an inference server's base URL
MAX_WORKERS_PER_JOB = 256   # registered processes of one job, all nodes together


class WorkerRegistry:
    def __init__(self, client: EtcdClient, keys: Keys, index: StateIndex, max_per_job: int = MAX_WORKERS_PER_JOB,
                 ownership: Ownership | None = None):
        self.client, self.keys, self.index = client, keys, index
        self.max_per_job = max_per_job
        self.ownership = ownership or Ownership(client, keys)
        self._rng = random.Random()

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
        for squatter in self._check_owner(job, node, pid, claim.attested_by == job):
            # Another job's registration of a pid that attested for this job is a squatter's: it goes
            # first, with its slot (lockd/ownership.py, rule 3), so the owner is never locked out.
            await self.unregister(squatter, node, pid)
        key, space = self.keys.worker(job, node, pid), S.worker_space(job)
        mine = self.index.jobs.get(job)
        kv = mine.workers.get((node, pid)) if mine is not None else None
        taken, fresh = set(self.index.slots_taken(space)), False
        for _ in range(S.MAX_TRIES):
            if kv is not None:
                # Re-registering overwrites and keeps the worker's slot (and so its place in the limit).
                slot = R.WorkerValue.load(kv.value).slot
                val = R.WorkerValue(pid, node, device_bytes, R.now_ms(), swap=swap, gpus=gpus, endpoint=endpoint,
                                    tags=tagmap, collective=collective, slot=slot)
                resp = await self.client.txn([ops.create_rev(key, "==", kv.create_revision)],
                                             [ops.put(key, val.dump(), lease)], [ops.get(key)])
            else:
                if len(taken) >= self.max_per_job and not fresh:
                    # The mirror may lag an unregistration on another replica: ask etcd before refusing.
                    taken, fresh = await S.taken_now(self.client, self.keys, space), True
                if len(taken) >= self.max_per_job:
                    raise LimitExceeded(f"limit max_workers_per_job: job {job!r} has {self.max_per_job} "
                                        "registered workers already; unregister some first")
                slot = S.pick(taken, self.max_per_job, self._rng)
                skey = self.keys.slot(space, slot)
                val = R.WorkerValue(pid, node, device_bytes, R.now_ms(), swap=swap, gpus=gpus, endpoint=endpoint,
                                    tags=tagmap, collective=collective, slot=slot)
                # The worker and its slot together, each only if absent: a slot a parallel call took
                # first means "pick another", so the job never holds more than its limit.
                resp = await self.client.txn(
                    [ops.create_rev(key, "==", 0), ops.create_rev(skey, "==", 0)],
                    [ops.put(key, val.dump(), lease), ops.put(skey, R.SlotValue(job, node, pid).dump(), lease)],
                    [ops.get(key), ops.get(skey)])
                if not resp.succeeded and resp.responses[1].response_range.kvs:
                    # A parallel call took it first, and our view (the mirror) may lag many such
                    # calls: read the space once, so the next pick is among slots free now (under
                    # load, picking from the lagging mirror ran out of tries: UNAVAILABLE).
                    taken, fresh = await S.taken_now(self.client, self.keys, space), True
            if resp.succeeded:
                return
            kvs = resp.responses[0].response_range.kvs
            kv = kvs[0] if kvs else None            # registered (or unregistered) meanwhile: judge again
        raise EtcdUnavailable(f"RegisterWorker of {job!r}: parallel registrations kept changing it; try again")

    def _check_owner(self, job: str, node: str, pid: int, attested_mine: bool = False) -> list[str]:
        """Refuse a pid another job registered on that node, unless the pid attested for this job:
        then the jobs whose registrations of it are to go.

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
                squatters.append(other)
        return squatters

    async def unregister(self, job: str, node: str, pid: int) -> None:
        self._check(node, pid)
        key = self.keys.worker(job, node, pid)
        for _ in range(S.MAX_TRIES):
            # Read fresh: the slot to free is the one this very registration holds.
            r = await self.client.range(ops.range_req(key))
            if not r.kvs:
                return                              # not registered (any more): nothing to do
            kv = r.kvs[0]
            slot = R.WorkerValue.load(kv.value).slot
            gone = [ops.delete(key)]
            if slot >= 0:
                gone.append(ops.delete(self.keys.slot(S.worker_space(job), slot)))
            # Guarded by the registration as read: one re-registered meanwhile is read again.
            resp = await self.client.txn([ops.mod_rev(key, "==", kv.mod_revision)], gone)
            if resp.succeeded:
                return
        raise EtcdUnavailable(f"UnregisterWorker of {job!r}: it kept being registered again meanwhile; try again")

    def job_list(self) -> list[pb.JobInfo]:
        out = []
        for job, js in sorted(self.index.jobs.items()):
            if js.session is None:
                continue
            lease = R.SessionValue.load(js.session.value).lease
            out.append(pb.JobInfo(job_id=job, lease_id=lease, groups=self.index.groups_of_job(job),
                                  workers=len(js.workers), tenant=R.SessionValue.load(js.session.value).tenant,
                                  holds=self._holds(job)))
        return out

    def _holds(self, job: str) -> list[pb.Hold]:
        """The groups ``job`` holds, with what each grant weighs (an exclusive group's: the whole device)."""
        out = []
        for g in sorted(self.index.job_grants.get(job, ())):
            gs = self.index.groups.get(g)
            kv = gs.grant_of(job) if gs is not None else None
            if kv is None:
                continue
            v = R.GrantValue.load(kv.value)
            out.append(pb.Hold(group_id=g, token=v.token, footprint_bytes=v.footprint,
                               exclusive=v.exclusive or not (gs is not None and gs.parsed is not None and gs.parsed.shared)))
        return out
