"""Certificates made at run time (the `cryptography` package) and the Envoy TLS transport sockets
that use them, for tests that run Envoys over TLS or mutual TLS (`contract/test_mesh_retries.py`).

`Pki(folder)` makes a CA (EC P-256, self-signed) and writes `ca.pem`; `issue(name, ...)` writes
`<name>.pem` and `<name>.key` for a leaf certificate signed by it with the given subject
alternative names (DNS names, IP addresses, URIs such as a SPIFFE id), valid from an hour ago for
a day. `downstream_tls` is a listener's transport socket (its certificate; with
`require_client=True` client certificates are required and verified against the CA);
`upstream_tls` a cluster's (the CA verifies the server; a certificate of its own makes it mTLS).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TLS_SOCKET = "envoy.transport_sockets.tls"
_TLS_TYPES = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."


@dataclass(frozen=True)
class Cert:
    """A certificate and its private key, as PEM files."""
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class Pki:
    def __init__(self, folder: Path, name: str = "idem-e2e test CA"):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        self._not_before = now - datetime.timedelta(hours=1)
        self._not_after = now + datetime.timedelta(days=1)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _name(name)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before).not_valid_after(self._not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.ca = self.folder / "ca.pem"
        self.ca.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
              uris: tuple[str, ...] = (), server: bool = False, client: bool = False) -> Cert:
        """A leaf certificate signed by the CA (CN `name`), usable as a server and/or a client
        certificate, with these subject alternative names (none at all if none is given)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + \
                 ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before).not_valid_after(self._not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                           critical=False)
        )
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        out = Cert(self.folder / f"{name}.pem", self.folder / f"{name}.key")
        out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, out.key)
        return out


def _common(cert: Cert | None, ca: Path | None, verify_san_ip: str | None = None) -> dict:
    common: dict = {}
    if cert is not None:
        common["tls_certificates"] = [{"certificate_chain": {"filename": str(cert.cert)},
                                       "private_key": {"filename": str(cert.key)}}]
    if ca is not None:
        validation: dict = {"trusted_ca": {"filename": str(ca)}}
        if verify_san_ip:
            validation["match_typed_subject_alt_names"] = [
                {"san_type": "IP_ADDRESS", "matcher": {"exact": verify_san_ip}}]
        common["validation_context"] = validation
    return common


def downstream_tls(cert: Cert, ca: Path | None = None, require_client: bool = False) -> dict:
    """A listener's TLS transport socket: `cert` as the server certificate; with `ca`, client
    certificates are verified against it, and with `require_client` a client without one is
    refused in the handshake."""
    return {"name": TLS_SOCKET, "typed_config": {
        "@type": _TLS_TYPES + "DownstreamTlsContext",
        "require_client_certificate": require_client,
        "common_tls_context": _common(cert, ca),
    }}


def upstream_tls(ca: Path, cert: Cert | None = None, sni: str = "localhost",
                 verify_san_ip: str | None = "127.0.0.1") -> dict:
    """A cluster's TLS transport socket: the server's certificate verified against `ca` (and its
    IP address SAN when `verify_san_ip`), `cert` sent as the client certificate (mTLS)."""
    return {"name": TLS_SOCKET, "typed_config": {
        "@type": _TLS_TYPES + "UpstreamTlsContext",
        "sni": sni,
        "common_tls_context": _common(cert, ca, verify_san_ip),
    }}
