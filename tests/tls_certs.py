"""Test-only TLS material, made at test time (nothing private is committed): a CA, a server
certificate for 127.0.0.1/localhost, and a client certificate, as PEM files in a folder."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER, CLIENT = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)
    path.chmod(0o600)


def _certificate(subject: str, key, issuer: x509.Name, issuer_key, *, ca: bool, usage=None) -> x509.Certificate:  # type: ignore[no-untyped-def]
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject)).issuer_name(issuer).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )  # fmt: skip
    if usage is not None:
        sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_tls_files(folder: Path) -> TlsFiles:
    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(*(folder / name for name in ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("sparkwire test CA", ca_key, _name("sparkwire test CA"), ca_key, ca=True)
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for cert_path, key_path, usage in ((files.server_cert, files.server_key, [SERVER, CLIENT]),
                                       (files.client_cert, files.client_key, [CLIENT])):  # fmt: skip
        key = ec.generate_private_key(ec.SECP256R1())
        # Both get the loopback names; a server's certificate is also a client's on cluster routes.
        cert = _certificate("sparkwire test", key, ca.subject, ca_key, ca=False, usage=usage)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
    return files
