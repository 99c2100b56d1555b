"""A peer's hivemind identity key: RSA-2048, stored DER-encoded with mode 0600.

The agent creates the key before it joins (the coordinator binds the peer token to its public half)
and the worker loads it into hivemind (``workers.identity``). hivemind signs DHT requests and progress
records with this key, so the token, the requests and the progress records all name the same peer.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from volunteer_app.tokens import write_private_file


class IdentityError(RuntimeError):
    pass


def ensure_rsa_key(path: Path) -> rsa.RSAPrivateKey:
    """Load the RSA key at ``path``, creating it (mode 0600) if it does not exist."""
    if path.exists():
        try:
            key = serialization.load_der_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise IdentityError(
                f"peer key {path} is unreadable ({exc}); delete it to make a new one"
            ) from exc
        if not isinstance(key, rsa.RSAPrivateKey):
            raise IdentityError(f"peer key {path} is not an RSA key; delete it to make a new one")
        return key
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    write_private_file(path, der)
    return key


def public_key_openssh(key: rsa.RSAPrivateKey) -> str:
    """The public key as hivemind writes it (``RSAPublicKey.to_bytes()``): OpenSSH ``ssh-rsa AAAA…``."""
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
