"""Loading the peer's RSA identity into hivemind."""

from __future__ import annotations

from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from volunteer_app.identity import ensure_rsa_key


def load_hivemind_key(path: Path, *, process_wide: bool = True) -> RSAPrivateKey:
    """The key at ``path`` (created if missing) as a hivemind ``RSAPrivateKey``.

    With ``process_wide`` it also becomes hivemind's process-wide key, which the optimizer's progress
    tracker signs its DHT records with; the peer token is bound to this same key.
    """
    from cryptography.hazmat.primitives import serialization

    key = ensure_rsa_key(path)
    der = key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    hivemind_key = RSAPrivateKey.__new__(RSAPrivateKey)
    hivemind_key.__setstate__({"_private_key": der})
    if process_wide:
        with RSAPrivateKey._process_wide_key_lock:
            RSAPrivateKey._process_wide_key = hivemind_key
    return hivemind_key
