"""The sync face over the async client (client.py, bridge.py): which thread runs what, Ctrl-C in a
blocked call, close() under a blocked call, and a client used in a child after fork()."""
from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.client.helpers import FakeCuda, fake_torch, wait_for
from timeslice import ClientClosedError, ClientForkedError, OrchestratorClient, SessionLostError


def test_hooks_and_the_cache_release_run_on_the_calling_thread(lockd, group, uid, clients, monkeypatch):
    seen = []
    fake_torch(monkeypatch, FakeCuda(lambda call: seen.append((call, threading.current_thread()))))
    c = clients(OrchestratorClient(lockd.targets, job_id=f"hk-{uid}",
                                   after_acquire=lambda g: seen.append(("after", threading.current_thread())),
                                   before_yield=lambda g: seen.append(("before", threading.current_thread()))))

    def phase():
        with c.on_accelerators(group):
            pass
    worker = threading.Thread(target=phase, name="the-caller")
    worker.start()
    worker.join(30)
    assert [k for k, _ in seen] == ["after", "before", "synchronize", "empty_cache"]
    assert all(t is worker for _, t in seen), seen


def test_session_loss_callback_from_the_keepalive_may_call_the_client(etcd, lockd, group, uid, clients):
    """Not on the loop thread: a callback that calls the client must not deadlock it."""
    got = {}
    done = threading.Event()

    def on_lost(err):
        got["thread"] = threading.current_thread().name
        got["holder"] = c.status(group).holder         # a call from inside the callback
        c.reset_session()
        done.set()
    c = clients(OrchestratorClient(lockd.targets, job_id=f"cb-{uid}", session_ttl=3, on_session_lost=on_lost))
    c.acquire(group)
    etcd.revoke_lease(c.lease_id)
    assert done.wait(15), got
    assert got["holder"] is None and not got["thread"].startswith("timeslice-client")
    assert not c.session_lost                        # reset from the callback
    assert c.acquire(group).job_id == c.job_id
    c.yield_(group)


@pytest.fixture
def ctrl_c_delivered():
    """SIGINT handled by Python for this test, as in a terminal, whatever the test run inherited.

    A process started in the background by a shell without job control (as CI runners and
    ``nohup``/``&`` start the suite) inherits SIGINT *ignored*; Python then keeps it ignored and
    ``_thread.interrupt_main()`` does nothing at all (its documented behaviour for SIG_IGN and
    SIG_DFL), so the blocked acquire below was never interrupted and the test hung until
    pytest-timeout (the CI failure of c35011c). A real Ctrl-C would be ignored by such a process
    too; what this test checks is what the client does when one *is* delivered.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_a_blocked_acquire_gives_up_the_place(lockd, admin, group, uid, clients, ctrl_c_delivered):
    holder = clients(OrchestratorClient(lockd.targets, job_id=f"kh-{uid}"))
    waiter = clients(OrchestratorClient(lockd.targets, job_id=f"kw-{uid}"))
    holder.acquire(group)
    trouble = []

    def interrupt_when_queued():
        try:
            wait_for(lambda: admin.status(group).waiters, what="the waiter queued")
        except BaseException as e:        # any failure: reported by the main thread below
            trouble.append(e)
        _thread.interrupt_main()                     # as Ctrl-C would, in the thread blocked in acquire
    threading.Thread(target=interrupt_when_queued, daemon=True).start()
    # Bounded: an interrupt that never arrives fails the test (TimeoutError) instead of hanging it.
    with pytest.raises(KeyboardInterrupt):
        waiter.acquire(group, timeout=60)
    assert not trouble, trouble
    wait_for(lambda: not admin.status(group).waiters, what="the cancelled acquire left the queue")
    assert not waiter.session_lost and waiter.held == {}
    holder.yield_(group)
    assert waiter.acquire(group, timeout=10).job_id == waiter.job_id   # the client is fine afterwards
    waiter.yield_(group)


def test_close_ends_a_call_blocked_in_another_thread(lockd, admin, group, uid, clients):
    holder = clients(OrchestratorClient(lockd.targets, job_id=f"ch-{uid}"))
    waiter = OrchestratorClient(lockd.targets, job_id=f"cw-{uid}")
    holder.acquire(group)
    out = {}

    def wait():
        try:
            waiter.acquire(group)
        except Exception as e:
            out["err"] = e
    t = threading.Thread(target=wait)
    t.start()
    wait_for(lambda: admin.status(group).waiters, what="the waiter queued")
    waiter.close()
    t.join(15)
    assert isinstance(out.get("err"), (ClientClosedError, SessionLostError)), out
    assert admin.status(group).waiters == ()
    holder.yield_(group)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_client_used_in_a_forked_child_raises_and_leaves_the_parent_alone(lockd, group, uid, clients):
    c = clients(OrchestratorClient(lockd.targets, job_id=f"fk-{uid}"))
    grant = c.acquire(group)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the child: report, never return into pytest
        code = 0
        try:
            os.close(r)
            try:
                c.status(group)
                code = 10                            # used the parent's client: wrong
            except ClientForkedError:
                code = 1
            c.close()                                # must not close the parent's session
            os.write(w, b"%d" % code)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        verdict = f.read()
    os.waitpid(pid, 0)
    assert verdict == b"1", verdict
    time.sleep(2 * c.config.keepalive_period)
    assert not c.session_lost and c.status(group).holder.job_id == c.job_id
    assert c.yield_(group).token == grant.token


def test_a_client_left_open_closes_its_session_at_interpreter_exit(lockd, admin, group, uid):
    """No close(): at exit the loop thread still closes the session (its holds go at once, not a
    TTL later), and the interpreter does not hang on the thread."""
    script = ("import sys; from timeslice import OrchestratorClient\n"
              "c = OrchestratorClient(sys.argv[1].split(','), job_id=sys.argv[2], session_ttl=120)\n"
              "c.acquire(sys.argv[3]); print('holding', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", script, ",".join(lockd.targets), f"ex-{uid}", group],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "holding" in r.stdout, r.stderr
    # Gone well before its 120 s TTL (the replicas' views follow etcd within moments).
    wait_for(lambda: admin.status(group).holder is None, what="the hold released at exit")
    assert f"ex-{uid}" not in [j.job_id for j in admin.jobs()]
