"""A job that used torch-memory-saver regions exits with its own status (timeslice/torch_release.py).

torch-memory-saver cannot run without a GPU, so its rule is played by a stand-in written
from its source (``csrc/entrypoint.cpp``, ``csrc/utils.h``, ``entrypoint.py``): a region is
a pool kept in ``torch_memory_saver._impl._mem_pools``; the pool's end frees its cached
blocks through ``tms_torch_free``, which calls ``exit(1)`` (after printing "only support
interesting region") on a thread whose thread-local "inside a region" flag is not set; a
free of a paused allocation fails the same way. The stand-in does exactly that, with
``os._exit(1)``, in a real interpreter that really tears down, so the exit status says
whether a job would have ended with 1.

The negative control shows the stand-in reproduces the H200 failure: the same region use
without ``TorchMemory`` exits 1 at teardown, with torch-memory-saver's line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_TORCH = '''
import types

class _Memory:
    pass                                      # no _snapshot: TorchMemory keeps torch-memory-saver's backup

class _Cuda:
    memory = _Memory()
    def synchronize(self, device=None): pass
    def set_device(self, device): pass
    def current_device(self): return 0
    def is_initialized(self): return True
    def memory_reserved(self, device=None): return 0
    def max_memory_reserved(self, device=None): return 0
    def mem_get_info(self, device=None): return (1 << 30, 1 << 30)
    def get_device_properties(self, device): return types.SimpleNamespace(uuid="GPU-stand-in")
    def empty_cache(self): pass

cuda = _Cuda()
'''

FAKE_TMS = '''
"""A stand-in for torch-memory-saver's torch hook mode: its free rule, from its source."""
import contextlib
import os
import threading

_flag = threading.local()                 # ThreadLocalConfig::is_interesting_region_ (TMS_INIT_ENABLE unset)
freed = []                                # (tag, blocks) freed through tms_torch_free


def _inside():
    return getattr(_flag, "on", False)


class _Cdll:
    def tms_set_interesting_region(self, value):
        _flag.on = bool(value)

    def tms_get_interesting_region(self):
        return _inside()


class _Wrapper:
    cdll = _Cdll()


class MemPool:
    def __init__(self, tag):
        self.tag, self.live, self.cached, self.paused = tag, 0, 0, False

    def __del__(self, _write=os.write, _exit=os._exit, _inside=_inside, _freed=freed):
        # ~MemPool: releasePool, then emptyCache(id): each cached free block goes to tms_torch_free
        if not self.cached:
            return
        if not _inside():
            _write(2, b"[torch_memory_saver.cpp] only support interesting region "
                      b"file=csrc/entrypoint.cpp func=tms_torch_free\\n")
            _exit(1)
        if self.paused:
            _write(2, b"[torch_memory_saver.cpp] CUresult error: 1 func=free (the allocation is unmapped)\\n")
            _exit(1)
        _freed.append((self.tag, self.cached))


class _Impl:
    def __init__(self):
        self._binary_wrapper = _Wrapper()
        self._mem_pools = {}
        self.current = None


class TorchMemorySaver:
    def __init__(self):
        self._impl = None
        self.retain_cpu_backup = False

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, value):
        pass

    def _ensure_initialized(self):
        if self._impl is None:
            self._impl = _Impl()

    @contextlib.contextmanager
    def region(self, tag="default", enable_cpu_backup=False):
        self._ensure_initialized()
        key = (tag, enable_cpu_backup, False, "", 0)
        pool = self._impl._mem_pools.setdefault(key, MemPool(tag))
        before, self._impl.current = self._impl.current, pool
        was = _inside()
        _flag.on = True
        try:
            yield
        finally:
            _flag.on = was
            self._impl.current = before

    def _pools(self, tag):
        return [p for k, p in self._impl._mem_pools.items() if tag is None or k[0] == tag]

    def pause(self, tag=None):
        for p in self._pools(tag):
            p.paused = True

    def resume(self, tag=None):
        for p in self._pools(tag):
            p.paused = False


torch_memory_saver = TorchMemorySaver()


def alloc(n=1):
    """n blocks allocated in the current region (tensors the job keeps: its model)."""
    torch_memory_saver._impl.current.live += n


def alloc_and_free(n=1):
    """n blocks used and freed in the current region: cached in its pool (an optimizer step's temporaries)."""
    torch_memory_saver._impl.current.cached += n
'''

JOB = '''
import json, sys
import torch_memory_saver as fake
mode = sys.argv[1]
if mode == "no-timeslice":                      # the negative control: torch-memory-saver alone
    tms = fake.torch_memory_saver
    with tms.region("weights"):
        fake.alloc()
        fake.alloc_and_free(2)
    print("done", flush=True)
    sys.exit(0)

from timeslice.torch_memory import TorchMemory
memory = TorchMemory({"weights": "offload", "optimizer": "offload"})
with memory.region("weights"):
    fake.alloc()
with memory.region("optimizer"):
    fake.alloc()
    fake.alloc_and_free(3)
if mode == "close":                             # the job's end, inside its last hold (TimeSlice.finish)
    memory.close()
    print(json.dumps({"freed_at_close": fake.freed}), flush=True)
elif mode == "paused":                          # the process ends while parked: regions released
    memory.pause(["weights", "optimizer"])
elif mode == "close-paused":
    memory.pause(["weights"])
    try:
        memory.close()
    except RuntimeError as e:
        print(json.dumps({"refused": str(e)}), flush=True)
print("done", flush=True)
sys.exit(0)
'''


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(textwrap.dedent(FAKE_TORCH))
    (tmp_path / "torch_memory_saver").mkdir()
    (tmp_path / "torch_memory_saver" / "__init__.py").write_text(textwrap.dedent(FAKE_TMS))
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    return tmp_path


def run_job(folder: Path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(folder / "job.py"), mode], capture_output=True, text=True,
                          env=env, timeout=120)


def doc_of(p: subprocess.CompletedProcess) -> dict:
    """The job's JSON line (the library's log lines go to stdout too)."""
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("{")))


def test_the_stand_in_fails_as_torch_memory_saver_does_without_timeslice(stand_in):
    """Negative control: regions used and the interpreter left as it is end with status 1."""
    p = run_job(stand_in, "no-timeslice")
    assert "done" in p.stdout
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "only support interesting region" in p.stderr and "tms_torch_free" in p.stderr


def test_a_job_that_ends_without_close_exits_zero(stand_in):
    """No close(), regions resident: at exit the regions are detached, nothing freed through the saver."""
    p = run_job(stand_in, "plain")
    assert p.returncode == 0, p.stderr
    assert "torch_memory_saver.cpp" not in p.stderr


def test_a_job_that_ends_parked_exits_zero(stand_in):
    """Regions released when the process ends: no device call and no free (a free would fail)."""
    p = run_job(stand_in, "paused")
    assert p.returncode == 0, p.stderr
    assert "torch_memory_saver.cpp" not in p.stderr


def test_close_releases_the_cached_blocks_where_the_saver_accepts_it(stand_in):
    p = run_job(stand_in, "close")
    assert p.returncode == 0, p.stderr
    assert "torch_memory_saver.cpp" not in p.stderr
    doc = doc_of(p)
    assert doc["freed_at_close"] == [["optimizer", 3]]       # the step's temporaries, freed at close


def test_close_refuses_while_a_region_is_released(stand_in):
    p = run_job(stand_in, "close-paused")
    assert p.returncode == 0, p.stderr
    doc = doc_of(p)
    assert "inside a hold" in doc["refused"] and "weights" in doc["refused"]


ORDER = '''
import atexit
import timeslice

client = timeslice.OrchestratorClient(target="127.0.0.1:9", job_id="order-job")   # no call: nothing connects
closing = client._atexit
atexit.unregister(closing)


def client_closes():
    print("client closed", flush=True)
    closing()


client._atexit = client_closes
atexit.register(client_closes)                  # as the client registers itself: when it is made


class Memory:
    def at_exit(self):
        print("memory detached", flush=True)


from timeslice import teardown                  # imported after the client, as torch_memory imports it

memory = Memory()
teardown.on_exit(memory.at_exit)                # registered after the client, as TorchMemory would be
'''


def test_exit_handlers_run_after_every_client_closed(tmp_path):
    """The regions are let go of only after the clients closed their channels (no swap request can
    arrive meanwhile), even for a memory made after the client."""
    (tmp_path / "order.py").write_text(ORDER)
    p = subprocess.run([sys.executable, str(tmp_path / "order.py")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln in ("client closed", "memory detached")]
    assert lines == ["client closed", "memory detached"], p.stdout
