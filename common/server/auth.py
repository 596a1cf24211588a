"""Who may call what: the admin bearer token, and the gate every server puts in front of its servicer.

The admin credential is one shared bearer token (gRPC metadata
``authorization: Bearer <token>``). A server reads it from ``--admin-token-file``
(``TIMESLICE_ADMIN_TOKEN_FILE``) or, failing that, from ``TIMESLICE_ADMIN_TOKEN``
(environment only: a secret never goes on a command line). ``timeslice up``
generates one into its run folder (mode 0600).

``Gate`` is a gRPC server interceptor that, for every method:

- refuses a *protected* method unless the caller presents the token
  (UNAUTHENTICATED), or PERMISSION_DENIED when the server has no token at all
  and was not started with the explicit insecure flag: the safe default is
  "admin calls are off", never "admin calls are open";
- turns a request that does not parse into INVALID_ARGUMENT (gRPC's own answer
  is UNKNOWN naming a Python exception class).
"""
from __future__ import annotations

import hmac
import os
import stat
from dataclasses import dataclass

import grpc
import structlog

from timeslice.common.errors import ConfigError

log = structlog.get_logger(__name__)

ENV_ADMIN_TOKEN = "TIMESLICE_ADMIN_TOKEN"
ENV_ADMIN_TOKEN_FILE = "TIMESLICE_ADMIN_TOKEN_FILE"
TOKEN_FILE_NAME = "admin-token"
MIN_TOKEN_LEN = 16
MAX_TOKEN_LEN = 1024
_SCHEME = "bearer "


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace removed); refuses a short or oversized one."""
    try:
        st = os.stat(path)
        if st.st_size > MAX_TOKEN_LEN + 64:
            raise ConfigError(f"admin token file {path}: larger than {MAX_TOKEN_LEN} bytes")
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"admin token file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"admin token file {path}: not UTF-8 text") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("admin_token_file_readable_by_others", path=path, mode=oct(st.st_mode & 0o777))
    return check_token(token, f"admin token file {path}")


def check_token(token: str, origin: str) -> str:
    if not MIN_TOKEN_LEN <= len(token) <= MAX_TOKEN_LEN or not token.isprintable() or " " in token:
        raise ConfigError(f"{origin}: a token is {MIN_TOKEN_LEN}..{MAX_TOKEN_LEN} printable characters "
                          "without spaces")
    return token


def load_admin_token(path: str | None) -> str | None:
    """The configured admin token: ``path`` if given, else $TIMESLICE_ADMIN_TOKEN, else None."""
    if path:
        return read_token_file(path)
    env = os.environ.get(ENV_ADMIN_TOKEN)
    if env:
        return check_token(env.strip(), f"${ENV_ADMIN_TOKEN}")
    return None


def write_token_file(path: str | os.PathLike, token: str) -> None:
    """Write ``token`` to ``path`` with mode 0600 from the first byte (never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


def presented_token(metadata) -> str | None:
    """The bearer token in a call's metadata, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:len(_SCHEME)].lower() == _SCHEME:
            return value[len(_SCHEME):].strip()
    return None


def configured_authority(token_file: str | None, insecure: bool, event: str, refused: str) -> Authority:
    """A server's ``Authority`` from its flags; with no token configured it says so: ``<event>_open``
    (--insecure-no-admin-auth) or ``<event>_disabled`` (``refused`` are refused)."""
    a = Authority(load_admin_token(token_file), insecure)
    if a.token is None:
        log.warning(f"{event}_" + ("open" if a.insecure else "disabled"),
                    why="no admin token configured" + (" and --insecure-no-admin-auth given" if a.insecure
                                                       else f"; {refused} are refused"))
    return a


@dataclass(frozen=True)
class Authority:
    """The admin token a server holds (None: none configured) and whether it runs without one on purpose."""

    token: str | None
    insecure: bool = False

    def check(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        """None when the caller may make an admin call, else (status, why)."""
        if self.insecure:
            return None
        if self.token is None:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    "admin calls are disabled: this server has no admin token (give it --admin-token-file or "
                    f"${ENV_ADMIN_TOKEN}; or, for a throw-away test setup only, the insecure flag)")
        got = presented_token(metadata)
        if got is None:
            return grpc.StatusCode.UNAUTHENTICATED, "admin call without credentials: send 'authorization: Bearer <token>'"
        if not hmac.compare_digest(got.encode(), self.token.encode()):
            return grpc.StatusCode.UNAUTHENTICATED, "admin call with a wrong admin token"
        return None

    def allows(self, context) -> bool:
        return self.check(context.invocation_metadata()) is None


class _Malformed:
    __slots__ = ("type_name",)

    def __init__(self, type_name: str):
        self.type_name = type_name


def _safe_deserializer(deser):
    if deser is None:
        return None
    name = getattr(getattr(deser, "__self__", None), "__name__", "request")

    def parse(data: bytes):
        try:
            return deser(data)
        except Exception:  # any parse failure is the caller's malformed bytes
            return _Malformed(name)
    return parse


class Gate(grpc.aio.ServerInterceptor):
    """Admin check for ``protected`` methods (by bare method name), malformed-request check for all."""

    def __init__(self, authority: Authority, protected: frozenset[str]):
        self.authority, self.protected = authority, protected
        self._wrapped: dict[str, tuple[object, object]] = {}     # method -> (handler, wrapped handler)

    async def _refusal(self, method: str, request, context) -> tuple[grpc.StatusCode, str] | None:
        if method in self.protected:
            why = self.authority.check(context.invocation_metadata())
            if why is not None:
                log.warning("admin_call_refused", method=method, code=why[0].name, peer=context.peer()[:80])
                return why
        if isinstance(request, _Malformed):
            return grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: the bytes are no valid {request.type_name}"
        return None

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        # Wrap each method's handler once, not per call (the hot path is a few etcd round trips).
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(details.method.rpartition("/")[2], handler)
        if len(self._wrapped) < 256:
            self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, original):
        gate = self._refusal
        if original.unary_unary is None and original.unary_stream is None:
            # Client-streaming methods: none exist; a protected one must not slip through unchecked.
            if method not in self.protected:
                return original

            async def refuse(_requests, context):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method} cannot be admitted here")
            return grpc.stream_unary_rpc_method_handler(refuse)
        handler = original._replace(request_deserializer=_safe_deserializer(original.request_deserializer))
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                why = await gate(method, request, context)
                if why is not None:
                    await context.abort(*why)
                return await inner(request, context)
            return handler._replace(unary_unary=unary)
        inner_s = handler.unary_stream

        async def stream(request, context):
            why = await gate(method, request, context)
            if why is not None:
                await context.abort(*why)
            async for item in inner_s(request, context):
                yield item
        return handler._replace(unary_stream=stream)
