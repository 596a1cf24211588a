"""The jobs of this node as etcd shows them: intents, statuses, registered workers.

Read from the agent's two mirrors, never from etcd directly (the op path
reads registrations fresh; see ``JobProcesses.pids``). A job's pids here come from
three places:

* registered: ``jobs/<job>/workers/<node>/<pid>``, leased to the job's
  session (they vanish when the job dies);
* adopted: pids named in a direct gRPC call, for services that never register;
* remembered: the pids in the agent's own last status of the job, which
  outlive a registration that lapsed while the job was snapshotted, so a
  snapshotted job is never forgotten (``picture.take`` counts them only while
  they hold something in flight).
"""
from __future__ import annotations

from aetcd import rpc

from timeslice.common.server import records as R
from timeslice.common.server.etcd.mirror import Reflector
from timeslice.common.server.keys import Keys


def load_status(raw: bytes) -> R.StatusValue | None:
    """A status value, or None if the key holds something else (never crash on a bad key)."""
    try:
        return R.StatusValue.load(raw)
    except Exception:
        return None


class LocalJobs:
    def __init__(self, keys: Keys, node: str, node_mirror: Reflector, jobs_mirror: Reflector):
        self.keys, self.node = keys, node
        self.node_mirror, self.jobs_mirror = node_mirror, jobs_mirror
        self.adopted: dict[str, set[int]] = {}
        # This node's registrations, kept by the jobs mirror's listener on the event loop. The
        # backends read them from worker threads (the fence and refresh passes look up every pid),
        # so the map they read is published whole with the revision it is at and never changed
        # after: a thread that walked the mirror itself raced the loop applying a registration
        # flood ("dictionary changed size during iteration"), and re-walked it once per pid.
        self._regs: dict[int, dict[str, rpc.KeyValue]] = {}          # pid -> job -> key-value (loop only)
        self._published: tuple[int, dict[int, tuple[str, R.WorkerValue]]] = (0, {})
        jobs_mirror.add_listener(self._on_jobs_batch)

    # --- keys (spelled and parsed by timeslice.common.server.keys) ------------------------------
    def intent_job(self, key: bytes) -> str | None:
        return self.keys.intent_job(key, self.node)

    def _status_job(self, key: bytes) -> str | None:
        return self.keys.status_job(key, self.node)

    def local_worker(self, key: bytes) -> tuple[str, int] | None:
        """(job, pid) if ``key`` registers a worker on this node."""
        return self.keys.worker_of(key, self.node)

    def is_local_worker(self, key: bytes) -> bool:
        return self.local_worker(key) is not None

    # --- intents and statuses --------------------------------------------------------
    def intent_jobs(self) -> list[str]:
        jobs = (self.intent_job(k) for k, _ in self.node_mirror.items(self.keys.intents(self.node)))
        return sorted(j for j in jobs if j)

    async def seen(self, revision: int, timeout: float) -> None:
        """Return once the node mirror has applied ``revision`` (asyncio.TimeoutError past ``timeout``)."""
        await self.node_mirror.wait_revision(revision, timeout=timeout)

    def intent_kv(self, job: str) -> rpc.KeyValue | None:
        return self.node_mirror.get(self.keys.intent(self.node, job))

    def status_kv(self, job: str) -> rpc.KeyValue | None:
        return self.node_mirror.get(self.keys.status(self.node, job))

    def status(self, job: str) -> R.StatusValue | None:
        kv = self.status_kv(job)
        return load_status(kv.value) if kv else None

    def statuses(self) -> list[R.StatusValue]:
        found = (load_status(kv.value) for _, kv in self.node_mirror.items(self.keys.statuses(self.node)))
        return [st for st in found if st is not None]

    # --- pids -------------------------------------------------------------------------
    def adopt(self, job: str, pids: list[int]) -> None:
        self.adopted.setdefault(job, set()).update(pids)

    def prune_adopted(self, gone: dict[str, set[int]]) -> None:
        """Drop adopted pids that have exited (``gone``: job -> pids seen gone)."""
        for job, pids in gone.items():
            left = self.adopted.get(job, set()) - pids
            if left:
                self.adopted[job] = left
            else:
                self.adopted.pop(job, None)

    def local_workers(self) -> dict[int, tuple[str, R.WorkerValue]]:
        """pid -> (job, registration) of every worker registered on this node, as of
        ``workers_revision``. A snapshot: never changed once returned (safe from any thread)."""
        return self._published[1]

    @property
    def workers_revision(self) -> int:
        """The jobs mirror's revision ``local_workers`` is at."""
        return self._published[0]

    def _on_jobs_batch(self, events, reset: bool) -> None:
        if reset:
            self._regs = {}
            for key, kv in self.jobs_mirror.items(self.keys.jobs()):
                hit = self.local_worker(key)
                if hit:
                    self._regs.setdefault(hit[1], {})[hit[0]] = kv
            self._publish(set(self._regs), replace=True)
            return
        changed = set()
        for ev in events:
            hit = self.local_worker(ev.kv.key)
            if hit is None:
                continue
            job, pid = hit
            changed.add(pid)
            if ev.is_put:
                self._regs.setdefault(pid, {})[job] = ev.kv
            elif pid in self._regs:
                self._regs[pid].pop(job, None)
                if not self._regs[pid]:
                    del self._regs[pid]
        if changed:
            self._publish(changed)
        elif self._published[0] != self.jobs_mirror.revision:
            self._published = (self.jobs_mirror.revision, self._published[1])

    def _publish(self, pids: set[int], replace: bool = False) -> None:
        """A new map (copy on write) with ``pids`` looked at again."""
        out = {} if replace else dict(self._published[1])
        for pid in pids:
            out.pop(pid, None)
            # Two jobs naming one pid: the newer registration speaks for it.
            for job, kv in sorted(self._regs.get(pid, {}).items(), key=lambda jk: jk[1].mod_revision):
                try:
                    out[pid] = (job, R.WorkerValue.load(kv.value))
                except Exception:  # a malformed registration names no process
                    continue
        self._published = (self.jobs_mirror.revision, out)

    def session_digest(self, job: str) -> str | None:
        """The SHA-256 of the job's session secret (lockd stores only that), if the job has a session."""
        kv = self.jobs_mirror.get(self.keys.session(job))
        if kv is None:
            return None
        try:
            return R.SessionValue.load(kv.value).secret_sha256
        except Exception:
            return None

    def remembered(self, job: str) -> set[int]:
        st = self.status(job)
        return set(st.pids) if st else set()

    def local(self) -> dict[str, tuple[list[int], list[int]]]:
        """job -> (registered or adopted pids, remembered-only pids), for every job known here."""
        reg: dict[str, set[int]] = {j: set(p) for j, p in self.adopted.items()}
        for pid, by_job in list(self._regs.items()):
            for j in by_job:
                reg.setdefault(j, set()).add(pid)
        rem: dict[str, set[int]] = {}
        for key, kv in self.node_mirror.items(self.keys.statuses(self.node)):
            job, st = self._status_job(key), load_status(kv.value)
            if job:
                rem[job] = set(st.pids) if st else set()
        return {j: (sorted(reg.get(j, ())), sorted(rem.get(j, set()) - reg.get(j, set())))
                for j in sorted(set(reg) | set(rem))}
