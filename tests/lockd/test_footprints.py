"""The footprint rule (lockd/footprints.py), sans-IO: what a grant admits per job and GPU."""
import pytest

from timeslice.lockd import footprints as FP

GiB = 1 << 30
H200 = 143_771 << 20


def test_a_declaration_alone_is_a_first_hold_admitted_with_context_margin_and_spare():
    fp = FP.footprint([0], hint=40 * GiB, capacity={0: H200})
    assert fp.first_hold and fp.known(0)
    ctx = FP.context_of(fp, 0)
    assert ctx == 612 << 20                                 # the H200's context, unmeasured: its share
    total = int((40 * GiB + ctx) * 1.02)
    assert FP.admitted(fp, 0) == total + int(total * 0.25)


def test_an_observed_peak_above_the_declaration_is_what_is_admitted_and_no_spare():
    fp = FP.footprint([0], hint=40 * GiB, peak=45 * GiB, context=1200 << 20, capacity={0: H200})
    assert not fp.first_hold
    assert FP.admitted(fp, 0) == int((45 * GiB + (1200 << 20)) * 1.02)
    # The declaration stays a floor: a peak below it does not lower the grant.
    low = FP.footprint([0], hint=40 * GiB, peak=30 * GiB, context=1 * GiB, capacity={0: H200})
    assert FP.admitted(low, 0) == int(41 * GiB * 1.02)


def test_the_meter_checks_the_jobs_word():
    """A job that reports less than the meter saw of it is admitted on the meter's figure."""
    fp = FP.footprint([0], hint=10 * GiB, peak=10 * GiB, context=1 * GiB, seen={0: 20 * GiB})
    assert FP.admitted(fp, 0) == int(20 * GiB * 1.02)


def test_a_residue_stands_for_an_unmeasured_context_and_a_measured_one_wins():
    fp = FP.footprint([0], hint=10 * GiB, peak=10 * GiB, residue={0: 2 * GiB}, capacity={0: H200})
    assert FP.context_of(fp, 0) == 2 * GiB
    measured = FP.footprint([0], hint=10 * GiB, peak=10 * GiB, context=1 * GiB, residue={0: 2 * GiB})
    assert FP.context_of(measured, 0) == 1 * GiB


def test_per_node_figures_are_spread_over_the_jobs_gpus():
    fp = FP.footprint([0, 1], hint=20 * GiB, peak=30 * GiB, context=2 * GiB)
    assert fp.observed == {0: 15 * GiB, 1: 15 * GiB} and fp.context == {0: GiB, 1: GiB}
    assert FP.admitted(fp, 0) == FP.admitted(fp, 1) == int(16 * GiB * 1.02)


def test_nothing_known_weighs_the_whole_gpu():
    fp = FP.footprint([0], capacity={0: H200})
    assert not fp.known(0) and not fp.first_hold
    assert FP.admitted(fp, 0) == H200
    assert FP.admitted(FP.footprint([0]), 0) == 0           # capacity unknown too


def test_a_meter_figure_alone_gets_the_margin_not_the_first_holds_spare():
    fp = FP.footprint([0], seen={0: 8 * GiB}, capacity={0: 32 * GiB})
    assert not fp.first_hold
    assert FP.admitted(fp, 0) == int(8 * GiB * 1.02)


def test_the_policy_is_validated():
    with pytest.raises(ValueError):
        FP.FootprintPolicy(margin_fraction=-0.1)
    with pytest.raises(ValueError):
        FP.FootprintPolicy(first_hold_spare=2)
    exact = FP.FootprintPolicy(context_fraction=0, margin_fraction=0, first_hold_spare=0)
    assert FP.admitted(FP.footprint([0], hint=5 * GiB, capacity={0: H200}), 0, exact) == 5 * GiB
