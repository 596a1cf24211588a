"""Who is calling a read (or opening a session): the credential presented, and the name limits count under.

A caller presents at most one bearer token (``authorization: Bearer <token>``): the
admin token (the superuser), or a tenant's token (``lockd/tenants.py``); with mutual
TLS, a client certificate whose identity the tenants file names counts as that
tenant's credential too. Without a credential a caller is known only by its address
(``lockd/peers.py``).

* ``identity`` is what per-caller limits count under (open WatchGroup streams):
  ``admin``, ``tenant:<name>``, else the peer identity;
* with ``--require-read-auth`` (and always when tenants are configured), the reads
  (ListGroups, GetGroupStatus, WatchGroup, ListJobs, GetProfiles) need a credential:
  UNAUTHENTICATED without one;
* where credentials are needed, a token this server does not know is refused
  (UNAUTHENTICATED), never taken for "no credential"; where they are optional, it
  counts for nothing.
"""
from __future__ import annotations

import argparse
import hmac
from dataclasses import dataclass

from timeslice.common.server.auth import Authority, presented_token
from timeslice.common.server.serving import env_flag, parse_bool
from timeslice.lockd import peers
from timeslice.lockd.errors import Unauthenticated
from timeslice.lockd.tenants import TenantBook
from timeslice.lockd.watches import MAX_WATCHES, MAX_WATCHES_PER_CALLER, Watches

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
                  "turns tenancy on (see lockd/tenants.py)")
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
        peer = peers.identity(context)
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
