"""Certificates made at test time: a CA and the server and client certificates it signs (EC
P-256, valid for a day), written as PEM files; server certificates name 127.0.0.1 and
localhost."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


class CertAuthority:
    """A CA named `name` whose files live in `directory` (`<name>.pem`, `<name>-key.pem`)."""

    def __init__(self, directory: Path, name: str):
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = (self._builder(_name(name), self._key.public_key())
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(
                          digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.cert = directory / f"{name}.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey
                 ) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(_name(self.name))
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def issue(self, name: str, *, server: bool) -> CertFiles:
        """A certificate for `name`: a server's (for 127.0.0.1 and localhost) or a client's."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (self._builder(_name(name), key.public_key())
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        path = self.directory / f"{name}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return CertFiles(path, _write_key(key, self.directory / f"{name}-key.pem"))
