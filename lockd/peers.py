"""Who is calling: the identity lockd counts a caller's live sessions under (--max-sessions-per-peer).

* A client that presented a TLS certificate (mutual TLS) is its certificate's
  common name: ``tls:<CN>``; its address does not matter (many pods behind one
  egress address are told apart, one client on many addresses is not).
* Otherwise the client's network address without its port: ``ipv4:10.0.3.7``,
  ``ipv6:fd00::7``; a Unix-socket client is ``unix:local``.

Behind a proxy or sidecar that terminates the connection every client shares the
proxy's address: raise the per-peer limit there, or give clients certificates.
"""
from __future__ import annotations

from urllib.parse import unquote

MAX_PEER_CHARS = 160       # stored in the session value and quoted in errors: bounded


def identity(context) -> str:
    """The caller of a grpc.aio ``context``, as above ("" if gRPC cannot tell)."""
    try:
        auth = context.auth_context() or {}
    except Exception:
        auth = {}
    cn = auth.get("x509_common_name") or []
    if cn:
        raw = cn[0]
        return ("tls:" + (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)))[:MAX_PEER_CHARS]
    try:
        return address(context.peer() or "")
    except Exception:
        return ""


def address(peer: str) -> str:
    """gRPC's peer string without the port: ``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4``."""
    kind, _, rest = peer.partition(":")
    if kind.startswith("unix"):
        return "unix:local"
    rest = unquote(rest)
    if kind == "ipv6":
        host = rest.rpartition("]")[0].lstrip("[") if rest.startswith("[") else rest.rpartition(":")[0]
    elif kind == "ipv4":
        host = rest.rpartition(":")[0] or rest
    else:
        host = rest
    return f"{kind}:{host}"[:MAX_PEER_CHARS]
