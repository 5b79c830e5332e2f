"""PEM files for the TLS tests: a CA, a server certificate for 127.0.0.1/localhost and a client certificate, both
signed by it (cryptography, as the EPP's self-signed certificate is made)."""

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
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing of the above


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool, san: list | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def make_pki(d: Path) -> Pki:
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("ca", "server", "client", "other")}
    ca = _cert("test-ca", keys["ca"], "test-ca", keys["ca"], True)
    other = _cert("other-ca", keys["other"], "other-ca", keys["other"], True)
    server = _cert("epp", keys["server"], "test-ca", keys["ca"], False,
                   [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _cert("gateway", keys["client"], "test-ca", keys["ca"], False)
    return Pki(_write(d / "ca.crt", ca), _write(d / "tls.crt", server), _write(d / "tls.key", key=keys["server"]),
               _write(d / "client.crt", client), _write(d / "client.key", key=keys["client"]),
               _write(d / "other-ca.crt", other))
