"""Two checker rules about what the *server* did for a job, over the history.

They need events the clients cannot write themselves: ``grant_put`` / ``grant_end``
(group, job, token), recorded by ``observer.py`` from an etcd watch on the grant
keys, and ``session_lost`` (job, lease, lease_ttl_left), recorded by a library
chaos client when its ``on_session_lost`` fires, with what etcd said of the lease
at that moment (LeaseTimeToLive: seconds left, -1 when gone).

ghost         Every grant the server wrote is returned to a live caller (a
              ``granted`` event with the same group, job and token, of an acquire
              the job asked *before* the grant was written), or released (grant key
              deleted or replaced) within ``bound`` seconds. And no grant is written
              for a job whose last acquire had already returned: that grant was made
              for an attempt nobody waits for (a stale one, processed late), even if
              the job's next acquire happens to find it. Otherwise the group is held
              by a ghost, which blocks everyone else until the job's session ends.
              The observer's times are when its watch delivered an event, which after
              a watch re-opened (a member lost its leader, quorum came back) can be
              seconds late; so "written after the last acquire returned" is also
              judged by etcd's order where the observer recorded it (``rev``, the
              grant's mod revision): a grant whose revision is below the token (the
              entry's create revision) the last acquire returned was written before
              that acquire's entry existed, so before it returned, however late the
              watch told it.
session-loss  No job is told its session is lost while etcd still gives its lease
              more than ``SLACK_S`` to live. (A client that woke from a pause past
              its TTL may declare the loss a moment before etcd expires the lease:
              that is the slack; a false loss leaves most of a TTL.) And, judged by
              etcd's own view afterwards (the observer's ``session_put``/``session_end``
              with the lease): the session key of the lease a job was told it lost is
              gone by then, or within ``SLACK_S``. What asking etcd at that moment
              cannot show (etcd had no majority: nobody answered) this does: a lease
              etcd kept through an outage outlives the client's word, until the client
              ends it itself or it runs out a TTL after the outage.

Histories without those events (raw-gRPC chaos clients, no observer) are not judged
by these rules.
"""
from __future__ import annotations

#: Seconds of lease etcd may still report when a client rightly declares it lost.
SLACK_S = 1


def check_claims(events: list[dict], report, at, bound_s: float) -> None:
    """Append ``[ghost]`` and ``[session-loss]`` violations to ``report``; ``events`` sorted by t."""
    end_t = events[-1]["t"] if events else 0
    bound = int(bound_s * 1e9)
    # Each job's acquires per group: [req_t, outcome, token] (outcome None while open).
    asks: dict[tuple, list[list]] = {}
    for e in events:
        key = (e.get("group"), e.get("job"))
        if e["ev"] == "acquire_req":
            asks.setdefault(key, []).append([e["t"], None, None])
        elif e["ev"] in ("granted", "error", "abandoned") and asks.get(key) and asks[key][-1][1] is None:
            asks[key][-1][1:] = [e["ev"], e.get("token")]
    open_grants: dict[str, tuple[int, str, int, int | None]] = {}   # group -> (put t, job, token, rev)
    judged: list[tuple[str, int, str, int, int | None, int | None]] = []

    def close(group: str, t_end: int | None) -> None:
        put = open_grants.pop(group, None)
        if put is not None:
            judged.append((group, *put, t_end))

    for e in events:
        ev, group = e["ev"], e.get("group")
        if ev == "grant_put":
            cur = open_grants.get(group)
            if cur is not None and cur[2] == e.get("token"):
                continue                                # the same grant rewritten: keeps its start
            close(group, e["t"])
            open_grants[group] = (e["t"], e.get("job"), e.get("token"), e.get("rev"))
        elif ev == "grant_end":
            close(group, e["t"])
        elif ev == "session_lost":
            left = e.get("lease_ttl_left")
            if left is not None and left > SLACK_S:
                report.violations.append(
                    f"[session-loss] {e.get('job')}: told at {at(e['t'])} that its session (lease "
                    f"{e.get('lease')}) was lost while etcd gave the lease {left}s more to live")
    _check_lost_leases(events, report, at, end_t)
    for group in list(open_grants):
        close(group, None)
    for group, t, job, token, rev, t_end in judged:
        before = [a for a in asks.get((group, job), ()) if a[0] <= t]
        if any(a[1] == "granted" and a[2] == token for a in before):
            continue                                    # returned to the call that asked for it
        if before and before[-1][1] == "granted" and not _written_before(rev, before[-1][2]):
            report.violations.append(
                f"[ghost] {group}: grant of token {token} to {job} written at {at(t)}, after the job's "
                f"last acquire (asked at {at(before[-1][0])}) had returned token {before[-1][2]}: "
                "made for an attempt nobody waits for")
            continue
        if t_end is not None and t_end - t <= bound:
            continue
        if t_end is None and end_t - t <= bound:
            continue                                    # the history ended too soon to tell
        released = f"released at {at(t_end)}" if t_end is not None else "never released"
        report.violations.append(
            f"[ghost] {group}: grant of token {token} to {job} at {at(t)} was returned to no live "
            f"caller within {bound_s:g}s and {released}")


def _written_before(rev: int | None, returned: int | None) -> bool:
    """Whether etcd's order proves a grant written at mod revision ``rev`` came before the
    entry (create revision ``returned``) whose grant an acquire returned: the watch told it late."""
    return rev is not None and returned is not None and rev < returned


def _check_lost_leases(events: list[dict], report, at, end_t: int) -> None:
    """``[session-loss]`` by etcd's view afterwards: the lost lease's session key outlived the loss."""
    if not any(e["ev"] == "session_put" and e.get("lease") for e in events):
        return                                          # no observer (or an older one): not judged
    slack = int(SLACK_S * 1e9)
    ended: dict[int, int] = {}
    live: set[int] = set()
    for e in events:
        if e["ev"] == "session_put" and e.get("lease"):
            live.add(e["lease"])
        elif e["ev"] == "session_end" and e.get("lease") in live:
            live.discard(e["lease"])
            ended[e["lease"]] = e["t"]
    for e in events:
        lease = e.get("lease")
        if e["ev"] != "session_lost" or not lease:
            continue
        gone = ended.get(lease)
        if gone is None and lease in live and end_t - e["t"] > slack:
            report.violations.append(
                f"[session-loss] {e.get('job')}: told at {at(e['t'])} that its session (lease {lease}) was lost; "
                "etcd still held its session key at the end of the history")
        elif gone is not None and gone - e["t"] > slack:
            report.violations.append(
                f"[session-loss] {e.get('job')}: told at {at(e['t'])} that its session (lease {lease}) was lost; "
                f"etcd held its session key until {at(gone)}, {(gone - e['t']) / 1e9:.1f}s later")
