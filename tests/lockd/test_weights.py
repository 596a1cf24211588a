"""The fit rule and the backfill rule of a fit group (lockd/weights.py), sans-IO."""
from timeslice.common.server import records as R
from timeslice.lockd import weights as W

GB = 1 << 30
CAP = {("n1", 0): 100 * GB, ("n1", 1): 100 * GB}


def w(gb, gpu=0, node="n1"):
    return W.Weight({(node, gpu): gb * GB})


def test_a_grant_fits_while_the_footprints_on_each_of_its_gpus_stay_within_capacity_less_the_margin():
    assert W.fits(w(40), [w(30), w(30)], CAP, 0)
    assert not W.fits(w(41), [w(30), w(30)], CAP, 0)
    assert not W.fits(w(40), [w(30), w(30)], CAP, 1)            # the margin is kept
    assert W.fits(w(90), [w(30, gpu=1)], CAP, 0)                # another GPU's load does not count
    two = W.Weight({("n1", 0): 10 * GB, ("n1", 1): 80 * GB})    # a job on two GPUs weighs on both
    assert not W.fits(two, [w(30, gpu=1)], CAP, 0)
    assert not W.fits(w(1, node="n2"), [w(1)], CAP, 0)          # a GPU no agent reports has no room


def test_the_whole_device_is_alone_and_alone_only_with_nobody_holding():
    assert W.fits(W.WHOLE, [], CAP, 0) and W.fits(w(99), [], CAP, 0)
    assert not W.fits(W.WHOLE, [w(1)], CAP, 0)
    assert not W.fits(w(1), [W.WHOLE], CAP, 0)


def test_a_grant_without_a_readable_footprint_weighs_the_whole_device():
    assert W.of_grant(R.GrantValue("a", 5, 1)) == W.WHOLE                          # an older lockd's grant
    assert W.of_grant(R.GrantValue("a", 5, 1, footprint={"n1/0": 1}, exclusive=True)) == W.WHOLE
    assert W.of_grant(R.GrantValue("a", 5, 1, footprint={"n1/x": 1})) == W.WHOLE
    assert W.of_grant(R.GrantValue("a", 5, 1, footprint={"n1/0": 7, "n-2/3": 9})) == \
        W.Weight({("n1", 0): 7, ("n-2", 3): 9})


def test_backfill_only_where_the_head_would_fit_beside_every_set_of_holders_it_fits_beside_now_and_then():
    holders = [w(40), w(40)]
    head = w(50)                                  # 80 + 50 > 100: the head waits for a holder to yield
    assert not W.fits(head, holders, CAP, 0)
    # 10 GB: after either holder yields, 40 + 50 + 10 = 100 still fits: the head loses nothing.
    assert W.may_backfill(head, w(10), holders, CAP, 0)
    # 15 GB fits now (95), but once one holder yields the head would need the room it took: refused.
    assert W.fits(w(15), holders, CAP, 0)
    assert not W.may_backfill(head, w(15), holders, CAP, 0)
    # On a GPU the head does not use, anything that fits.
    assert W.may_backfill(head, w(60, gpu=1), holders, CAP, 0)
    # Past an exclusive (or unknown) head nobody goes: it fits only beside nobody.
    assert not W.may_backfill(W.WHOLE, w(1), holders, CAP, 0)
    assert not W.may_backfill(head, W.WHOLE, [], CAP, 0)
    # What does not fit now is not backfilled either.
    assert not W.may_backfill(head, w(21), holders, CAP, 0)


def test_the_holders_room_to_grow_is_their_footprint_less_what_they_hold_now():
    assert W.reserve([w(30), w(20)], "n1", {"a": {0: 5 * GB}, "b": {0: 25 * GB}}, ["a", "b"]) == {0: 25 * GB}
    assert W.reserve([w(30)], "n2", {}, ["a"]) == {}


def test_backfill_is_judged_on_the_room_the_holders_give_back_not_on_the_capacity():
    # 100 GB GPU, but a process outside the lock holds 30: only 70 comes back when holders leave.
    holders, head = [w(20), w(20)], w(40)
    room = W.returnable(CAP, {("n1", 0): 30 * GB}, [{("n1", 0): 20 * GB}, {("n1", 0): 20 * GB}])
    assert room[("n1", 0)] == 70 * GB and room[("n1", 1)] == 0
    assert W.may_backfill(head, w(15), holders, CAP, 0)          # by the capacity: 20 + 40 + 15 <= 100
    assert not W.may_backfill(head, w(15), holders, room, 0)     # by what comes back: 20 + 40 + 15 > 70
    assert W.may_backfill(head, w(10), holders, room, 0)         # 20 + 40 + 10 <= 70
