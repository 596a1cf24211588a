"""pytest fixtures over the etcd harness; enable with
``pytest_plugins = ["timeslice.testing.pytest_plugin"]`` in a top-level conftest.

- ``etcd``: one single-member cluster for the whole session (fast);
- ``etcd3``: a 3-member cluster per module, for failover tests;
- ``fresh_etcd``: a single member of the test's own, for tests that break it;
- ``etcd_client``: the project's ``EtcdClient``, connected to ``etcd``, closed after the test;
- ``key_prefix``: a key namespace of the test's own, so shared clusters are safe;
- ``proc_reaper``: kills whatever processes the test registered, pass or fail.

Shared clusters are healed (paused members resumed, stopped ones restarted)
before each test that uses them, so one test's faults do not leak into the
next. When a test fails, the log tail of every live etcd member is attached to
its report, next to the traceback.

Under pytest-xdist (``-n N``, as ``scripts/test.sh`` runs the suite) every worker is a
session of its own: its own ``etcd``, and, set here before any test runs, its own per-user
state folder (where ``timeslice up`` leaves the pointers that other commands and tests look
for) and pinning lock, so that no worker finds another's local cluster or waits on its pinning.
"""
from __future__ import annotations

import os
import re
import secrets
import sys
import tempfile

import pytest

from timeslice.testing.etcd import EtcdCluster, live_clusters
from timeslice.testing.lockd import shared_admin_token
from timeslice.testing.procs import ProcReaper

shared_admin_token()        # lockd/agents the tests start and the tests' own clients share it


def _own_host_state() -> None:
    """Per-host state that tests must not share with a developer's cluster or another session's,
    nor, under xdist, with another worker's (a worker inherits the controller's environment)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    # `timeslice up` remembers running local clusters in a per-user folder so that other commands
    # find them from any directory: the tests keep theirs in a folder of their own.
    state = os.environ.get("TIMESLICE_USER_STATE_DIR") or tempfile.mkdtemp(prefix="timeslice-user-state-")
    if worker:
        state = os.path.join(state, worker)
        os.makedirs(state, exist_ok=True)
    os.environ["TIMESLICE_USER_STATE_DIR"] = state
    # One host-memory pinning at a time per host (timeslice.pinned): per worker here, so one
    # worker's jobs never wait on another's.
    if worker and "TIMESLICE_PIN_LOCK" not in os.environ:
        os.environ["TIMESLICE_PIN_LOCK"] = os.path.join(state, "timeslice-pin.lock")
    # PyTorch's CPU kernels (the real-framework jobs, in this process and the jobs it starts): one
    # thread each beside the other workers; its OpenMP threads otherwise spin for CPUs they share.
    if worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")


_own_host_state()


def pytest_addoption(parser):
    parser.addini("timeslice_xdist_groups", type="linelist", default=[],
                  help="'name: path ...' per line: under xdist, the tests under these paths run one after another")


def xdist_group(config, nodeid: str) -> str:
    """The group a test runs in under xdist: a named group whose paths hold it, else its module."""
    path = nodeid.split("::", 1)[0]
    for line in config.getini("timeslice_xdist_groups"):
        name, _, paths = line.partition(":")
        if any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths.split()):
            return name.strip()
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # Our own grouping, by path: xdist's --dist loadgroup reads xdist_group marks through a change to
    # the test's node id that pytest >= 9.2 no longer takes, and then spreads every module's tests
    # over the workers without a word.
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(config, nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return                              # one process: the order as collected
    named = {line.partition(":")[0].strip() for line in config.getini("timeslice_xdist_groups")}
    long = {xdist_group(config, i.nodeid) for i in items if i.get_closest_marker("slow") or i.get_closest_marker("chaos")}

    def rank(item) -> int:
        g = xdist_group(config, item.nodeid)
        return 0 if g in named else 1 if g in long else 2
    items.sort(key=rank)                    # stable: each group's tests stay in their order


@pytest.fixture(scope="session")
def etcd():
    """A single-member etcd shared by the session: use ``key_prefix`` for your keys."""
    with EtcdCluster(size=1, name_prefix="s") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def etcd3():
    """A 3-member etcd shared by the module; tests may kill, pause and restart members."""
    with EtcdCluster(size=3, name_prefix="c") as cluster:
        yield cluster


@pytest.fixture
async def etcd_client(etcd):
    """The project's etcd client, connected to the shared ``etcd``; closed after the test."""
    from timeslice.common.server.etcd import EtcdClient, EtcdConfig
    async with EtcdClient(EtcdConfig.parse(etcd.endpoints_str)) as c:   # connect / close
        yield c


@pytest.fixture
def fresh_etcd():
    """A single-member etcd owned by this test alone."""
    with EtcdCluster(size=1, name_prefix="f") as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _heal_shared_etcd(request):
    # Only for tests that use a shared cluster; touching the fixture otherwise
    # would start a cluster nobody asked for.
    for name in ("etcd", "etcd3"):
        if name in request.fixturenames:
            request.getfixturevalue(name).heal()


@pytest.fixture(autouse=True)
def _structlog_left_as_found():
    # structlog's configuration is process-wide, and a configured structlog prints to stdout by
    # default: a test that leaves it configured (structlog.testing.capture_logs does) makes the
    # client library's events land in a later test's captured stdout on the same worker (a CLI's
    # --json output then does not parse). Put it back unconfigured if it was.
    import structlog
    was = structlog.is_configured()
    yield
    if not was and structlog.is_configured():
        structlog.reset_defaults()


@pytest.fixture(autouse=True)
def _sim_devices_forgotten():
    # A test's job-side simulated device clients stand for one job's process. A later test on the same
    # worker is another job: one it left open would make the channel's device check
    # (timeslice.sim.runtime.opened_devices) see two devices and refuse with WrongDeviceError.
    yield
    runtime = sys.modules.get("timeslice.sim.runtime")
    if runtime is not None:
        runtime._live.clear()


@pytest.fixture
def key_prefix(request) -> str:
    """``/t-<test name>-<random>/``: a namespace no other test (or rerun) shares."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")[:48]
    return f"/t-{name}-{secrets.token_hex(4)}/"


@pytest.fixture
def proc_reaper():
    """A ``ProcReaper``: ``spawn(argv)`` or ``register(popen_or_pid)``; reaped at teardown."""
    reaper = ProcReaper()
    try:
        yield reaper
    finally:
        reaper.reap()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # Attach the logs while the failing test's clusters still run: by fixture
    # teardown a function-scoped cluster's log dir is gone, and output printed
    # from a passing teardown is not shown.
    report = yield
    if report.failed:
        for cluster in live_clusters():
            report.sections.append(
                (f"etcd logs ({', '.join(cluster.endpoints)})", cluster.dump_logs()))
    return report
