"""A throwaway PKI for TLS tests and the auth bench, generated with ``cryptography`` (a dev dependency):
a test CA, a server certificate for 127.0.0.1 / localhost signed by it, a client certificate signed by
it (mutual TLS), and an unrelated CA (a client trusting only that one must fail)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    """Paths of PEM files."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(
    subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, san=None
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_pair(folder: Path, stem: str, cert: x509.Certificate, key) -> tuple[str, str]:
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def write_test_pki(folder: str | Path) -> Pki:
    """Generate the PKI into ``folder`` (existing); returns the file paths."""
    folder = Path(folder)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("forkline test CA", ca_key, _name("forkline test CA"), ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert(
        "localhost",
        server_key,
        ca.subject,
        ca_key,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert("forkline test client", client_key, ca.subject, ca_key)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _cert("unrelated CA", other_key, _name("unrelated CA"), other_key, ca=True)
    ca_path, _ = _write_pair(folder, "ca", ca, ca_key)
    other_path, _ = _write_pair(folder, "other", other, other_key)
    return Pki(
        ca_path,
        *_write_pair(folder, "server", server, server_key),
        *_write_pair(folder, "client", client, client_key),
        other_path,
    )
