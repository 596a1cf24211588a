"""The job side of the make-room path and of the measures a grant admits (sans-IO parts):
timeslice.room.with_room and timeslice.memstats.measure."""
import pytest

from timeslice.common.device_errors import DeviceOutOfMemory, NoRoom
from timeslice.memstats import DeviceStats, Measure, measure
from timeslice.room import RoomAnswer, bytes_asked, with_room

MiB = 1 << 20


class Device:
    """An allocator over a device of ``free`` bytes; ``ask`` frees what a parked job left, once."""

    def __init__(self, free: int, residue: int):
        self.free, self.residue, self.asks = free, residue, []

    def alloc(self, n: int):
        def go():
            if n > self.free:
                raise DeviceOutOfMemory(f"{n} bytes do not fit ({self.free} free)")
            self.free -= n
            return n
        return go

    def ask(self, device: str, need: int) -> RoomAnswer:
        self.asks.append((device, need))
        freed, self.residue = self.residue, 0
        self.free += freed
        return RoomAnswer(freed, self.free, [{"job": "me", "bytes": 30 * MiB, "what": "this job"},
                                             {"pid": 4242, "bytes": 5 * MiB, "what": "not registered"}],
                          "" if freed else "nothing left to move")


def oom(e: BaseException) -> bool:
    return isinstance(e, DeviceOutOfMemory)


def test_an_allocation_that_does_not_fit_asks_for_room_once_and_succeeds():
    d = Device(free=10 * MiB, residue=4 * MiB)
    assert with_room(d.alloc(12 * MiB), need_bytes=12 * MiB, device="sim0", ask=d.ask, is_oom=oom) == 12 * MiB
    assert d.asks == [("sim0", 12 * MiB)]


def test_when_nothing_more_can_be_freed_it_raises_naming_who_holds_the_device():
    d = Device(free=10 * MiB, residue=1 * MiB)
    with pytest.raises(NoRoom) as e:
        with_room(d.alloc(20 * MiB), need_bytes=20 * MiB, device="sim0", ask=d.ask, is_oom=oom)
    assert len(d.asks) == 2                                   # freed 1 MiB, then nothing: no third ask
    msg = str(e.value)
    assert msg.startswith("out of device memory inside the hold: 20.0 MiB more needed on sim0; 11.0 MiB free")
    assert "job me (30.0 MiB, this job)" in msg and "pid 4242 (no job registered it) (5.0 MiB" in msg
    assert "nothing left to move" in msg and e.value.holders[1]["pid"] == 4242
    assert isinstance(e.value, DeviceOutOfMemory)             # an out-of-memory error still, for any handler


def test_other_errors_pass_through_and_without_a_channel_it_says_so():
    def boom():
        raise ValueError("not memory")
    with pytest.raises(ValueError):
        with_room(boom, need_bytes=1, device="d", ask=None, is_oom=oom)
    d = Device(free=0, residue=0)
    with pytest.raises(NoRoom, match="no node agent could be asked"):
        with_room(d.alloc(1), need_bytes=1, device="d", ask=None, is_oom=oom)


def test_a_framework_error_type_and_the_size_torch_names():
    class FrameworkOOM(RuntimeError):
        pass
    d = Device(free=0, residue=0)
    with pytest.raises(FrameworkOOM, match="held by job me"):
        with_room(d.alloc(5), need_bytes=5, device="cuda:0", ask=d.ask, is_oom=oom,
                  raise_as=lambda msg, err, answer: FrameworkOOM(msg))
    err = RuntimeError("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of ...")
    assert bytes_asked(err, 7) == 1 << 30 and bytes_asked(RuntimeError("other"), 7) == 7


def test_the_measures_of_a_hold_are_the_allocators_peak_and_what_the_meter_sees_beside_it():
    class Stats:
        def reset_peak(self): ...
        def allocator_peak_bytes(self): return 45 << 30
        def allocator_bytes(self): return 44 << 30
        def device_used_bytes(self): return (44 << 30) + (1200 << 20)

    assert isinstance(Stats(), DeviceStats)
    assert measure(Stats()) == Measure(45 << 30, 1200 << 20)

    class NoMeter(Stats):
        def device_used_bytes(self): return None
    assert measure(NoMeter()) == Measure(45 << 30, 0)         # the context unmeasured: lockd's default

    class Broken(Stats):
        def allocator_peak_bytes(self): raise RuntimeError("no CUDA")
    assert measure(Broken()) == Measure()                      # costs the figures, never the yield
