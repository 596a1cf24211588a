"""Which regions a cooperative snapshot releases (sans-IO: backends.composite.choose_tags)."""
from timeslice.nodeagent.backends.composite import choose_tags

MiB = 1 << 20
A = ({"weights": "offload", "optimizer": "offload", "kv": "discard"},
     {"weights": 8 * MiB, "optimizer": 16 * MiB, "kv": 4 * MiB})


def test_everything_when_the_need_is_unknown_or_not_smaller():
    assert choose_tags({1: A}, 0) == {1: None}
    assert choose_tags({1: A}, 28 * MiB) == {1: None}


def test_discard_first_then_the_largest_offload_regions():
    assert choose_tags({1: A}, 3 * MiB) == {1: ["kv"]}              # nothing copied at all
    assert choose_tags({1: A}, 5 * MiB) == {1: ["kv", "optimizer"]}
    assert choose_tags({1: A}, 21 * MiB) == {1: ["kv", "optimizer", "weights"]}


def test_across_the_processes_of_a_job():
    b = ({"kv": "discard"}, {"kv": 2 * MiB})
    got = choose_tags({1: A, 2: b}, 5 * MiB)
    assert got == {1: ["kv"], 2: ["kv"]}                            # 6 MiB of discardable memory suffice
