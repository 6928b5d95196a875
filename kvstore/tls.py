"""Transport security: mutual TLS for every gRPC server and channel (metadata service, daemon
control API) and for the TCP data port, from PEM files named in the ``tls`` config section.

Every peer (service, daemon, client) holds a certificate signed by the cluster's CA and checks
the other side's against it: a server requires a client certificate, a client requires the
server's to carry ``tls.server_name`` (default ``kvstore``) among its names, so one name serves
a cluster whose addresses change. ``kvstore certs`` makes a CA and such certificates for a test
cluster (:mod:`kvstore.certs`).

Without TLS configured, servers listen in plaintext only on loopback addresses, unless
``tls.allow_plaintext`` says the network is trusted.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.errors import InvalidArgument


@dataclass
class TlsConfig:
    # PEM files: the CA that signs every peer of the cluster, this process's certificate
    # (chain) and its private key. All three, or none (plaintext).
    ca: str = ""
    cert: str = ""
    key: str = ""
    # The name every server certificate carries (a subject alternative name), checked by clients.
    server_name: str = "kvstore"
    # Listen without TLS on non-loopback addresses (a network trusted by other means).
    allow_plaintext: bool = False
    # Data port: after the TLS handshake, carry the bulk bytes in sealed records of up to 1 MiB
    # (kvstore.transport.sealed) instead of 16 KiB TLS records. A client setting; daemons
    # accept both.
    sealed_records: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key)


def validate(tls: TlsConfig) -> None:
    """All three files or none; each one readable PEM."""
    given = {"tls.ca": tls.ca, "tls.cert": tls.cert, "tls.key": tls.key}
    if not tls.enabled:
        return
    missing = [k for k, v in given.items() if not v]
    if missing:
        raise InvalidArgument(f"{', '.join(missing)}: TLS needs tls.ca, tls.cert and tls.key together")
    for k, v in given.items():
        try:
            data = Path(v).read_bytes()
        except OSError as e:
            raise InvalidArgument(f"{k}: cannot read {v}: {e.strerror}") from None
        if b"-----BEGIN " not in data:
            raise InvalidArgument(f"{k}: {v} is not a PEM file")
    if not tls.server_name:
        raise InvalidArgument("tls.server_name must not be empty")


def _read(tls: TlsConfig) -> tuple[bytes, bytes, bytes]:
    validate(tls)
    return Path(tls.ca).read_bytes(), Path(tls.cert).read_bytes(), Path(tls.key).read_bytes()


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(addr: str) -> str:
    """The host of ``host:port`` (an IPv6 literal without its brackets)."""
    return (addr.rpartition(":")[0] if ":" in addr else addr).strip("[]")


def check_listen(addr: str, tls: TlsConfig | None, what: str) -> None:
    """Refuses a plaintext listener on a non-loopback address unless allowed."""
    tls = tls or TlsConfig()
    if tls.enabled or tls.allow_plaintext or is_loopback(host_of(addr)):
        return
    raise InvalidArgument(
        f"{what}: refusing to listen in plaintext on {addr}: set tls.ca, tls.cert and tls.key "
        "(kvstore certs makes them), or tls.allow_plaintext=true on a network trusted by other means"
    )


# ---- gRPC ------------------------------------------------------------------------------------


def add_port(server: grpc.aio.Server, addr: str, tls: TlsConfig | None, what: str) -> int:
    """Binds ``server`` to ``addr``: mutual TLS when configured (a client certificate signed by
    the CA is required), else plaintext where :func:`check_listen` allows it."""
    check_listen(addr, tls, what)
    if tls is None or not tls.enabled:
        return server.add_insecure_port(addr)
    ca, cert, key = _read(tls)
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return server.add_secure_port(addr, creds)


def _bearer(details, token: str):  # noqa: ANN001, ANN202 - grpc's ClientCallDetails
    """``details`` with ``authorization: Bearer <token>`` added (see kvstore.meta.auth)."""
    return details._replace(metadata=[*(details.metadata or []), ("authorization", f"Bearer {token}")])


# A channel sorts each interceptor into one kind of call only, hence one class per kind used.
class _Token(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return await continuation(_bearer(details, self.token), request)


class _TokenStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return await continuation(_bearer(details, self.token), request_iterator)


def aio_channel(
    addr: str, tls: TlsConfig | None, options: list[tuple[str, object]], token: str = ""
) -> grpc.aio.Channel:
    """A channel to a kvstore server: mutual TLS when configured, and a bearer token on every
    call when given."""
    icpt = [_Token(token), _TokenStream(token)] if token else None
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(addr, options=options, interceptors=icpt)
    ca, cert, key = _read(tls)
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    opts = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.aio.secure_channel(addr, creds, options=opts, interceptors=icpt)


# ---- data port -------------------------------------------------------------------------------


def _context(tls: TlsConfig, protocol: int) -> ssl.SSLContext:
    """TLS 1.3 (or 1.2) with this process's certificate, the peer's required and checked
    against the CA (a client also checks the server's name, PROTOCOL_TLS_CLIENT's default)."""
    validate(tls)
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(tls.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """The data port's side: a client certificate is required. No TLS 1.3 session tickets:
    nothing resumes, and after a switch to sealed records (kvstore.transport.sealed) no TLS
    record may follow the upgrade's answer."""
    ctx = _context(tls, ssl.PROTOCOL_TLS_SERVER)
    ctx.num_tickets = 0
    return ctx


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    return _context(tls, ssl.PROTOCOL_TLS_CLIENT)
