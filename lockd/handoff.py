"""Direct handoff: release the holder and grant the next job in ONE transaction.

Normally a handoff costs two etcd rounds: the Yield's transaction, its watch
event reaching the leader, then the leader's grant transaction and its event
reaching the waiter's replica. Instead, the replica serving the Yield plans
the next grant at once (plan.py, on its mirror as it will be after the
release) and puts it inside the Yield's own transaction, fenced exactly like
the scheduler's grant: the current leader's epoch (``create_revision`` of its
election key, so the write is void if leadership changed), the next job's
queue entry and token, and the old grant's exact value. The decision is the
one the leader would take from the same state; a mirror that is stale can
only make a guard fail. If any guard fails, the nested else-branch just drops
the old grant, as a plain Yield does, and the leader's scheduler grants as
usual. Only a plain grant (nothing to snapshot or restore) is done here:
swaps are always driven by the leader.
"""
from __future__ import annotations

import dataclasses

from aetcd import rpc

from timeslice.common.server import records as R
from timeslice.common.server.etcd import ops
from timeslice.common.server.etcd.election import Leadership
from timeslice.common.server.keys import Keys
from timeslice.lockd import plan as P
from timeslice.lockd.index import StateIndex


def next_grant(index: StateIndex, group: str, job: str, policy: P.Policy) -> P.WriteGrant | None:
    """The grant the scheduler would write once ``job`` has released ``group``, if it is a plain one."""
    gs = index.groups.get(group)
    if gs is None or job not in gs.queue:
        return None
    mine = gs.grant_of(job)
    after = dataclasses.replace(gs, queue={j: kv for j, kv in gs.queue.items() if j != job},
                                grant=None if mine is gs.grant else gs.grant,
                                shared={j: kv for j, kv in gs.shared.items() if j != job})
    # ``job`` no longer holds ``group`` in this plan (its other grants still count).
    actions = P.plan_group(after, index.nodes, index.jobs, R.now_ms(), policy, index.node_jobs,
                           lambda j: index.specs_held_by(j, released=(job, group)))
    if len(actions) == 1 and isinstance(actions[0], P.WriteGrant):
        a = actions[0]
        if a.shared:
            # Its guard runs before the release in the same transaction: the yielder's grant is still there.
            a = dataclasses.replace(a, holders_rev=max([a.holders_rev] + [kv.mod_revision for kv in gs.shared.values()]))
        return a
    return None


def grant_or_drop(keys: Keys, lead: Leadership, group: str, old_key: bytes, old_grant: bytes, a: P.WriteGrant,
                  spec_rev: int) -> tuple[rpc.RequestOp, R.GrantValue]:
    """A nested txn: put the next grant over the old one if every guard holds, else drop the old one.
    ``spec_rev``: the create revision of the group's spec (no grant on a group deleted meanwhile).
    In a fit group the old and the new grant have keys of their own: the old goes, the new comes."""
    gkey = keys.grant_key(group, a.job, a.shared)
    val = a.stored(lead.epoch)
    compare = [lead.guard(), ops.create_rev(keys.queue_entry(group, a.job), "==", a.token),
               ops.value_is(old_key, "==", old_grant), ops.create_rev(keys.spec(group), "==", spec_rev)]
    success = [ops.put(gkey, val.dump(), a.lease)]   # the grant dies with the new holder's session
    if a.shared:
        # Nobody granted since the plan's read (holders may only have left), and not this job already.
        compare += [ops.create_rev(gkey, "==", 0), ops.mod_revs_below(keys.grants(group), a.holders_rev + 1)]
        success.insert(0, ops.delete(old_key))
    if a.turns_rev >= 0:
        # Over the turns key as planned (a raise since makes the plan stale); a priority group's grant
        # also counts itself there (lockd/priority.py).
        compare.append(ops.mod_rev(keys.turns(group), "==", a.turns_rev))
        if a.turns_next:
            success.append(ops.put(keys.turns(group), a.turns_next))
    op = rpc.RequestOp(request_txn=rpc.TxnRequest(
        compare=compare, success=success, failure=[drop_only(old_key, old_grant)]))
    return op, val


def drop_only(key: bytes, old_grant: bytes) -> rpc.RequestOp:
    """Delete the grant under ``key`` if it is still exactly ``old_grant``."""
    return rpc.RequestOp(request_txn=rpc.TxnRequest(
        compare=[ops.value_is(key, "==", old_grant)], success=[ops.delete(key)]))
