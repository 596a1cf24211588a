"""The etcd key layout: the only module that spells a key.

Every key lives below one prefix (default ``/timeslice/``). Values are JSON so
that ``etcdctl get --prefix /timeslice/`` is a readable picture of the system.
The README documents each key with an etcdctl example.

    <p>leader/<lease-hex>                       election candidates; lowest create_revision leads
    <p>groups/<group>/spec                      {nodes: [{node, gpus}], created_ms}
    <p>groups/<group>/queue/<job>               waiter or holder, leased to the job's session;
                                                FIFO = create_revision; head owns the lock;
                                                token = create_revision of this key
    <p>groups/<group>/grant                     {job, token, leader_epoch, restored, ...}, leased to the job:
                                                the holder of an ``exclusive`` group (GroupSpec.sharing)
    <p>groups/<group>/grants/<job>              the same plus {footprint, exclusive, backfilled}, one per
                                                holder of a ``fit`` group (lockd/weights.py), leased to it
    <p>groups/<group>/turns                     {token, grants}: priority groups only (lockd/priority.py): the
                                                highest token granted ahead of an earlier waiter (an entry
                                                below it re-keys before its turn) and the grant count
    <p>groups/<group>/moving/<job>              an overtaken waiter's entry while the leader writes it again
                                                under a fresh key (lockd/rekey.py), leased to the job's session
    <p>groups/<group>/failures/<job>            {token, reason}: why a job's Acquire failed, leased to the job
    <p>groups/<group>/attempts/<job>            {seq}: newest Acquire attempt that claimed the job's entry,
                                                leased to the job's session (lockd/attempts.py)
    <p>jobs/<job>/session                       {lease, secret_sha256, opened_ms}, leased
    <p>jobs/<job>/workers/<node>/<pid>          {pid, node, device_bytes}, leased to the job's session
    <p>jobs/<job>/revoked/<group>               {group, token, deleted_ms}: an admin deleted the group while
                                                the job was queued or held it; leased to the job's session,
                                                read (and removed) by the job's next Yield of that group
    <p>slots/<space>/<n>                        {job, ...}: one of the ``limit`` numbered places of a counted
                                                thing (a session, a session of one caller, a worker of one
                                                job), created with it, leased like it (lockd/slots.py)
    <p>nodes/<node>/agent                       agent liveness + capabilities, leased to the agent
    <p>nodes/<node>/intents/<job>               {op, token, leader_epoch, group}, written by the leader
    <p>nodes/<node>/status/<job>                {state, intent_revision, token, bytes, elapsed_ms, error}, by the agent
    <p>nodes/<node>/attested/<pid>              {job, pid, start_time}: the process proved it is the job's over
                                                the node-local channel; by the agent, leased to the agent
    <p>nodes/<node>/protected                   {pids: {pid: why}}: init, the agent, etcd, lockd on the node; by
                                                the agent, leased to the agent; lockd refuses to register them
    <p>history/<group>/<token, 20 digits>       one finished hold {job, granted_ms, released_ms, swaps...},
                                                by the leader; bounded (lockd/history.py), durable
"""
from __future__ import annotations

from dataclasses import dataclass

from timeslice.common.defaults import KEY_PREFIX
from timeslice.common.ids import check_id


def prefix_range_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with ``prefix`` (etcd's convention)."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class Keys:
    """Builds and parses keys below one prefix. Ids are checked on the way in."""

    prefix: str = KEY_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or not self.prefix.endswith("/"):
            raise ValueError(f"key prefix must start and end with '/': {self.prefix!r}")

    def _k(self, *parts: str) -> bytes:
        return (self.prefix + "/".join(parts)).encode()

    # --- whole-system ranges -------------------------------------------------
    def root(self) -> bytes:
        return self.prefix.encode()

    # --- leader election -----------------------------------------------------
    def election(self, name: str = "leader") -> bytes:
        """Prefix under which candidates of one election put their keys."""
        return self._k(name) + b"/"

    def candidate(self, lease_id: int, name: str = "leader") -> bytes:
        return self.election(name) + f"{lease_id:x}".encode()

    # --- groups ---------------------------------------------------------------
    def groups(self) -> bytes:
        return self._k("groups") + b"/"

    def group(self, group: str) -> bytes:
        return self._k("groups", check_id("group", group)) + b"/"

    def spec(self, group: str) -> bytes:
        return self.group(group) + b"spec"

    def queue(self, group: str) -> bytes:
        return self.group(group) + b"queue/"

    def queue_entry(self, group: str, job: str) -> bytes:
        return self.queue(group) + check_id("job", job).encode()

    def grant(self, group: str) -> bytes:
        """The one holder's grant of an exclusive group."""
        return self.group(group) + b"grant"

    def grants(self, group: str) -> bytes:
        """Prefix of a fit group's grants, one per holder (etcdctl: every holder of the group)."""
        return self.group(group) + b"grants/"

    def shared_grant(self, group: str, job: str) -> bytes:
        return self.grants(group) + check_id("job", job).encode()

    def grant_key(self, group: str, job: str, shared: bool) -> bytes:
        """Where ``job``'s grant of ``group`` lives: ``grants/<job>`` in a fit group, else ``grant``."""
        return self.shared_grant(group, job) if shared else self.grant(group)

    def turns(self, group: str) -> bytes:
        return self.group(group) + b"turns"

    def movings(self, group: str) -> bytes:
        return self.group(group) + b"moving/"

    def moving(self, group: str, job: str) -> bytes:
        return self.movings(group) + check_id("job", job).encode()

    def attempt(self, group: str, job: str) -> bytes:
        return self.group(group) + b"attempts/" + check_id("job", job).encode()

    def failures(self, group: str) -> bytes:
        return self.group(group) + b"failures/"

    def failure(self, group: str, job: str) -> bytes:
        return self.failures(group) + check_id("job", job).encode()

    # --- jobs -----------------------------------------------------------------
    def jobs(self) -> bytes:
        return self._k("jobs") + b"/"

    def job(self, job: str) -> bytes:
        return self._k("jobs", check_id("job", job)) + b"/"

    def session(self, job: str) -> bytes:
        return self.job(job) + b"session"

    def workers(self, job: str) -> bytes:
        return self.job(job) + b"workers/"

    def node_workers(self, job: str, node: str) -> bytes:
        """Prefix of ``job``'s worker registrations on ``node``."""
        return self.workers(job) + f"{check_id('node', node)}/".encode()

    def worker(self, job: str, node: str, pid: int) -> bytes:
        if not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid must be a positive integer, got {pid!r}")
        return self.node_workers(job, node) + str(pid).encode()

    def closed(self, job: str) -> bytes:
        """Marker written by CloseSession just before it revokes the job's lease (leased for a minute):
        tells node agents the registrations went deliberately, so they freeze nothing."""
        return self.job(job) + b"closed"

    def revocations(self, job: str) -> bytes:
        return self.job(job) + b"revoked/"

    def revoked(self, job: str, group: str) -> bytes:
        return self.revocations(job) + check_id("group", group).encode()

    # --- count limits (lockd/slots.py) ---------------------------------------------
    def slots(self, space: str) -> bytes:
        """Prefix of one limit's slots; ``space`` is ``sessions``, ``peers/<digest>`` or ``workers/<job>``."""
        return self._k("slots", space) + b"/"

    def slot(self, space: str, n: int) -> bytes:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"slot must be a non-negative integer, got {n!r}")
        return self.slots(space) + str(n).encode()

    # --- nodes ----------------------------------------------------------------
    def nodes(self) -> bytes:
        return self._k("nodes") + b"/"

    def node(self, node: str) -> bytes:
        return self._k("nodes", check_id("node", node)) + b"/"

    def agent(self, node: str) -> bytes:
        return self.node(node) + b"agent"

    def intents(self, node: str) -> bytes:
        return self.node(node) + b"intents/"

    def intent(self, node: str, job: str) -> bytes:
        return self.intents(node) + check_id("job", job).encode()

    def statuses(self, node: str) -> bytes:
        return self.node(node) + b"status/"

    def status(self, node: str, job: str) -> bytes:
        return self.statuses(node) + check_id("job", job).encode()

    def attestations(self, node: str) -> bytes:
        return self.node(node) + b"attested/"

    def attested(self, node: str, pid: int) -> bytes:
        return self.attestations(node) + str(int(pid)).encode()

    def protected(self, node: str) -> bytes:
        return self.node(node) + b"protected"

    # --- history of finished holds (lockd/history.py) ---------------------------
    def history(self) -> bytes:
        return self._k("history", "")

    def history_group(self, group: str) -> bytes:
        return self.history() + check_id("group", group).encode() + b"/"

    def history_entry(self, group: str, token: int) -> bytes:
        # Zero-padded: etcd orders keys as bytes, so a group's records sort by token (= time).
        return self.history_group(group) + f"{int(token):020d}".encode()

    # --- parsing --------------------------------------------------------------
    def parse(self, key: bytes) -> tuple[str, ...]:
        """Split a key below the prefix into its segments (no validation)."""
        s = key.decode()
        if not s.startswith(self.prefix):
            raise ValueError(f"key {s!r} is not below prefix {self.prefix!r}")
        return tuple(s[len(self.prefix):].split("/"))

    def _parts(self, key: bytes) -> tuple[str, ...]:
        try:
            return self.parse(key)
        except ValueError:                   # not below the prefix, or not UTF-8
            return ()

    def intent_job(self, key: bytes, node: str) -> str | None:
        """The job an intent key of ``node`` is for (``nodes/<node>/intents/<job>``), else None."""
        p = self._parts(key)
        return p[3] if len(p) == 4 and p[0] == "nodes" and p[1] == node and p[2] == "intents" else None

    def status_job(self, key: bytes, node: str) -> str | None:
        """The job a status key of ``node`` is for (``nodes/<node>/status/<job>``), else None."""
        p = self._parts(key)
        return p[3] if len(p) == 4 and p[0] == "nodes" and p[1] == node and p[2] == "status" else None

    def grant_of(self, key: bytes) -> tuple[str, str] | None:
        """(group, job) of a grant key: ``groups/<g>/grants/<job>``, or ``groups/<g>/grant`` with job ""
        (an exclusive group's: the job is in its value); else None."""
        p = self._parts(key)
        if len(p) == 3 and p[0] == "groups" and p[2] == "grant":
            return p[1], ""
        if len(p) == 4 and p[0] == "groups" and p[2] == "grants" and p[3]:
            return p[1], p[3]
        return None

    def is_status(self, key: bytes) -> bool:
        """True for a status key of any node (``nodes/<node>/status/<job>``)."""
        p = self._parts(key)
        return len(p) == 4 and p[0] == "nodes" and p[2] == "status"

    def worker_of(self, key: bytes, node: str) -> tuple[str, int] | None:
        """(job, pid) of a worker registration on ``node`` (``jobs/<job>/workers/<node>/<pid>``), else None."""
        p = self._parts(key)
        if len(p) == 5 and p[0] == "jobs" and p[2] == "workers" and p[3] == node and p[4].isdigit():
            return p[1], int(p[4])
        return None
