"""timeslice.pinned without a GPU: the libc side is real (mmap, THP advice, multi-threaded fault-in, munmap);
registration is a recorder here, cudaHostRegister on a GPU. What the node agent is told while reserving."""
from __future__ import annotations

import ctypes

import pytest

from timeslice import pinned as P

MiB = 1 << 20


class Registrar:
    def __init__(self, fail: bool = False):
        self.fail, self.calls, self.gone = fail, [], []

    def register(self, addr: int, n: int) -> None:
        if self.fail:
            raise P.PinnedPoolError("registration refused (test)")
        self.calls.append((addr, n))

    def unregister(self, addr: int) -> None:
        self.gone.append(addr)


def test_fault_and_register_one_call_per_slab_and_the_pending_bytes_while_it_runs():
    reg = Registrar()
    seen = []
    pool = P.PinnedPool("fault", threads=4, register=reg.register, unregister=reg.unregister, max_slab=4 * MiB)
    pool.on_change = lambda: seen.append((pool.pending_bytes(), pool.size()))
    assert pool.reserve(9 * MiB) == 0
    assert seen == [(10 * MiB, 0), (0, 10 * MiB)]          # promised first (2 MiB multiples), then reserved
    assert [n for _, n in reg.calls] == [4 * MiB, 4 * MiB, 2 * MiB] and pool.method == "fault"
    for s in pool.slabs:                                    # faulted in and writable: the memory is ours
        assert ctypes.string_at(s.addr + s.nbytes - 8, 8) == b"\0" * 8
        ctypes.memset(s.addr, 0x5A, s.nbytes)
    assert pool.reserve(MiB) == 10 * MiB                    # growth: the next logical offset
    pool.close()
    assert sorted(reg.gone) == sorted(a for a, _ in reg.calls) and pool.size() == 0


def test_pieces_never_cross_a_slab():
    reg = Registrar()
    pool = P.PinnedPool("fault", threads=2, register=reg.register, unregister=reg.unregister, max_slab=4 * MiB)
    pool.reserve(10 * MiB)
    got = pool.split(3 * MiB, 6 * MiB)
    assert [(e.slab, e.offset, e.nbytes) for e in got] == [(0, 3 * MiB, MiB), (1, 0, 4 * MiB), (2, 0, MiB)]
    with pytest.raises(P.BackupError):
        pool.split(9 * MiB, 2 * MiB)
    pool.close()


@pytest.mark.skipif(not P.thp_available(), reason="this kernel offers no transparent huge pages")
def test_auto_takes_huge_pages_where_the_kernel_offers_them():
    reg = Registrar()
    pool = P.PinnedPool("auto", threads=2, register=reg.register, unregister=reg.unregister)
    pool.reserve(4 * MiB)
    assert pool.method == "thp"
    pool.close()


def test_when_registering_fails_every_method_is_tried_and_the_error_says_which(monkeypatch):
    reg = Registrar(fail=True)
    pool = P.PinnedPool("auto", threads=2, register=reg.register, unregister=reg.unregister)
    seen = []
    pool.on_change = lambda: seen.append(pool.pending_bytes())
    try:
        import torch  # noqa: F401
        pytest.skip("torch is installed here: its pin_memory would be the fallback that works")
    except ImportError:
        pass
    with pytest.raises(P.PinnedPoolError, match=r"no pinning method worked .*'fault'.*'torch'"):
        pool.reserve(4 * MiB)
    assert pool.size() == 0 and seen == [4 * MiB, 0]        # the promise is withdrawn when it fails


def test_a_pool_the_host_cannot_hold_is_refused_before_anything_is_promised():
    reg = Registrar()
    pool = P.PinnedPool("fault", register=reg.register, unregister=reg.unregister)
    seen = []
    pool.on_change = lambda: seen.append(pool.pending_bytes())
    with pytest.raises(P.PinnedPoolError, match="available"):
        pool.reserve(P.mem_available() + (64 << 30))
    assert seen == [] and reg.calls == []


def test_one_pinning_at_a_time_per_host(tmp_path):
    import threading
    import time
    reg = Registrar()
    lock = str(tmp_path / "pin.lock")
    pool = P.PinnedPool("fault", threads=2, register=reg.register, unregister=reg.unregister, lock_path=lock)
    with P.host_lock(lock):                                 # another process is pinning
        t = threading.Thread(target=pool.reserve, args=(4 * MiB,))
        t.start()
        deadline = time.monotonic() + 10
        while pool.pending_bytes() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.pending_bytes() == 4 * MiB              # promised (the agent counts it) ...
        assert pool.size() == 0 and reg.calls == []         # ... but not pinned while the other one pins
    t.join(10)
    assert pool.size() == 4 * MiB and len(reg.calls) == 1
    pool.close()


def test_the_next_slab_faults_in_while_the_last_one_registers(monkeypatch):
    # Registering is a third of a pinning on the H200: done one slab behind the faulting, it hides.
    faulted: list[int] = []
    second_faulting = __import__("threading").Event()
    real_fault = P.fault_in

    def fault(addr, n, threads):
        faulted.append(addr)
        if len(faulted) == 2:
            second_faulting.set()
        real_fault(addr, n, threads)
    monkeypatch.setattr(P, "fault_in", fault)
    overlapped = []

    def register(addr, n):
        if addr == faulted[0]:                  # the first slab: is the second faulting meanwhile?
            overlapped.append(second_faulting.wait(10))
    pool = P.PinnedPool("fault", threads=2, register=register, unregister=lambda a: None, max_slab=4 * MiB)
    pool.reserve(8 * MiB)
    assert overlapped == [True] and all(s.registered for s in pool.slabs) and len(pool.slabs) == 2
    pool.close()


def test_a_failed_registration_frees_every_slab(monkeypatch):
    calls = []

    def register(addr, n):
        calls.append(addr)
        if len(calls) == 2:
            raise P.PinnedPoolError("registration refused (test)")
    gone = []
    pool = P.PinnedPool("fault", threads=2, register=register, unregister=gone.append, max_slab=4 * MiB)
    with pytest.raises(P.PinnedPoolError):
        pool.reserve(12 * MiB)
    assert pool.size() == 0 and gone == [calls[0], calls[2]]      # the registered ones given back


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")


def _fresh(n: int) -> int:
    import mmap
    addr = P._libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    return int(addr)


def test_the_kernel_populates_the_pages_where_it_can_and_they_are_resident(monkeypatch):
    """MADV_POPULATE_WRITE (Linux 5.14+): the pages are the process's without one write of ours."""
    monkeypatch.setattr(P, "_populate_works", [True])
    n = 64 * MiB
    addr = _fresh(n)
    before = _resident_bytes()
    try:
        how = P.fault_in(addr, n, threads=4)
        if how == "memset":
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
        assert how == "populate"
        assert _resident_bytes() - before >= n * 0.95          # faulted in, by the kernel
    finally:
        P._libc.munmap(addr, n)


def test_a_kernel_without_populate_falls_back_to_memset_and_says_so(monkeypatch):
    monkeypatch.setattr(P, "_populate_works", [True])
    asked = []

    def madvise(addr, n, advice):
        asked.append(advice)
        return __import__("errno").EINVAL                       # a kernel before 5.14
    monkeypatch.setattr(P, "_madvise", madvise)
    n = 16 * MiB
    addr = _fresh(n)
    before = _resident_bytes()
    try:
        assert P.fault_in(addr, n, threads=2) == "memset"
        assert _resident_bytes() - before >= n * 0.95
        assert P._populate_works == [False]                     # not asked again
        assert P.fault_in(addr, n, threads=2) == "memset" and len(asked) == 1
    finally:
        P._libc.munmap(addr, n)


def test_memory_the_host_cannot_give_is_an_error_not_a_crash(monkeypatch):
    monkeypatch.setattr(P, "_populate_works", [True])
    monkeypatch.setattr(P, "_madvise", lambda addr, n, advice: __import__("errno").ENOMEM)
    addr = _fresh(4 * MiB)
    try:
        with pytest.raises(P.PinnedPoolError, match="could not give"):
            P.fault_in(addr, 4 * MiB, threads=1)
    finally:
        P._libc.munmap(addr, 4 * MiB)


def test_jobs_pinning_in_the_background_together_pin_every_first_region_before_any_second(monkeypatch, tmp_path):
    """Two jobs' background reservations (weights, then optimizer) on one host lock: each job's weights,
    what its first pause needs, are pinned before either job's optimizer state."""
    import threading
    import time as _time

    from timeslice.backup import BackupBook
    order: list[str] = []
    real = P.fault_in

    def slow(addr, n, threads):
        _time.sleep(0.2)                           # a cold host's first touch
        return real(addr, n, threads)
    monkeypatch.setattr(P, "fault_in", slow)
    lock = str(tmp_path / "pin.lock")
    books = []
    for job in ("a", "b"):
        def register(addr, n, job=job):
            order.append(f"{job}:{n // MiB}")
        pool = P.PinnedPool("fault", threads=1, register=register, unregister=lambda a: None, lock_path=lock)
        books.append((BackupBook(pool, mover=None), pool))
    go = [threading.Thread(target=b.reserve, args=({"weights": 2 * MiB, "optimizer": 4 * MiB}, True))
          for b, _ in books]
    for t in go:
        t.start()
        _time.sleep(0.05)                          # a starts first, b right after
    for t in go:
        t.join()
    for b, pool in books:
        b.settle()
        pool.close()
    assert sorted(order[:2]) == ["a:2", "b:2"] and sorted(order[2:]) == ["a:4", "b:4"], order
