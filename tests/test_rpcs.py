"""Every method of the lock API is placed once in ``common/rpcs.py``: what a call of it proves.

lockd's gate and read auth and the client's credentials and error table read those lists; a
method left out of them would get no credential, or the wrong error class, without a word.
"""
from __future__ import annotations

from timeslice.common import rpcs
from timeslice.proto import lockd_pb2 as pb


def test_every_lock_method_is_in_exactly_one_list():
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Lockd"].methods}
    placed = [*rpcs.ADMIN, *rpcs.READS, *rpcs.SESSION, rpcs.OPEN]
    assert len(placed) == len(set(placed)), "a method is in two lists"
    assert set(placed) == methods, (f"not placed: {sorted(methods - set(placed))}; "
                                    f"not methods of the API: {sorted(set(placed) - methods)}")


def test_the_client_sends_what_each_list_asks(monkeypatch):
    from timeslice.auth import metadata_for
    from timeslice.errors import AuthError, CredentialsError, error_class

    monkeypatch.setenv("TIMESLICE_ADMIN_TOKEN", "admin-t")
    monkeypatch.setenv("TIMESLICE_TENANT_TOKEN", "tenant-t")
    for m in [*rpcs.ADMIN, *rpcs.READS]:
        assert metadata_for(m) == (("authorization", "Bearer admin-t"),), m
    assert metadata_for(rpcs.OPEN) == (("authorization", "Bearer tenant-t"),)
    for m in rpcs.SESSION:
        assert metadata_for(m) is None, m
        assert error_class("UNAUTHENTICATED", "", m) is AuthError, m
    for m in [*rpcs.ADMIN, *rpcs.READS]:
        assert error_class("UNAUTHENTICATED", "", m) is CredentialsError, m
