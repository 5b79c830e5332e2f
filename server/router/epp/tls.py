"""The EPP's gRPC TLS: server credentials from PEM files (a kubernetes.io/tls Secret) or a self-signed certificate
made at startup, as GIE's reference picker does, and the optional client-certificate check; no sockets."""

from __future__ import annotations

import datetime
import logging
import socket
from pathlib import Path
from typing import Optional

import grpc

log = logging.getLogger(__name__)

SELF_SIGNED_DAYS = 3650  # the reference picker's lifetime too: it lives as long as the process


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {path}: not a PEM file")
    return data


def check_files(cert_file: Optional[str], key_file: Optional[str], client_ca_file: Optional[str]) -> None:
    """Each given file readable and PEM (ValueError naming the flag), before anything starts."""
    for path, flag in ((cert_file, "--tls-cert-file"), (key_file, "--tls-key-file"),
                       (client_ca_file, "--tls-client-ca-file")):
        if path:
            _read(path, flag)


def self_signed(hosts: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM): an ECDSA P-256 certificate for localhost, this host's name and `hosts`."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmfleet-epp")])
    dns, ips = {"localhost", socket.gethostname()}, {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    for h in hosts:
        try:
            ips.add(ipaddress.ip_address(h))
        except ValueError:
            dns.add(h)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
            .add_extension(x509.SubjectAlternativeName([*map(x509.DNSName, sorted(dns)),
                                                        *map(x509.IPAddress, sorted(ips, key=str))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def server_credentials(cert_file: Optional[str], key_file: Optional[str], client_ca_file: Optional[str],
                       hosts: tuple[str, ...] = ()) -> grpc.ServerCredentials:
    """TLS credentials of the gRPC port; with `client_ca_file`, clients must present a certificate it signed."""
    if cert_file and key_file:
        pair = (_read(key_file, "--tls-key-file"), _read(cert_file, "--tls-cert-file"))
    else:
        cert, key = self_signed(hosts)
        pair = (key, cert)
        log.info("gRPC TLS with a self-signed certificate made at startup (no --tls-cert-file given)")
    ca = _read(client_ca_file, "--tls-client-ca-file") if client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
