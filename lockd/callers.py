"""Who is calling: the caller's address or TLS identity, the credential it presents, the tenant that names.

* **The peer** (``identity``): a client that presented a TLS certificate (mutual TLS) is
  its certificate's common name, ``tls:<CN>`` (many pods behind one egress address are
  told apart, one client on many addresses is not); otherwise its network address
  without its port: ``ipv4:10.0.3.7``, ``ipv6:fd00::7``; a Unix-socket client is
  ``unix:local``. lockd counts a caller's live sessions under it
  (--max-sessions-per-peer). Behind a proxy or sidecar that terminates the connection
  every client shares the proxy's address: raise the per-peer limit there, or give
  clients certificates.
* **The credential**: at most one bearer token (``authorization: Bearer <token>``): the
  admin token (the superuser), or a tenant's token; with mutual TLS, a client
  certificate whose identity the tenants file names counts as that tenant's credential
  too. Without a credential a caller is known only by its peer identity.
* **The tenants file** (``--tenants-file``; given, tenancy is on: ``lockd/tenancy.py``
  says what a tenant may do), one credential per line, ``#`` starts a comment::

      # tenant   credential
      team-a     sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
      team-a     tls:trainer-a.team-a          # a client certificate's common name (mutual TLS)
      team-b     token:a-long-random-bearer-token-of-team-b

  ``sha256:<hex>``: the SHA-256 of a bearer token (the file then holds no secret);
  ``token:<token>``: the token itself (kept only as its digest once read);
  ``tls:<common name>``: a client certificate lockd's TLS verified. Tenant names follow
  the id grammar; ``*`` is reserved (a group open to every tenant). A credential names
  one tenant: the same token or identity twice, under two tenants, fails start-up. The
  admin token stays the superuser and is never listed here.

``Callers.of`` gives what per-caller limits count under (open WatchGroup streams):
``admin``, ``tenant:<name>``, else the peer identity. With ``--require-read-auth`` (and
always when tenants are configured), the reads (ListGroups, GetGroupStatus, WatchGroup,
ListJobs, GetProfiles) need a credential: UNAUTHENTICATED without one. Where credentials
are needed, a token this server does not know is refused (UNAUTHENTICATED), never taken
for "no credential"; where they are optional, it counts for nothing.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import stat
from dataclasses import dataclass
from urllib.parse import unquote

import structlog

from timeslice.common.errors import ConfigError, InvalidIdError
from timeslice.common.ids import check_id
from timeslice.common.server.auth import Authority, check_token, presented_token
from timeslice.common.server.serving import env_flag, parse_bool
from timeslice.lockd.errors import Unauthenticated
from timeslice.lockd.watches import MAX_WATCHES, MAX_WATCHES_PER_CALLER, Watches

log = structlog.get_logger(__name__)

MAX_PEER_CHARS = 160       # stored in the session value and quoted in errors: bounded


def peer_identity(context) -> str:
    """The peer identity of a grpc.aio ``context``, as above ("" if gRPC cannot tell)."""
    try:
        auth = context.auth_context() or {}
    except Exception:
        auth = {}
    cn = auth.get("x509_common_name") or []
    if cn:
        raw = cn[0]
        return ("tls:" + (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)))[:MAX_PEER_CHARS]
    try:
        return peer_address(context.peer() or "")
    except Exception:
        return ""


def peer_address(peer: str) -> str:
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


MAX_FILE_BYTES = 1 << 20
MAX_CREDENTIALS = 10_000
ALL_TENANTS = "*"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TenantBook:
    def __init__(self, digests: dict[str, str] | None = None, tls: dict[str, str] | None = None):
        self._digests = dict(digests or {})        # sha256(token) -> tenant
        self._tls = dict(tls or {})                # certificate CN -> tenant

    @property
    def tenants(self) -> set[str]:
        return set(self._digests.values()) | set(self._tls.values())

    def by_token(self, token: str) -> str | None:
        return self._digests.get(token_digest(token))

    def by_tls(self, common_name: str) -> str | None:
        return self._tls.get(common_name)

    @classmethod
    def parse(cls, text: str, origin: str = "tenants file") -> TenantBook:
        digests: dict[str, str] = {}
        tls: dict[str, str] = {}
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"{origin}:{n}: expected '<tenant> <credential>'")
            tenant, cred = parts
            try:
                check_id("tenant", tenant)
            except InvalidIdError as e:
                raise ConfigError(f"{origin}:{n}: {e}") from None
            kind, _, value = cred.partition(":")
            if kind == "sha256":
                if len(value) != 64 or any(c not in "0123456789abcdef" for c in value.lower()):
                    raise ConfigError(f"{origin}:{n}: sha256: needs 64 hex digits")
                key, book = value.lower(), digests
            elif kind == "token":
                key, book = token_digest(check_token(value, f"{origin}:{n}")), digests
            elif kind == "tls" and 0 < len(value) <= 256:
                key, book = value, tls
            else:
                raise ConfigError(f"{origin}:{n}: a credential is sha256:<hex>, token:<token> or tls:<name>")
            if book.get(key, tenant) != tenant:
                raise ConfigError(f"{origin}:{n}: this credential already names tenant {book[key]!r}")
            book[key] = tenant
            if len(digests) + len(tls) > MAX_CREDENTIALS:
                raise ConfigError(f"{origin}: more than {MAX_CREDENTIALS} credentials")
        if not digests and not tls:
            raise ConfigError(f"{origin}: names no tenant")
        return cls(digests, tls)

    @classmethod
    def load(cls, path: str) -> TenantBook:
        try:
            st = os.stat(path)
            if st.st_size > MAX_FILE_BYTES:
                raise ConfigError(f"tenants file {path}: larger than {MAX_FILE_BYTES} bytes")
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"tenants file {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"tenants file {path}: not UTF-8 text") from None
        if "token:" in text and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("tenants_file_readable_by_others", path=path, mode=oct(st.st_mode & 0o777),
                        why="it holds bearer tokens in the clear (token:); prefer sha256: digests")
        return cls.parse(text, f"tenants file {path}")


READ_METHODS = frozenset({"ListGroups", "GetGroupStatus", "WatchGroup", "ListJobs", "GetProfiles"})


@dataclass(frozen=True)
class CallerConfig:
    require_read_auth: bool = False
    tenants_file: str | None = None
    max_watches: int = MAX_WATCHES
    max_watches_per_caller: int = MAX_WATCHES_PER_CALLER
    tls_client_ca: str | None = None       # require client certificates signed by this CA (mutual TLS)

    def __post_init__(self) -> None:
        Watches(self.max_watches, self.max_watches_per_caller)     # validates the bounds
        if self.tenants_file is not None:
            TenantBook.load(self.tenants_file)                     # a bad file fails start-up, not a call

    def tenant_book(self) -> TenantBook | None:
        return TenantBook.load(self.tenants_file) if self.tenants_file is not None else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--require-read-auth", type=parse_bool, default=False, nargs="?", const=True,
             help="ListGroups/GetGroupStatus/WatchGroup/ListJobs/GetProfiles need the admin token or a tenant's "
                  "(always so when --tenants-file is given)")
    env_flag(p, "--tenants-file", default=None,
             help="file naming each tenant's credentials (tokens, token digests, TLS identities); "
                  "turns tenancy on (see lockd/callers.py)")
    env_flag(p, "--tls-client-ca", default=None,
             help="CA bundle: with --tls-cert, callers must present a client certificate it signed; its "
                  "common name is the caller (per-caller limits) and, in the tenants file, a credential")
    env_flag(p, "--max-watches", type=int, default=MAX_WATCHES,
             help="WatchGroup streams open on this replica; beyond: RESOURCE_EXHAUSTED 'limit max_watches'")
    env_flag(p, "--max-watches-per-caller", type=int, default=MAX_WATCHES_PER_CALLER,
             help="WatchGroup streams of one caller (its credential, else its TLS identity or address); "
                  "beyond: RESOURCE_EXHAUSTED 'limit max_watches_per_caller'")


def from_args(a: argparse.Namespace) -> CallerConfig:
    return CallerConfig(require_read_auth=parse_bool(a.require_read_auth), tenants_file=a.tenants_file or None,
                        max_watches=int(a.max_watches), max_watches_per_caller=int(a.max_watches_per_caller),
                        tls_client_ca=a.tls_client_ca or None)


@dataclass(frozen=True)
class Caller:
    identity: str                 # what per-caller limits count under
    admin: bool = False           # presented the admin token: sees and may do everything
    tenant: str | None = None     # the tenant its credential names

    @property
    def authenticated(self) -> bool:
        return self.admin or self.tenant is not None


class Callers:
    def __init__(self, authority: Authority, config: CallerConfig = CallerConfig(), tenants=None):
        self.authority, self.config, self.tenants = authority, config, tenants

    @property
    def reads_need_credentials(self) -> bool:
        return self.config.require_read_auth or self.tenants is not None

    def of(self, context) -> Caller:
        """The caller of a grpc.aio ``context``; Unauthenticated if it presented an unknown token."""
        token = presented_token(context.invocation_metadata())
        peer = peer_identity(context)
        if token is not None:
            admin = self.authority.token
            if admin is not None and hmac.compare_digest(token.encode(), admin.encode()):
                return Caller("admin", admin=True)
            tenant = self.tenants.by_token(token) if self.tenants is not None else None
            if tenant is not None:
                return Caller(f"tenant:{tenant}", tenant=tenant)
            if self.reads_need_credentials:
                raise Unauthenticated("the bearer token is neither the admin token nor a tenant's; "
                                      "send a credential this server knows")
            # Credentials are optional here: a token meant for another server proves nothing, harms nothing.
        if self.tenants is not None and peer.startswith("tls:"):
            tenant = self.tenants.by_tls(peer[len("tls:"):])
            if tenant is not None:
                return Caller(f"tenant:{tenant}", tenant=tenant)
        return Caller(peer or "unknown")

    def reader(self, context) -> Caller:
        """The caller of a read; Unauthenticated when reads need a credential and it has none."""
        caller = self.of(context)
        if self.reads_need_credentials and not caller.authenticated:
            raise Unauthenticated("read call without credentials: this server needs the admin token or a "
                                  "tenant's ('authorization: Bearer <token>')")
        return caller
