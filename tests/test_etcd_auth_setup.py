"""deploy/'s etcd auth: one role per component, checked against a real etcd.

The setup script (deploy/components/etcd-auth/etcd_auth_setup.py, run by the
etcd-auth-setup Job) enables auth; afterwards lockd may write anywhere under the
prefix, an agent only under its own nodes/<node>/, and nobody without a password.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import grpc
import pytest
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "components" / "etcd-auth" / "etcd_auth_setup.py"
PREFIX = "/timeslice/"


def _load():
    spec = importlib.util.spec_from_file_location("etcd_auth_setup", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


setup_mod = _load()


def put(channel, user: str | None, password: str | None, key: str) -> grpc.StatusCode | None:
    """Put ``key`` as ``user``; None if allowed, else the status code."""
    md = []
    if user:
        token = rpc_pb2_grpc.AuthStub(channel).Authenticate(
            rpc_pb2.AuthenticateRequest(name=user, password=password)).token
        md = [("token", token)]
    try:
        rpc_pb2_grpc.KVStub(channel).Put(rpc_pb2.PutRequest(key=key.encode(), value=b"{}"), metadata=md)
    except grpc.RpcError as e:
        return e.code()
    return None


def get_ok(channel, user, password, key) -> bool:
    token = rpc_pb2_grpc.AuthStub(channel).Authenticate(
        rpc_pb2.AuthenticateRequest(name=user, password=password)).token
    try:
        rpc_pb2_grpc.KVStub(channel).Range(rpc_pb2.RangeRequest(key=key.encode()), metadata=[("token", token)])
    except grpc.RpcError:
        return False
    return True


@pytest.fixture
def channel(fresh_etcd):
    ch = grpc.insecure_channel(fresh_etcd.endpoints[0])
    yield ch
    ch.close()


def test_roles_confine_each_component(channel, tmp_path):
    agents = {"gpu-a": "pw-a", "gpu-b": "pw-b"}
    users = setup_mod.setup(channel, PREFIX, "rootpw", "lockdpw", agents)
    assert users == ["root", "lockd", "agent-gpu-a", "agent-gpu-b"]

    assert put(channel, None, None, PREFIX + "groups/g/spec") is not None          # auth is on
    assert put(channel, "lockd", "lockdpw", PREFIX + "groups/g/spec") is None
    assert put(channel, "lockd", "lockdpw", PREFIX + "nodes/gpu-a/intents/j") is None
    assert put(channel, "lockd", "lockdpw", "/other/x") == grpc.StatusCode.PERMISSION_DENIED

    assert put(channel, "agent-gpu-a", "pw-a", PREFIX + "nodes/gpu-a/status/j") is None
    assert put(channel, "agent-gpu-a", "pw-a", PREFIX + "nodes/gpu-a/agent") is None
    assert put(channel, "agent-gpu-a", "pw-a", PREFIX + "nodes/gpu-b/status/j") == grpc.StatusCode.PERMISSION_DENIED
    assert put(channel, "agent-gpu-a", "pw-a", PREFIX + "nodes/gpu-a-x/agent") == grpc.StatusCode.PERMISSION_DENIED
    assert put(channel, "agent-gpu-a", "pw-a", PREFIX + "groups/g/grant") == grpc.StatusCode.PERMISSION_DENIED
    assert get_ok(channel, "agent-gpu-a", "pw-a", PREFIX + "jobs/j/session")
    # The agent's liveness key is leased: granting a lease and attaching it must be allowed.
    token = rpc_pb2_grpc.AuthStub(channel).Authenticate(rpc_pb2.AuthenticateRequest(name="agent-gpu-a", password="pw-a")).token
    md = [("token", token)]
    lease = rpc_pb2_grpc.LeaseStub(channel).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=10), metadata=md).ID
    rpc_pb2_grpc.KVStub(channel).Put(rpc_pb2.PutRequest(key=(PREFIX + "nodes/gpu-a/agent").encode(), value=b"{}",
                                                        lease=lease), metadata=md)


def test_setup_is_idempotent_and_adds_nodes(channel):
    setup_mod.setup(channel, PREFIX, "rootpw", "lockdpw", {"gpu-a": "pw-a"})
    # Second run with auth already on: logs in as root, adds the new node, rotates a password.
    setup_mod.setup(channel, PREFIX, "rootpw", "lockdpw2", {"gpu-a": "pw-a", "gpu-c": "pw-c"})
    assert put(channel, "lockd", "lockdpw2", PREFIX + "x") is None
    assert put(channel, "agent-gpu-c", "pw-c", PREFIX + "nodes/gpu-c/agent") is None


def test_agents_dir_rejects_non_node_names(tmp_path):
    (tmp_path / "bad name").write_text("x")
    with pytest.raises(SystemExit):
        setup_mod.agents(str(tmp_path))
    (tmp_path / "bad name").unlink()
    (tmp_path / "..data").mkdir()          # what a Secret volume holds beside its keys
    (tmp_path / "gpu-a").write_text("pw\n")
    assert setup_mod.agents(str(tmp_path)) == {"gpu-a": "pw"}


def test_the_policy_spells_keys_as_the_components_do_and_refuses_what_they_cannot_use(channel, tmp_path):
    """The roles' ranges are ``timeslice.common.server.keys``'s: a node's own range is ``Keys.node``.
    A node name or a prefix no component accepts is refused before anything is set up."""
    from timeslice.common.server.keys import Keys, prefix_range_end
    roles = setup_mod.plan(PREFIX, ["gpu-a"])
    own = Keys(PREFIX).node("gpu-a")
    assert (own, prefix_range_end(own)) in [(k, e) for _, k, e in roles["timeslice-agent-gpu-a"]]
    (tmp_path / ("n" * 128)).write_text("pw")            # a Kubernetes name, but no node id
    with pytest.raises(SystemExit):
        setup_mod.agents(str(tmp_path))
    with pytest.raises(SystemExit):
        setup_mod.setup(channel, "timeslice/", "rootpw", "lockdpw", {})
