"""Every error the servers raise maps to a gRPC status by meaning; UNAVAILABLE only for transient ones."""
from __future__ import annotations

import importlib
import pkgutil

import grpc

import timeslice.common
import timeslice.lockd
import timeslice.nodeagent
from timeslice.common.errors import TimesliceError

#: The only errors that may say UNAVAILABLE: each goes away by itself (retry elsewhere or later).
TRANSIENT = {
    "EtcdError",          # base class only: map_error never returns it bare (see common/server/etcd/errmap.py)
    "EtcdUnavailable",    # no etcd member answered in time
    "OutcomeUnknown",     # the reply of a write was lost
    "ElectionError", "NotLeader",   # leadership moves; the next replica answers
    "AgentStopping",      # the agent is going; its successor answers
    "ChannelClosed",      # a cooperative worker has not (re)connected to the agent yet
}


def _load_all() -> None:
    for pkg in (timeslice.lockd, timeslice.nodeagent, timeslice.common):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if ".testing" in m.name or m.name.endswith(("cli", "__main__")):
                continue
            importlib.import_module(m.name)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_server_error_has_a_status_by_meaning():
    _load_all()
    seen = {}
    for cls in _subclasses(TimesliceError):
        if not cls.__module__.startswith(("timeslice.lockd", "timeslice.nodeagent", "timeslice.common")):
            continue
        assert hasattr(grpc.StatusCode, cls.code), f"{cls.__qualname__}: {cls.code!r} is no gRPC status"
        assert cls.code not in ("UNKNOWN", "OK"), cls
        if cls.code == "UNAVAILABLE":
            assert cls.__name__ in TRANSIENT, f"{cls.__module__}.{cls.__name__} says UNAVAILABLE but is not transient"
        seen[cls.__name__] = cls.code
    assert len(seen) > 25, sorted(seen)           # the walk found the servers' errors
    # Among them: a vanished lease, an oversized request, a full etcd.
    assert (seen["EtcdLeaseGone"], seen["EtcdRequestTooLarge"], seen["EtcdNoSpace"]) == \
        ("ABORTED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")
    assert (seen["NotOwner"], seen["LimitExceeded"], seen["GroupRevoked"]) == \
        ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "ABORTED")
