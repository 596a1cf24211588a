"""The tenants file: which credentials name which tenant (``--tenants-file``; given, tenancy is on).

One credential per line, ``#`` starts a comment::

    # tenant   credential
    team-a     sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    team-a     tls:trainer-a.team-a          # a client certificate's common name (mutual TLS)
    team-b     token:a-long-random-bearer-token-of-team-b

* ``sha256:<hex>``: the SHA-256 of a bearer token (the file then holds no secret);
* ``token:<token>``: the token itself (kept only as its digest once read);
* ``tls:<common name>``: a client certificate lockd's TLS verified.

Tenant names follow the id grammar; ``*`` is reserved (a group open to every
tenant). A credential names one tenant: the same token or identity twice, under two
tenants, fails start-up. The admin token stays the superuser and is never listed here.
"""
from __future__ import annotations

import hashlib
import os
import stat

import structlog

from timeslice.common.errors import ConfigError, InvalidIdError
from timeslice.common.ids import check_id
from timeslice.common.server.auth import check_token

log = structlog.get_logger(__name__)

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
