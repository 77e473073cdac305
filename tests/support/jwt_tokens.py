"""JWTs for the identity tests: an RSA signing key made at run time, its JWKS, RS256 tokens.

Only the `cryptography` package (tests/requirements.txt); the JWT encoding (RFC 7515/7519
compact serialization) is done here so that a test can also build tokens no library would
(a forged signature, an expired or wrong-audience token, claims of any shape).
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _uint(n: int) -> str:
    return b64url(n.to_bytes((n.bit_length() + 7) // 8, "big"))


@dataclass
class SigningKey:
    """An RSA key (2048 bits) with a key id; `jwk()` is its public half as a JWK."""

    kid: str
    key: rsa.RSAPrivateKey = field(
        default_factory=lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048))

    def jwk(self) -> dict:
        pub = self.key.public_key().public_numbers()
        return {"kty": "RSA", "alg": "RS256", "use": "sig", "kid": self.kid, "n": _uint(pub.n), "e": _uint(pub.e)}

    def sign(self, claims: dict, header: dict | None = None) -> str:
        """A compact RS256 JWS over `claims` (JSON), with `kid` in the header."""
        hdr = {"alg": "RS256", "typ": "JWT", "kid": self.kid}
        hdr.update(header or {})
        signing_input = f"{b64url(json.dumps(hdr).encode())}.{b64url(json.dumps(claims).encode())}"
        sig = self.key.sign(signing_input.encode("ascii"), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{b64url(sig)}"


def jwks(*keys: SigningKey) -> str:
    """The JSON Web Key Set of the keys' public halves, as jwt_authn's `local_jwks` takes it."""
    return json.dumps({"keys": [k.jwk() for k in keys]})


def claims(sub: str | int | None, iss: str, aud: str, ttl: int = 3600, **extra) -> dict:
    """Registered claims for a token valid from now for `ttl` seconds (negative: expired)."""
    now = int(time.time())
    doc = {"iss": iss, "aud": aud, "iat": now, "exp": now + ttl}
    if sub is not None:
        doc["sub"] = sub
    doc.update(extra)
    return doc


def bearer(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")
