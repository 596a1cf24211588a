"""ProfileBook (lockd/profiles.py), sans-IO: phases from the lock's events, bounds, failover."""
from __future__ import annotations

import pytest

from timeslice.common import records as R
from timeslice.lockd.profiles import ProfileBook, fractions


def cycle(book: ProfileBook, t: int, token: int, wait: int, hold: int, group="g", job="a") -> int:
    """One Acquire -> grant -> yield of ``job`` starting at ``t``; returns the yield time."""
    book.enqueued(group, job, token, t)
    book.granted(group, job, token, t + wait, restored=False, elided=False)
    book.left(group, job, None, t + wait + hold)
    return t + wait + hold


def test_hold_gap_and_wait_from_acquire_grant_yield():
    book = ProfileBook()
    t = cycle(book, 1000, 11, wait=5, hold=200)
    t = cycle(book, t + 300, 12, wait=7, hold=210)
    cycle(book, t + 310, 13, wait=9, hold=220)
    p = book.profiles[("g", "a")]
    assert p.hold_ms == [200, 210, 220] and p.wait_ms == [5, 7, 9] and p.gap_ms == [300, 310]
    assert p.grants == 3 and p.first_ms == 1000
    busy, wait = fractions(p)
    assert busy == pytest.approx(210 / (210 + 305 + 7)) and wait == pytest.approx(7 / (210 + 305 + 7))


def test_a_resent_acquire_and_a_repeated_grant_count_once():
    book = ProfileBook()
    book.enqueued("g", "a", 5, 100)
    book.enqueued("g", "a", 5, 150)           # the takeover rewrote the entry: same token
    book.granted("g", "a", 5, 160, True, False)
    book.granted("g", "a", 5, 170, True, False)
    book.left("g", "a", 5, 400)
    p = book.profiles[("g", "a")]
    assert p.wait_ms == [60] and p.hold_ms == [240] and p.grants == 1 and p.restored == 1


def test_an_abandoned_wait_ends_no_hold_and_measures_no_gap():
    book = ProfileBook()
    t = cycle(book, 0, 1, wait=1, hold=100)
    book.enqueued("g", "a", 2, t + 50)       # gap 50
    book.left("g", "a", None, t + 5000)      # timed out before its grant
    book.enqueued("g", "a", 3, t + 5100)     # no gap measured across the abandoned wait
    p = book.profiles[("g", "a")]
    assert p.hold_ms == [100] and p.gap_ms == [50]


def test_a_stale_token_or_an_unknown_grant_changes_nothing():
    book = ProfileBook()
    book.enqueued("g", "a", 7, 0)
    book.granted("g", "a", 6, 10, False, False)      # an older entry's grant
    book.granted("g", "b", 7, 10, False, False)      # a job never queued
    book.left("g", "a", 6, 20)
    assert book.profiles[("g", "a")].wait_ms == [] and ("g", "b") not in book.profiles


def test_distributions_keep_the_last_n_phases():
    book = ProfileBook(phases=4)
    t = 0
    for i in range(10):
        t = cycle(book, t + 10, 100 + i, wait=1, hold=i + 1)
    assert book.profiles[("g", "a")].hold_ms == [7, 8, 9, 10]


def test_the_least_recently_updated_profile_is_evicted_and_reported():
    book = ProfileBook(max_profiles=2)
    for i, job in enumerate(["a", "b", "c"]):
        cycle(book, 1000 * (i + 1), i + 1, wait=1, hold=1, job=job)
    assert set(book.profiles) == {("g", "b"), ("g", "c")}
    dirty, gone = book.take_dirty()
    assert {(p.group, p.job) for p in dirty} == {("g", "b"), ("g", "c")} and gone == [("g", "a")]
    assert book.take_dirty() == ([], [])


def test_swaps_and_footprints():
    book = ProfileBook()
    book.enqueued("g", "a", 1, 0, hint_bytes=10)
    book.swapped("g", "a", R.SNAPSHOT, 12.4, 1000, 1200, 5)
    book.swapped("g", "a", R.RESTORE, 9.6, 1000, 1200, 6)
    book.swapped("g", "a", R.FREEZE, 1.0, 0, 0, 7)        # not a swap
    book.footprint(["g", "other"], "a", "n1", {"gpu-0": 700, "gpu-1": 500}, 8)
    book.footprint(["g"], "a", "n1", {"gpu-0": 300}, 9)  # the peak is kept
    p = book.profiles[("g", "a")]
    assert p.snapshot_ms == [12] and p.restore_ms == [10] and p.swap_bytes == [1000, 1000]
    assert p.host_bytes == 1000 and p.device_bytes == 1200
    assert p.gpu_bytes == {"n1/gpu-0": 700, "n1/gpu-1": 500}
    assert ("other", "a") not in book.profiles             # footprints never create profiles


def test_a_new_leader_continues_from_the_stored_profiles_and_open_entries():
    old = ProfileBook()
    t = cycle(old, 0, 1, wait=2, hold=100)
    old.enqueued("g", "a", 2, t + 40)
    old.granted("g", "a", 2, t + 45, False, True)
    stored = [R.ProfileValue.load(p.dump()) for p in old.take_dirty()[0]]   # what etcd holds

    new = ProfileBook()
    new.load(stored)
    new.reopen("g", "a", 2, t + 40, t + 45)                 # the entry and grant found at start
    new.left("g", "a", None, t + 245)
    cycle(new, t + 300, 3, wait=1, hold=90)
    p = new.profiles[("g", "a")]
    assert p.hold_ms == [100, 200, 90] and p.gap_ms == [40, 55] and p.elided == 1


@pytest.mark.parametrize("kw", [{"phases": 0}, {"max_profiles": 0}])
def test_bounds_must_be_positive(kw):
    with pytest.raises(ValueError):
        ProfileBook(**kw)


def test_the_jobs_own_hold_is_kept_beside_the_lock_one_when_plausible():
    book = ProfileBook()
    t = cycle(book, 0, 1, wait=2, hold=100)
    book.enqueued("g", "a", 2, t + 50, last_hold_ms=90)      # its GPU phase, without the round trips
    book.granted("g", "a", 2, t + 52, False, False)
    book.left("g", "a", None, t + 152)
    book.enqueued("g", "a", 3, t + 200, last_hold_ms=5000)   # longer than the lock saw: not believed
    assert book.profiles[("g", "a")].busy_ms == [90]
