"""Turn on etcd authentication with one role per timeslice component (idempotent).

Run once after etcd is up (the etcd-auth-setup Job runs it with the timeslice
image), and again whenever a GPU node is added. It creates, or brings up to date:

    user root            role root           needed by etcd to enable auth; the operator's
    user lockd           role timeslice-lockd          read-write on the whole prefix
    user agent-<node>    role timeslice-agent-<node>   read on the prefix, write only under
                                                       <prefix>nodes/<node>/ (its agent key and
                                                       the statuses it reports)

and then enables authentication. It runs with the timeslice package installed (the
keys are spelled by ``timeslice.common.server.keys``, as every component spells them; node
names and the prefix follow the same grammar). Passwords are read from files, never from the
command line: ``--root-password-file``, ``--lockd-password-file`` and
``--agents-dir`` (one file per node, named after the node, holding that node's
agent password — the same value the node's agent reads from its own host file).

    python etcd_auth_setup.py --endpoint etcd-0.etcd-peer:2379 --prefix /timeslice/ \\
        --root-password-file /secrets/root --lockd-password-file /secrets/lockd --agents-dir /agents
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from aetcd.rpc import auth_pb2, rpc_pb2, rpc_pb2_grpc

from timeslice.common.errors import InvalidIdError
from timeslice.common.ids import check_id
from timeslice.common.server.keys import Keys, prefix_range_end


def plan(prefix: str, nodes: list[str]) -> dict[str, list[tuple[int, bytes, bytes]]]:
    """role -> [(permission type, key, range_end)]; the whole policy, in one place. The keys are
    spelled by ``timeslice.common.server.keys``, as every component spells them."""
    keys = Keys(prefix)
    p = keys.root()
    read, rw = auth_pb2.Permission.READ, auth_pb2.Permission.READWRITE
    roles = {"timeslice-lockd": [(rw, p, prefix_range_end(p))]}
    for n in nodes:
        own = keys.node(n)
        roles[f"timeslice-agent-{n}"] = [(read, p, prefix_range_end(p)), (rw, own, prefix_range_end(own))]
    return roles


class Auth:
    def __init__(self, channel: grpc.Channel):
        self.stub = rpc_pb2_grpc.AuthStub(channel)
        self.md: list[tuple[str, str]] = []

    def login(self, user: str, password: str) -> None:
        token = self.stub.Authenticate(rpc_pb2.AuthenticateRequest(name=user, password=password)).token
        self.md = [("token", token)]

    def _ok_if_exists(self, call, req) -> None:
        try:
            call(req, metadata=self.md)
        except grpc.RpcError as e:
            if "already exists" not in (e.details() or ""):
                raise

    def role(self, name: str, perms: list[tuple[int, bytes, bytes]]) -> None:
        self._ok_if_exists(self.stub.RoleAdd, rpc_pb2.AuthRoleAddRequest(name=name))
        for ptype, key, end in perms:
            self.stub.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(
                name=name, perm=auth_pb2.Permission(permType=ptype, key=key, range_end=end)), metadata=self.md)

    def user(self, name: str, password: str, role: str) -> None:
        try:
            self.stub.UserAdd(rpc_pb2.AuthUserAddRequest(name=name, password=password), metadata=self.md)
        except grpc.RpcError as e:
            if "already exists" not in (e.details() or ""):
                raise
            self.stub.UserChangePassword(rpc_pb2.AuthUserChangePasswordRequest(name=name, password=password),
                                         metadata=self.md)
        self.stub.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=name, role=role), metadata=self.md)


def read_secret(path: str | os.PathLike) -> str:
    value = Path(path).read_text().strip()
    if not value:
        raise SystemExit(f"{path}: empty password")
    return value


def agents(agents_dir: str | None) -> dict[str, str]:
    if not agents_dir:
        return {}
    out = {}
    for f in sorted(Path(agents_dir).iterdir()):
        if f.name.startswith(".") or not f.is_file():
            continue        # Kubernetes secret volumes hold ..data links beside the keys
        try:
            check_id("node", f.name)        # the grammar of every node id (timeslice.common.ids)
        except InvalidIdError:
            raise SystemExit(f"{f.name[:64]!r} is not a node name") from None
        out[f.name] = read_secret(f)
    return out


def setup(channel: grpc.Channel, prefix: str, root_pw: str, lockd_pw: str, agent_pws: dict[str, str]) -> list[str]:
    """Create or update the roles and users, then enable auth. Returns the users set."""
    if not prefix.startswith("/") or not prefix.endswith("/"):
        raise SystemExit("prefix must start and end with '/'")   # as every component's (timeslice.common.server.keys)
    a = Auth(channel)
    try:
        a.login("root", root_pw)          # works only once auth is on (AuthStatus is 3.5+ only)
        enabled = True
    except grpc.RpcError as e:
        if "not enabled" not in (e.details() or ""):
            raise
        enabled = False
        a._ok_if_exists(a.stub.RoleAdd, rpc_pb2.AuthRoleAddRequest(name="root"))
        a.user("root", root_pw, "root")
    for role, perms in plan(prefix, sorted(agent_pws)).items():
        a.role(role, perms)
    a.user("lockd", lockd_pw, "timeslice-lockd")
    for node, pw in sorted(agent_pws.items()):
        a.user(f"agent-{node}", pw, f"timeslice-agent-{node}")
    if not enabled:
        a.stub.AuthEnable(rpc_pb2.AuthEnableRequest(), metadata=a.md)
    return ["root", "lockd"] + [f"agent-{n}" for n in sorted(agent_pws)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", required=True, help="one etcd member, host:port")
    ap.add_argument("--prefix", default="/timeslice/")
    ap.add_argument("--root-password-file", required=True)
    ap.add_argument("--lockd-password-file", required=True)
    ap.add_argument("--agents-dir", default=None, help="one file per node: the agent's password")
    ap.add_argument("--ca-file", default=None, help="etcd CA (turns on TLS)")
    ap.add_argument("--cert-file", default=None)
    ap.add_argument("--key-file", default=None)
    a = ap.parse_args(argv)
    if a.ca_file:
        creds = grpc.ssl_channel_credentials(
            Path(a.ca_file).read_bytes(), Path(a.key_file).read_bytes() if a.key_file else None,
            Path(a.cert_file).read_bytes() if a.cert_file else None)
        channel = grpc.secure_channel(a.endpoint, creds)
    else:
        channel = grpc.insecure_channel(a.endpoint)
    users = setup(channel, a.prefix, read_secret(a.root_password_file), read_secret(a.lockd_password_file),
                  agents(a.agents_dir))
    print(f'{{"event": "etcd_auth_ready", "users": {len(users)}}}', flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
