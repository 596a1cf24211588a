"""The agent's direct API over mutual TLS, against a real agent process."""
from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from tests.security.conftest import MiB, rpc_error
from timeslice.common.sim.device import SimDevice
from timeslice.proto import nodeagent_pb2 as pb
from timeslice.proto import nodeagent_pb2_grpc as pbg
from timeslice.testing.agent import AgentProcess
from timeslice.testing.lockd import shared_admin_token

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate (EC keys: quick to make)."""
    d = tmp_path / "pki"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=timeslice-test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext", cwd=d)
    return d


def _call_status(target: str, creds, token: str | None):
    md = (("authorization", f"Bearer {token}"),) if token else None

    async def go():
        async with grpc.aio.secure_channel(target, creds) as ch:
            return await pbg.NodeAgentStub(ch).Status(pb.AgentStatusRequest(), timeout=5, metadata=md)
    return go()


async def test_agent_direct_api_over_mutual_tls(etcd, key_prefix, tmp_path, pki):
    SimDevice(tmp_path / "sim", tmp_path / "host", capacity_bytes=16 * MiB)
    agent = AgentProcess(etcd.endpoints_str, key_prefix, "tls-node", str(tmp_path), sim_dir=tmp_path / "sim",
                         env={"TIMESLICE_SIM_HOST_DIR": str(tmp_path / "host")},
                         extra=["--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
                                "--tls-client-ca", str(pki / "ca.crt")])
    agent.start()
    try:
        ca = (pki / "ca.crt").read_bytes()
        mutual = grpc.ssl_channel_credentials(ca, (pki / "client.key").read_bytes(), (pki / "client.crt").read_bytes())
        st = await _call_status(agent.target, mutual, shared_admin_token())
        assert st.node == "tls-node"
        # No client certificate, or plaintext: the handshake itself fails.
        e = await rpc_error(_call_status(agent.target, grpc.ssl_channel_credentials(ca), shared_admin_token()))
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(agent.target) as ch:
            e = await rpc_error(pbg.NodeAgentStub(ch).Status(pb.AgentStatusRequest(), timeout=5))
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        # A certificate is no admin token: the direct ops still need it.
        async with grpc.aio.secure_channel(agent.target, mutual) as ch:
            e = await rpc_error(pbg.NodeAgentStub(ch).Snapshot(pb.OperationRequest(job_id="j"), timeout=5))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        agent.stop()
