"""Who may call an `xlaserve worker`, and how the front end proves it is allowed.

A worker takes tenant and tier from its caller (the front end has checked the JWT, the rate
limits and the quotas), so whoever reaches it unauthenticated skips all of that.  TLS keeps
the hop private; a client certificate (mTLS) and a bearer token, either or both, authenticate
the caller:

    front end (RemoteEngine, [grpc] table)          worker (`xlaserve worker` flags)
    tls_ca: the CA that signed the     ── TLS ───>  --tls-cert / --tls-key
      workers' certificates
    tls_cert / tls_key: a client       ── mTLS ──>  --tls-client-ca: the handshake fails
      certificate                                     without a certificate this CA signed
    $XLASERVE_GRPC_TOKEN (or the       ── `authorization: Bearer <token>` on every call ──>
      variable token_env names)                     the same variable (or --token-env NAME);
                                                      a Generation call without it, or with
                                                      another, gets UNAUTHENTICATED

The token lives in the environment only, never in a file; both sides name the variable.  Two
services need no token (under mTLS they need the client certificate like every call): health
(grpc.health.v1), since probes seldom carry one and it says no more than SERVING /
NOT_SERVING, and server reflection (grpc.reflection.v1alpha), so that `grpcurl list` works,
since it tells only the service schema that xlaserve.proto publishes anyway.  Every
Generation method needs the token.

Where a worker may listen: one that authenticates nobody (no token, no client CA) binds
loopback only, and one bound beyond loopback also serves TLS, so that its token never crosses
the network in the clear.  The front end likewise dials a non-loopback worker over TLS only;
to a loopback worker without TLS it sends its token over gRPC's local credentials, which
refuse a peer that is not local.
"""

from __future__ import annotations

import hmac
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from xlaserve.serving.server_config import GrpcClientConfig, is_loopback, target_host

DEFAULT_TOKEN_ENV = "XLASERVE_GRPC_TOKEN"
MIN_TOKEN_CHARS = 16
OPEN_SERVICES = (  # method prefixes served without a token
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: a metadata value


def read_token(env: str | None) -> str:
    """The bearer token in the environment variable `env`; `None` reads DEFAULT_TOKEN_ENV
    and gives "" when it is unset, a variable named explicitly must be set.  Errors name the
    variable, never its value."""
    name = env or DEFAULT_TOKEN_ENV
    token = os.environ.get(name, "")
    if not token:
        if env:
            raise ValueError(f"the gRPC token variable ${name} is not set or empty")
        return ""
    if len(token) < MIN_TOKEN_CHARS or not _TOKEN_CHARS.fullmatch(token):
        raise ValueError(f"the gRPC token in ${name} must be at least {MIN_TOKEN_CHARS} "
                         f"printable ASCII characters without spaces (it has {len(token)}); "
                         "e.g. `openssl rand -hex 32`")
    return token


def _read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path!r}: {e.strerror or e}") from None


def _check_pair(cert: str, key: str, what: str) -> None:
    """Fail now, naming the files, when `key` is not the private key of `cert`."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"{what} {cert!r} / {key!r}: not a PEM certificate and its "
                         f"private key ({e})") from None


# -- the worker side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerAuth:
    """A worker's credentials, PEM contents read at construction (`load`): its certificate
    chain and key (TLS), the CA its callers' certificates must be signed by (mTLS), and the
    bearer token they must send.  The default authenticates nobody: loopback only."""

    cert_chain: bytes = b""
    private_key: bytes = field(default=b"", repr=False)
    client_ca: bytes = b""
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        _check_tls_parts(bool(self.cert_chain), bool(self.private_key), bool(self.client_ca))

    @classmethod
    def load(cls, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "",
             token_env: str | None = None) -> WorkerAuth:
        """Read the PEM files (checking that key and certificate match) and the token (see
        `read_token`)."""
        _check_tls_parts(bool(tls_cert), bool(tls_key), bool(tls_client_ca))
        if tls_cert:
            _check_pair(tls_cert, tls_key, "--tls-cert / --tls-key")
        return cls(cert_chain=_read_pem(tls_cert, "--tls-cert") if tls_cert else b"",
                   private_key=_read_pem(tls_key, "--tls-key") if tls_key else b"",
                   client_ca=_read_pem(tls_client_ca, "--tls-client-ca") if tls_client_ca
                   else b"",
                   token=read_token(token_env))

    @property
    def authenticates(self) -> bool:
        return bool(self.token or self.client_ca)

    def check_bind(self, host: str) -> None:
        """Refuse (ValueError) to listen on `host` beyond loopback without TLS and a way to
        authenticate callers."""
        if is_loopback(host):
            return
        if not self.authenticates:
            raise ValueError(
                f"--host {host!r} is not a loopback address and this worker authenticates "
                f"no caller: anyone reaching it could call it as any tenant.  Serve TLS "
                f"(--tls-cert, --tls-key) and set a token (${DEFAULT_TOKEN_ENV}, or the "
                f"variable --token-env names) and/or require client certificates "
                f"(--tls-client-ca); or bind 127.0.0.1")
        if not self.cert_chain:
            raise ValueError(
                f"--host {host!r} is not a loopback address: serve TLS (--tls-cert, "
                f"--tls-key) so that the token does not cross the network in the clear; or "
                f"bind 127.0.0.1")

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address`, over TLS when there is a certificate; returns the port."""
        if not self.cert_chain:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca or None,
            require_client_auth=bool(self.client_ca))
        return server.add_secure_port(address, creds)


def _check_tls_parts(cert: bool, key: bool, client_ca: bool) -> None:
    if cert != key:
        raise ValueError("--tls-cert and --tls-key must be given together")
    if client_ca and not cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client "
                         "certificates are checked in the TLS handshake")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call but health's and reflection's that does not carry
    `authorization: Bearer <token>` (compared in constant time)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (handler is None or details.method.startswith(OPEN_SERVICES)
                or self._carries_token(details.invocation_metadata)):
            return handler
        return _refusing(handler)

    def _carries_token(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        sent = next((v for k, v in metadata or () if k == "authorization"), "")
        return hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent,
                                   self._expected)


async def _unauthenticated(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token (metadata 'authorization: Bearer ...')")


_HANDLER_OF_KIND = {  # (request_streaming, response_streaming) -> handler constructor
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED."""
    make = _HANDLER_OF_KIND[(handler.request_streaming, handler.response_streaming)]
    return make(_unauthenticated, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


# -- the front-end side ------------------------------------------------------------------------


def channel_credentials(config: GrpcClientConfig, target: str
                        ) -> grpc.ChannelCredentials | None:
    """How the front end dials the worker at `target` ("host:port"): TLS when `tls_ca` is
    set (with the client certificate when given), else gRPC's local credentials when there is
    a token to send (loopback only); None: a plain channel (loopback, nothing to send).  The
    token rides on every call as `authorization: Bearer <token>`."""
    config.check_target(target)
    token = read_token(config.token_env or None)
    if config.tls_ca:
        if config.tls_cert:
            _check_pair(config.tls_cert, config.tls_key, "[grpc] tls_cert / tls_key")
        creds = grpc.ssl_channel_credentials(
            _read_pem(config.tls_ca, "[grpc] tls_ca"),
            _read_pem(config.tls_key, "[grpc] tls_key") if config.tls_key else None,
            _read_pem(config.tls_cert, "[grpc] tls_cert") if config.tls_cert else None)
        if not (token or config.tls_cert or is_loopback(target_host(target))):
            raise ValueError(
                f"grpc://{target}: no token (${config.token_env or DEFAULT_TOKEN_ENV} is not "
                f"set) and no client certificate ([grpc] tls_cert): a worker beyond loopback "
                f"answers such a caller UNAUTHENTICATED or fails its handshake")
    elif token:
        creds = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    else:
        return None
    if token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(token))
    return creds
