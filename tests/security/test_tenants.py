"""Tenants and group access, one test per rule, against a real lockd (with --tenants-file) on real etcd.

team-a and team-b are tenants with bearer tokens; team-ops administers one group; the
admin token (the harness's shared one) is the superuser. Groups have no nodes, so a
grant needs no agent: what is checked is who may queue, see and delete.
"""
from __future__ import annotations

import hashlib
import secrets
import shutil

import grpc
import pytest

from tests.security.conftest import etcd_state, rpc_error
from tests.security.test_agent_tls import pki  # noqa: F401  (the fixture)
from timeslice.common.errors import ConfigError
from timeslice.common.server.keys import Keys
from timeslice.lockd.callers import TenantBook
from timeslice.lockd.tenancy import REDACTED
from timeslice.proto import lockd_pb2 as lpb
from timeslice.proto import lockd_pb2_grpc as lpbg
from timeslice.testing.lockd import LockdCluster, admin_channel, shared_admin_token

TOKENS = {t: f"{t}-{secrets.token_urlsafe(24)}" for t in ("team-a", "team-b", "team-ops")}


def _md(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


class Lockd:
    def __init__(self, cluster: LockdCluster, prefix: str):
        self.cluster, self.prefix, self.keys = cluster, prefix, Keys(prefix)
        self.target = cluster.replicas[0].target


@pytest.fixture(scope="module")
def lockd(etcd, tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    f = d / "tenants"
    # team-a by digest (no secret in the file), the others by token.
    f.write_text(f"team-a sha256:{hashlib.sha256(TOKENS['team-a'].encode()).hexdigest()}\n"
                 f"team-b token:{TOKENS['team-b']}   # a comment\n"
                 f"team-ops token:{TOKENS['team-ops']}\n")
    f.chmod(0o600)
    prefix = f"/ten-{secrets.token_hex(4)}/"
    shared_admin_token()
    c = LockdCluster(etcd.endpoints_str, prefix, n=1, logdir=str(d), extra=["--tenants-file", str(f)]).start()
    try:
        yield Lockd(c, prefix)
    finally:
        c.stop()


@pytest.fixture
async def stubs(lockd):
    chans = []

    def stub(token: str | None = None) -> lpbg.LockdStub:
        ch = admin_channel(lockd.target) if token == "admin" else grpc.aio.insecure_channel(lockd.target)
        chans.append(ch)
        s = lpbg.LockdStub(ch)
        s.token = None if token == "admin" else token
        return s
    yield stub
    for ch in chans:
        await ch.close()


class Job:
    def __init__(self, stub, job_id: str, secret: str):
        self.stub, self.job_id, self.secret = stub, job_id, secret

    def acquire(self, group: str):
        return self.stub.Acquire(lpb.AcquireRequest(job_id=self.job_id, session_secret=self.secret, group_id=group),
                                 timeout=10)

    async def release(self, group: str, token: int):
        await self.stub.Yield(lpb.YieldRequest(job_id=self.job_id, session_secret=self.secret, group_id=group,
                                               token=token), timeout=10)


async def _job(stub, name: str) -> Job:
    job_id = f"{name}-{secrets.token_hex(3)}"
    r = await stub.OpenSession(lpb.OpenSessionRequest(job_id=job_id, ttl_seconds=30), metadata=_md(stub.token),
                               timeout=10)
    return Job(stub, job_id, r.session_secret)


async def _group(admin, name: str, tenants=(), admins=()) -> str:
    g = f"{name}-{secrets.token_hex(3)}"
    await admin.CreateGroup(lpb.CreateGroupRequest(group_id=g, tenants=list(tenants), admins=list(admins)), timeout=10)
    return g


# -- sessions ---------------------------------------------------------------------------------------

async def test_a_session_needs_a_tenants_credential_and_belongs_to_that_tenant(stubs):
    anonymous, forged = stubs(), stubs("team-z-" + "x" * 20)
    for stub in (anonymous, forged):
        e = await rpc_error(stub.OpenSession(lpb.OpenSessionRequest(job_id="nobody", ttl_seconds=30),
                                             metadata=_md(stub.token), timeout=10))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
    a = await _job(stubs(TOKENS["team-a"]), "a")
    jobs = {j.job_id: j for j in (await stubs("admin").ListJobs(lpb.ListJobsRequest(), timeout=10)).jobs}
    assert jobs[a.job_id].tenant == "team-a"


# -- acquire ---------------------------------------------------------------------------------------

async def test_a_tenant_cannot_acquire_another_tenants_group(lockd, stubs, etcd_client):
    admin = stubs("admin")
    g = await _group(admin, "a-only", tenants=["team-a"])
    b = await _job(stubs(TOKENS["team-b"]), "b")
    before = await etcd_state(etcd_client, lockd.keys, g, b.job_id)
    e = await rpc_error(b.acquire(g))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "team-b" in e.details(), e
    assert await etcd_state(etcd_client, lockd.keys, g, b.job_id) == before      # not even queued
    a = await _job(stubs(TOKENS["team-a"]), "a")
    got = await a.acquire(g)
    await a.release(g, got.token)


async def test_a_group_open_to_every_tenant_and_the_admins_own_sessions(stubs):
    admin = stubs("admin")
    g = await _group(admin, "shared", tenants=["*"])
    for who in ("team-a", "team-b"):
        j = await _job(stubs(TOKENS[who]), who)
        got = await j.acquire(g)
        await j.release(g, got.token)
    private = await _group(admin, "private", tenants=["team-a"])
    root = await _job(admin, "operator")                       # the admin's session: the superuser's
    got = await root.acquire(private)
    await root.release(private, got.token)


async def test_with_tenants_a_group_must_name_them_and_only_the_admin_creates_one(stubs):
    e = await rpc_error(stubs("admin").CreateGroup(lpb.CreateGroupRequest(group_id="unnamed"), timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenants" in e.details(), e
    e = await rpc_error(stubs("admin").CreateGroup(lpb.CreateGroupRequest(group_id="bad", tenants=["../x"]),
                                                   timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    a = stubs(TOKENS["team-a"])
    e = await rpc_error(a.CreateGroup(lpb.CreateGroupRequest(group_id="mine", tenants=["team-a"]),
                                      metadata=_md(a.token), timeout=10))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e


# -- what a tenant sees ------------------------------------------------------------------------------

async def test_a_tenant_sees_only_its_groups_and_its_own_jobs(stubs):
    admin = stubs("admin")
    a_only = await _group(admin, "a-only", tenants=["team-a"])
    shared = await _group(admin, "shared", tenants=["*"])
    a_stub, b_stub = stubs(TOKENS["team-a"]), stubs(TOKENS["team-b"])
    a = await _job(a_stub, "a")
    b = await _job(b_stub, "b")
    held = await a.acquire(shared)
    try:
        listed = {g.group_id for g in (await b_stub.ListGroups(lpb.ListGroupsRequest(), metadata=_md(b_stub.token),
                                                               timeout=10)).groups}
        assert shared in listed and a_only not in listed
        e = await rpc_error(b_stub.GetGroupStatus(lpb.GroupRef(group_id=a_only), metadata=_md(b_stub.token),
                                                  timeout=10))
        assert e.code() == grpc.StatusCode.NOT_FOUND, e                 # the same as a group that does not exist
        st = await b_stub.GetGroupStatus(lpb.GroupRef(group_id=shared), metadata=_md(b_stub.token), timeout=10)
        assert st.holder.job_id == REDACTED and a.job_id not in str(st)
        mine = await a_stub.GetGroupStatus(lpb.GroupRef(group_id=shared), metadata=_md(a_stub.token), timeout=10)
        assert mine.holder.job_id == a.job_id
        async for update in b_stub.WatchGroup(lpb.GroupRef(group_id=shared), metadata=_md(b_stub.token), timeout=10):
            assert update.holder.job_id == REDACTED and a.job_id not in str(update)
            break
        jobs_b = {j.job_id for j in (await b_stub.ListJobs(lpb.ListJobsRequest(), metadata=_md(b_stub.token),
                                                           timeout=10)).jobs}
        assert b.job_id in jobs_b and a.job_id not in jobs_b
        everyone = {j.job_id for j in (await admin.ListJobs(lpb.ListJobsRequest(), timeout=10)).jobs}
        assert {a.job_id, b.job_id} <= everyone                           # the admin sees all
        st = await admin.GetGroupStatus(lpb.GroupRef(group_id=shared), timeout=10)
        assert st.holder.job_id == a.job_id
    finally:
        await a.release(shared, held.token)


async def test_reads_without_a_credential_are_refused(stubs):
    anon = stubs()
    for call in (anon.ListGroups(lpb.ListGroupsRequest(), timeout=10), anon.ListJobs(lpb.ListJobsRequest(), timeout=10)):
        e = await rpc_error(call)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e


# -- administering a group --------------------------------------------------------------------------

async def test_a_groups_administrator_may_delete_it_and_see_all_its_jobs_others_may_not(stubs):
    admin = stubs("admin")
    g = await _group(admin, "ops", tenants=["*"], admins=["team-ops"])
    ops, b_stub = stubs(TOKENS["team-ops"]), stubs(TOKENS["team-b"])
    a = await _job(stubs(TOKENS["team-a"]), "a")
    held = await a.acquire(g)
    st = await ops.GetGroupStatus(lpb.GroupRef(group_id=g), metadata=_md(ops.token), timeout=10)
    assert st.holder.job_id == a.job_id                                   # its administrator sees every job
    await a.release(g, held.token)
    e = await rpc_error(b_stub.DeleteGroup(lpb.DeleteGroupRequest(group_id=g), metadata=_md(b_stub.token), timeout=10))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
    e = await rpc_error(stubs().DeleteGroup(lpb.DeleteGroupRequest(group_id=g), timeout=10))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
    assert (await ops.DeleteGroup(lpb.DeleteGroupRequest(group_id=g), metadata=_md(ops.token), timeout=10)).deleted
    other = await _group(admin, "a-only", tenants=["team-a"])
    e = await rpc_error(ops.DeleteGroup(lpb.DeleteGroupRequest(group_id=other), metadata=_md(ops.token), timeout=10))
    assert e.code() == grpc.StatusCode.NOT_FOUND, e                       # not its group: not even seen
    assert (await admin.DeleteGroup(lpb.DeleteGroupRequest(group_id=other), timeout=10)).deleted


# -- credentials by TLS identity, and the file itself --------------------------------------------------

@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
async def test_a_client_certificate_names_its_tenant(etcd, tmp_path, pki):  # noqa: F811
    f = tmp_path / "tenants"
    f.write_text("team-tls tls:client\n")
    prefix = f"/tentls-{secrets.token_hex(4)}/"
    c = LockdCluster(etcd.endpoints_str, prefix, n=1, logdir=str(tmp_path),
                     extra=["--tenants-file", str(f), "--tls-cert", str(pki / "server.crt"), "--tls-key",
                            str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.crt")]).start()
    try:
        creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), (pki / "client.key").read_bytes(),
                                             (pki / "client.crt").read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{c.replicas[0].port}", creds) as ch:
            stub = lpbg.LockdStub(ch)
            await stub.OpenSession(lpb.OpenSessionRequest(job_id="tls-job", ttl_seconds=30), timeout=10)
            jobs = (await stub.ListJobs(lpb.ListJobsRequest(), timeout=10)).jobs
            assert [(j.job_id, j.tenant) for j in jobs] == [("tls-job", "team-tls")]
        no_cert = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{c.replicas[0].port}", no_cert) as ch:
            with pytest.raises(grpc.aio.AioRpcError):                      # mutual TLS: no certificate, no call
                await lpbg.LockdStub(ch).ListGroups(lpb.ListGroupsRequest(), timeout=5)
    finally:
        c.stop()


def test_the_tenants_file_is_checked_at_start():
    book = TenantBook.parse("a sha256:" + "0" * 64 + "\nb tls:cn-b\nc token:" + "t" * 20 + "\n")
    assert (book.by_tls("cn-b"), book.by_token("t" * 20), book.by_token("u" * 20)) == ("b", "c", None)
    for bad in ("a", "a b c", "../x token:" + "t" * 20, "a sha256:xyz", "a token:short", "a plain:zzz", "# none\n",
                "a token:" + "t" * 20 + "\nb token:" + "t" * 20):
        with pytest.raises(ConfigError):
            TenantBook.parse(bad)


def test_tenancy_is_on_in_deploy_and_off_in_the_local_cluster():
    from pathlib import Path

    import yaml
    root = Path(__file__).resolve().parents[2]
    dep = yaml.safe_load((root / "deploy" / "lockd" / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    path = env["TIMESLICE_TENANTS_FILE"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    secret = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == mounts[str(Path(path).parent)])
    assert secret == "timeslice-tenants"
    local = (root / "launcher" / "start.py").read_text() + (root / "deploy" / "local.env").read_text()
    assert "tenants" not in local.lower()


async def test_the_public_client_carries_its_tenants_token(lockd, stubs, monkeypatch):
    from timeslice import AsyncOrchestratorClient, PermissionDeniedError
    admin = stubs("admin")
    mine = await _group(admin, "b-only", tenants=["team-b"])
    theirs = await _group(admin, "a-only", tenants=["team-a"])
    monkeypatch.delenv("TIMESLICE_ADMIN_TOKEN", raising=False)        # a job, not the operator
    monkeypatch.setenv("TIMESLICE_TENANT_TOKEN", TOKENS["team-b"])
    c = AsyncOrchestratorClient(target=lockd.target, job_id=f"client-b-{secrets.token_hex(3)}", timeout=10)
    try:
        await c.acquire(mine, timeout=10)
        await c.yield_(mine)
        with pytest.raises(PermissionDeniedError):
            await c.acquire(theirs, timeout=10)
        assert [g.group_id for g in await c.groups() if g.group_id in (mine, theirs)] == [mine]
        seen = {j.job_id: j.tenant for j in await c.jobs()}
        assert c.job_id in seen and set(seen.values()) == {"team-b"}             # team-b's jobs only
    finally:
        await c.close()


async def test_profiles_show_a_tenant_its_own_jobs(stubs):
    import asyncio
    admin = stubs("admin")
    g = await _group(admin, "prof", tenants=["*"])
    a_stub, b_stub = stubs(TOKENS["team-a"]), stubs(TOKENS["team-b"])
    a, b = await _job(a_stub, "a"), await _job(b_stub, "b")
    for j in (a, b):
        held = await j.acquire(g)
        await j.release(g, held.token)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:                                   # the leader records finished holds in batches
        every = {p.job_id for p in (await admin.GetProfiles(lpb.ProfilesRequest(group_id=g), timeout=10)).profiles}
        if {a.job_id, b.job_id} <= every:
            break
        assert loop.time() < deadline, f"no profiles of both jobs: {every}"
        await asyncio.sleep(0.2)
    seen = await b_stub.GetProfiles(lpb.ProfilesRequest(group_id=g), metadata=_md(b_stub.token), timeout=10)
    assert {p.job_id for p in seen.profiles} == {b.job_id}
    e = await rpc_error(stubs().GetProfiles(lpb.ProfilesRequest(), timeout=10))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
