"""``kvstore certs``: a CA and mutual-TLS certificates for a test or small cluster.

Every certificate is signed by the CA, is good for both server and client authentication,
and carries ``--server-name`` (default ``kvstore``, what clients check: see
:mod:`kvstore.tls`) plus ``localhost`` and the loopback addresses among its names; its common
name is the identity it was made for (``meta``, ``daemon``, ``client``, a tenant's name...).
Private keys are written with mode 0600. For production, sign with your own CA instead.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.errors import InvalidArgument

DEFAULT_NAMES = ("meta", "daemon", "client")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstore"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def make(
    out: str | os.PathLike, names: tuple[str, ...] = DEFAULT_NAMES, server_name: str = "kvstore", days: int = 365
) -> dict[str, Path]:
    """Writes ``ca.pem``/``ca.key`` (reused when present) and ``NAME.pem``/``NAME.key`` per name.
    Returns the files written, by name."""
    if days < 1:
        raise InvalidArgument(f"days must be positive, got {days}")
    bad = [n for n in names if not n or "/" in n or n.startswith(".")]
    if bad or not names:
        raise InvalidArgument(f"certificate names must be plain file names, got {list(names)}")
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_pem, ca_keyf = d / "ca.pem", d / "ca.key"
    if ca_pem.exists() and ca_keyf.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_keyf.read_bytes(), None)
    else:
        ca_key = _key()
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(_name("kvstore CA"))
            .issuer_name(_name("kvstore CA"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(ca_keyf, ca_key)
        ca_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    out_files: dict[str, Path] = {"ca": ca_pem}
    sans = [
        x509.DNSName(server_name),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    for n in names:
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(n))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(d / f"{n}.key", key)
        (d / f"{n}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out_files[n] = d / f"{n}.pem"
    return out_files
