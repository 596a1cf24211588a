"""etcd user/password and TLS client certificates, and lockd's TLS server, against real processes."""
import asyncio
import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest

from timeslice.common.errors import EtcdError
from timeslice.common.server.etcd import EtcdClient, EtcdConfig, ops
from timeslice.common.server.logs import parse_ready
from timeslice.testing.ports import free_port

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


async def _put_get(cfg: EtcdConfig) -> bytes:
    c = EtcdClient(cfg)
    try:
        await c.txn([], [ops.put(b"/sec/k", b"v")])
        return (await c.range(ops.range_req(b"/sec/k"))).kvs[0].value
    finally:
        await c.close()


async def test_etcd_user_password(fresh_etcd):
    fresh_etcd.etcdctl("user", "add", "root:rootpw")
    fresh_etcd.etcdctl("auth", "enable")
    eps = tuple(fresh_etcd.endpoints)
    assert await _put_get(EtcdConfig(endpoints=eps, username="root", password="rootpw")) == b"v"
    with pytest.raises(EtcdError):
        await _put_get(EtcdConfig(endpoints=eps, username="root", password="wrong"))
    with pytest.raises(EtcdError):
        await _put_get(EtcdConfig(endpoints=eps))            # no credentials: refused


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d = tmp_path / "pki"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=timeslice-test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext", cwd=d)
    return d


@pytest.fixture
def tls_etcd(pki, tmp_path, proc_reaper):
    """One etcd member serving clients over TLS and requiring client certificates."""
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    argv = [os.environ.get("TIMESLICE_ETCD_BIN", "etcd"), "--name", "tls", "--data-dir", str(tmp_path / "data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
            "--cert-file", str(pki / "server.crt"), "--key-file", str(pki / "server.key"),
            "--trusted-ca-file", str(pki / "ca.crt"), "--client-cert-auth"]
    log = open(tmp_path / "etcd.log", "wb")
    proc_reaper.spawn(argv, stdout=log, stderr=subprocess.STDOUT)
    cfg = EtcdConfig(endpoints=(f"127.0.0.1:{port}",), ca_file=str(pki / "ca.crt"),
                     cert_file=str(pki / "client.crt"), key_file=str(pki / "client.key"), timeout=2)
    deadline = time.monotonic() + 20
    while True:
        try:
            asyncio.run(_put_get(cfg))
            break
        except EtcdError:
            assert time.monotonic() < deadline, (tmp_path / "etcd.log").read_text()[-2000:]
            time.sleep(0.2)
    return cfg


@needs_openssl
async def test_etcd_tls_with_client_certificates(tls_etcd, pki):
    assert await _put_get(tls_etcd) == b"v"
    no_cert = EtcdConfig(endpoints=tls_etcd.endpoints, ca_file=str(pki / "ca.crt"), timeout=2)
    with pytest.raises(EtcdError):
        await _put_get(no_cert)                                # the member requires a client certificate


@needs_openssl
def test_lockd_serves_tls_over_a_tls_etcd(tls_etcd, pki, tmp_path, proc_reaper):
    from timeslice import OrchestratorClient
    from timeslice.errors import DeadlineError, UnavailableError

    argv = [sys.executable, "-m", "timeslice.lockd.cli", "serve", "--etcd-endpoints", tls_etcd.endpoints[0],
            "--etcd-ca", tls_etcd.ca_file, "--etcd-cert", tls_etcd.cert_file, "--etcd-key", tls_etcd.key_file,
            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--replica-id", "tls0",
            "--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key")]
    log_path = tmp_path / "lockd.log"
    proc_reaper.spawn(argv, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    deadline, port = time.monotonic() + 30, 0
    while not port:
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        for line in log_path.read_text().splitlines():
            ready = parse_ready(line, "LOCKD_READY")
            if ready:
                port = int(ready["port"])
        time.sleep(0.1)
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.crt").read_bytes())
    with OrchestratorClient(f"127.0.0.1:{port}", job_id="tls-job", credentials=creds, timeout=10) as c:
        c.create_group("g")
        grant = c.acquire("g", timeout=10)
        assert grant.token > 0
        c.yield_("g")
    # Plaintext to a TLS server gets nothing: every attempt fails (UNAVAILABLE); on a loaded machine
    # the client's deadline may end the retries first (DeadlineError). Either way, no answer.
    with pytest.raises((UnavailableError, DeadlineError)):
        with OrchestratorClient(f"127.0.0.1:{port}", job_id="plain", timeout=3) as c:
            c.groups()
