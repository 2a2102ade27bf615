"""Throwaway certificates for tests: a CA, a server cert for localhost, a client cert, and a client
cert from an unrelated CA (which a mutual-TLS server must refuse). Needs the `cryptography`
package (the `test` extra). EC P-256 keys keep generation in the milliseconds.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertificateSet:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    foreign_client_cert: Path  # signed by another CA
    foreign_client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=7))
    )


def _make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issue(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    common_name: str,
    usage: x509.ObjectIdentifier,
    hosts: tuple[str, ...] = (),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(common_name, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_test_certificates(
    directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
) -> CertificateSet:
    """Write PEM files into `directory` and return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca = _make_ca("specdec test CA")
    server = _issue(ca, "localhost", ExtendedKeyUsageOID.SERVER_AUTH, hosts)
    client = _issue(ca, "specdec-test-client", ExtendedKeyUsageOID.CLIENT_AUTH)
    foreign = _issue(_make_ca("unrelated CA"), "intruder", ExtendedKeyUsageOID.CLIENT_AUTH)
    return CertificateSet(
        ca_cert=_write_cert(ca[0], directory / "ca.pem"),
        server_cert=_write_cert(server[0], directory / "server.pem"),
        server_key=_write_key(server[1], directory / "server.key"),
        client_cert=_write_cert(client[0], directory / "client.pem"),
        client_key=_write_key(client[1], directory / "client.key"),
        foreign_client_cert=_write_cert(foreign[0], directory / "foreign-client.pem"),
        foreign_client_key=_write_key(foreign[1], directory / "foreign-client.key"),
    )
