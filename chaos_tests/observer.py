"""Writes down what the server granted and where jobs were parked, for the checker's ghost
(claims.py) and cross-group (crossgroup.py) rules.

A thread of the test process runs one resumable etcd watch (``timeslice.common.server.etcd``'s ``Watch``)
on the whole prefix, so its events come in etcd's revision order, and records:

    grant_put   group, job, token, rev   a group's grant was written (or rewritten); a fit group's
                                      holders each have their own (``grants/<job>``); rev: etcd's
                                      revision of the write
    grant_end   group, job, token, rev   it was deleted (yield, lease expiry, ...)
    group_spec  group, nodes          a group's spec was written
    parked      job, node, gpus, state   the agent's status of the job entered a parked state
                                      (gpus: indexes, from the agent key's device list)
    unparked    job, node             ... and left it (or was deleted)
    session_put job, lease            the job's session key was written (a session opened)
    session_end job, lease            ... and deleted (closed, or its lease ran out), or replaced by
                                      the job's next session (``replaced``)
    enqueued    group, job, token     with ``enqueued=True``: a job's queue entry was created (not a
                                      priority group's entry moved under a fresh key: its value
                                      keeps ``since``), for the checker's priority rules (its time
                                      is after etcd's, so they judge no stricter than the truth)

The test reads what is true now from ``states`` ((node, job) -> the agent's status state)
and ``sessions`` (jobs with a session key), e.g. to inject a fault while a job is restoring.

Times are when the watch delivered the event, a few ms after etcd applied it, but seconds
after it when the watch had to re-open (its member lost the leader, the majority was down):
the checker's bounds are seconds, and where order matters it also reads ``rev``. The watch starts from the
revision read at start-up, so nothing between start-up and the first event is missed.
"""
from __future__ import annotations

import asyncio
import json
import threading

from chaos_tests.crossgroup import PARKED
from chaos_tests.history import HistoryRecorder
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, Watch, ops


class GrantObserver:
    def __init__(self, endpoints: str, prefix: str, history_dir: str, enqueued: bool = False):
        self.endpoints, self.prefix, self.enqueued = endpoints, prefix, enqueued
        self.rec = HistoryRecorder(history_dir, name="observer")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="grant-observer")
        self._gpus: dict[str, dict[str, int]] = {}       # node -> device id -> GPU index (agent key)
        self._parked: set[tuple[str, str]] = set()       # (node, job) parked now
        self.states: dict[tuple[str, str], str] = {}     # (node, job) -> status state now
        self.sessions: set[str] = set()                  # jobs with a session key now
        self._leases: dict[str, int] = {}                # job -> the lease of its session key now

    def start(self) -> GrantObserver:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("grant observer did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)
        self.rec.close()

    def orphans(self) -> list[tuple[str, str]]:
        """(node, job) parked now whose job has no session key: what the checker's
        ``[parked-orphan]`` rule judges, for a scenario that waits for the agents to settle."""
        sessions = set(self.sessions)
        return sorted(k for k in set(self._parked) if k[1] not in sessions)

    def in_state(self, states: set[str], jobs: set[str] | None = None) -> list[tuple[str, str]]:
        """(node, job) whose agent status is in one of ``states`` now (of ``jobs``, if given)."""
        return sorted(k for k, s in dict(self.states).items() if s in states and (jobs is None or k[1] in jobs))

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        client = EtcdClient(EtcdConfig.parse(self.endpoints, timeout=5))
        root = self.prefix.encode()
        try:
            r = await client.range(ops.range_req(root, prefix=True))
            for kv in r.kvs:
                self._note(kv.key, kv.value, True, rev=kv.mod_revision)
            self._ready.set()
            async with Watch(client, root, prefix=True, start_revision=r.header.revision + 1,
                             prev_kv=True) as w:
                async for batch in w:
                    for ev in batch:
                        raw = ev.kv.value if ev.is_put else (ev.prev_kv.value if ev.prev_kv else b"")
                        self._note(ev.kv.key, raw, ev.is_put,
                                   ev.kv.create_revision if ev.is_put and ev.kv.version == 1 else 0,
                                   rev=ev.revision)
        except asyncio.CancelledError:
            pass
        finally:
            self._ready.set()
            await client.close()

    def _note(self, key: bytes, raw: bytes, put: bool, created: int = 0, rev: int = 0) -> None:
        """``created``: the key's create revision when this put created it, else 0; ``rev``: the
        event's revision (for a put, the key's mod revision)."""
        parts = key.decode(errors="replace")[len(self.prefix):].split("/")
        try:
            v = json.loads(raw) if raw else {}
        except ValueError:
            v = {}
        if self.enqueued and len(parts) == 4 and parts[0] == "groups" and parts[2] == "queue" and created \
                and not v.get("since"):
            self.rec.record("enqueued", group=parts[1], job=parts[3], token=created)
        elif (len(parts) == 3 and parts[0] == "groups" and parts[2] == "grant") or \
                (len(parts) == 4 and parts[0] == "groups" and parts[2] == "grants"):
            self.rec.record("grant_put" if put else "grant_end", group=parts[1], job=v.get("job"),
                            token=v.get("token"), rev=rev or None)
        elif len(parts) == 3 and parts[0] == "groups" and parts[2] == "spec" and put:
            self.rec.record("group_spec", group=parts[1], job=None, nodes=v.get("nodes", []))
        elif len(parts) == 3 and parts[0] == "nodes" and parts[2] == "agent" and put:
            self._gpus[parts[1]] = {str(g.get("uuid")): g.get("index") for g in v.get("gpus", [])}
        elif len(parts) == 3 and parts[0] == "jobs" and parts[2] == "session":
            job, lease = parts[1], v.get("lease")
            old = self._leases.get(job)
            if put and old != lease:
                if old is not None:                 # the job's next session replaced the key: that one's word ends
                    self.rec.record("session_end", job=job, lease=old, replaced=True)
                self._leases[job] = lease
                self.sessions.add(job)
                self.rec.record("session_put", job=job, lease=lease)
            elif not put:
                self._leases.pop(job, None)
                self.sessions.discard(job)
                self.rec.record("session_end", job=job, lease=lease)
        elif len(parts) == 4 and parts[0] == "nodes" and parts[2] == "status":
            node, job = parts[1], parts[3]
            if put:
                self.states[(node, job)] = str(v.get("state"))
            else:
                self.states.pop((node, job), None)
            parked = put and v.get("state") in PARKED
            if parked:
                index = self._gpus.get(node, {})
                gpus = [index.get(str(d)) for d in (v.get("gpu_bytes") or {})]
                self.rec.record("parked", job=job, node=node, state=v.get("state"),
                                gpus=[] if None in gpus else sorted(gpus))
                self._parked.add((node, job))
            elif (node, job) in self._parked:
                self._parked.discard((node, job))
                self.rec.record("unparked", job=job, node=node)
