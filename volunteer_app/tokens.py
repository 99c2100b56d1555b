"""Signing and checking what the coordinator vouches for: peer tokens and volunteer credentials.

Both sides use this module: the coordinator signs with its Ed25519 :class:`SigningKey`; agents, the
worker's hivemind authorizer and the coordinator's own swarm peer check offline with the public keys
(:class:`VerifyingKeys`) they receive at join.

A **peer token** binds a run, a volunteer, a session and the worker's hivemind RSA public key until an
expiry. Its wire form is ``pt1.<claims>.<peer key>.<signature>`` (base64url parts). The same token fits
hivemind's ``AccessToken`` protobuf (``username`` = claims JSON, ``public_key`` = the RSA key in
OpenSSH form, ``expiration_time`` = ISO time, ``signature``), so ``TokenAuthorizerBase`` can carry it.
The signature covers a domain tag, the claims and the peer key, so neither can be swapped.

**Credentials** (volunteer and organizer) are random secrets shown once; the store keeps only their
SHA-256 (they carry 256 bits of entropy, so a slow hash adds nothing).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PEER_TOKEN_VERSION = "pt1"
_DOMAIN = b"volunteer-app/peer-token/v1\x00"
_MAX_TOKEN_CHARS = 8192


class TokenError(Exception):
    """A token or credential was refused. ``code`` is machine-readable, the message says what to do."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code = code
        self.detail = detail


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short stable id for a coordinator key (first 16 hex digits of the SHA-256 of its raw bytes)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_key_to_text(public_key: Ed25519PublicKey) -> str:
    return _b64e(public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def public_key_from_text(text: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(_b64d(text))
    except (ValueError, TypeError) as exc:
        raise TokenError("bad_public_key", f"not an Ed25519 public key: {exc}") from exc


class SigningKey:
    """The coordinator's Ed25519 signing key with its key id. Created once at ``init``, file mode 0600."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self.public_key = private_key.public_key()
        self.kid = key_id(self.public_key)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> SigningKey:
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise TokenError("bad_signing_key", f"cannot read signing key {path}: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise TokenError("bad_signing_key", f"{path} is not an Ed25519 private key")
        return cls(key)

    def save(self, path: Path) -> None:
        """Write the key as PKCS#8 PEM, readable by the owner only, without a window where it is not."""
        pem = self._private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_private_file(path, pem)

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(data)

    @property
    def public_key_text(self) -> str:
        return public_key_to_text(self.public_key)


def write_private_file(path: Path, data: bytes) -> None:
    """Atomically write ``data`` to ``path`` with mode 0600 (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class VerifyingKeys:
    """The coordinator public keys a checker trusts, by key id (several during a key rotation)."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey]):
        self._keys = dict(keys)

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, str]]) -> VerifyingKeys:
        """From ``[{"kid": ..., "public_key": ...}]`` as the join answer carries them."""
        keys = {}
        for record in records:
            public_key = public_key_from_text(record["public_key"])
            if key_id(public_key) != record["kid"]:
                raise TokenError("bad_public_key", f"key id {record['kid']!r} does not match its public key")
            keys[record["kid"]] = public_key
        return cls(keys)

    @classmethod
    def of(cls, *signing_keys: SigningKey) -> VerifyingKeys:
        return cls({k.kid: k.public_key for k in signing_keys})

    def get(self, kid: str) -> Ed25519PublicKey | None:
        return self._keys.get(kid)

    def records(self) -> list[dict[str, str]]:
        return [{"kid": kid, "public_key": public_key_to_text(k)} for kid, k in self._keys.items()]

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(frozen=True)
class PeerTokenClaims:
    """What a peer token says. Times are Unix seconds (hivemind's DHT time is ``time.time()``)."""

    kid: str
    run: str
    volunteer: str
    session: str
    issued_at: float
    expires_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> PeerTokenClaims:
        try:
            data = json.loads(text)
            return cls(
                kid=str(data["kid"]),
                run=str(data["run"]),
                volunteer=str(data["volunteer"]),
                session=str(data["session"]),
                issued_at=float(data["issued_at"]),
                expires_at=float(data["expires_at"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TokenError("malformed_token", f"peer token claims are malformed: {exc}") from exc


def _signed_message(claims_json: bytes, peer_public_key: bytes) -> bytes:
    return (
        _DOMAIN
        + len(claims_json).to_bytes(4, "big")
        + claims_json
        + len(peer_public_key).to_bytes(4, "big")
        + peer_public_key
    )


@dataclass(frozen=True)
class PeerToken:
    """A signed peer token. Build with :func:`issue_peer_token`; check with :func:`verify_peer_token`."""

    claims_json: bytes
    peer_public_key: bytes
    signature: bytes

    @property
    def claims(self) -> PeerTokenClaims:
        return PeerTokenClaims.from_json(self.claims_json)

    def encode(self) -> str:
        parts = (self.claims_json, self.peer_public_key, self.signature)
        return ".".join([PEER_TOKEN_VERSION, *(_b64e(p) for p in parts)])

    @classmethod
    def decode(cls, text: str) -> PeerToken:
        if not isinstance(text, str) or len(text) > _MAX_TOKEN_CHARS:
            raise TokenError("malformed_token", "peer token is not a string of a sensible length")
        parts = text.strip().split(".")
        if len(parts) != 4 or parts[0] != PEER_TOKEN_VERSION:
            raise TokenError(
                "malformed_token",
                f"peer token must look like {PEER_TOKEN_VERSION}.<claims>.<key>.<signature>",
            )
        try:
            claims_json, peer_key, signature = (_b64d(p) for p in parts[1:])
        except (ValueError, TypeError) as exc:
            raise TokenError("malformed_token", f"peer token is not valid base64url: {exc}") from exc
        return cls(claims_json, peer_key, signature)

    def access_token_fields(self) -> dict[str, object]:
        """Fields for ``hivemind.proto.auth_pb2.AccessToken(**fields)``."""
        expires = datetime.fromtimestamp(self.claims.expires_at, tz=timezone.utc)
        return {
            "username": self.claims_json.decode("utf-8"),
            "public_key": self.peer_public_key,
            "expiration_time": expires.isoformat(),
            "signature": self.signature,
        }

    @classmethod
    def from_access_token_fields(cls, *, username: str, public_key: bytes, signature: bytes) -> PeerToken:
        return cls(username.encode("utf-8"), bytes(public_key), bytes(signature))


def issue_peer_token(
    signing_key: SigningKey,
    *,
    run: str,
    volunteer: str,
    session: str,
    peer_public_key: bytes,
    ttl: float,
    now: float | None = None,
) -> PeerToken:
    """Sign a peer token for ``peer_public_key`` (the worker's hivemind RSA key, OpenSSH bytes)."""
    issued = time.time() if now is None else now
    claims = PeerTokenClaims(
        kid=signing_key.kid,
        run=run,
        volunteer=volunteer,
        session=session,
        issued_at=issued,
        expires_at=issued + ttl,
    )
    claims_json = claims.to_json().encode("utf-8")
    signature = signing_key.sign(_signed_message(claims_json, peer_public_key))
    return PeerToken(claims_json, bytes(peer_public_key), signature)


def verify_peer_token(
    token: PeerToken,
    keys: VerifyingKeys,
    *,
    run: str | None = None,
    peer_public_key: bytes | None = None,
    revoked_sessions: Iterable[str] = (),
    now: float | None = None,
    leeway: float = 0.0,
) -> PeerTokenClaims:
    """Check a peer token offline and return its claims, or raise :class:`TokenError`.

    :param run: the run the checker belongs to; a token for another run is ``wrong_run``.
    :param peer_public_key: the key the holder proved it owns; a token bound to another key is ``wrong_key``.
    :param revoked_sessions: sessions the coordinator revoked (a ban); their tokens are ``revoked_token``.
    :param leeway: seconds of clock skew tolerated past ``expires_at``.
    """
    try:
        claims = PeerTokenClaims.from_json(token.claims_json)
    except TokenError:
        raise
    public_key = keys.get(claims.kid)
    if public_key is None:
        raise TokenError("unknown_key", f"peer token is signed by unknown coordinator key {claims.kid!r}")
    try:
        public_key.verify(token.signature, _signed_message(token.claims_json, token.peer_public_key))
    except InvalidSignature as exc:
        raise TokenError(
            "forged_token", "peer token signature does not verify; it was not issued by this coordinator"
        ) from exc
    current = time.time() if now is None else now
    if current > claims.expires_at + leeway:
        raise TokenError("expired_token", "peer token has expired; the agent must refresh it or join again")
    if run is not None and claims.run != run:
        raise TokenError("wrong_run", f"peer token is for run {claims.run!r}, not {run!r}")
    if peer_public_key is not None and bytes(peer_public_key).strip() != token.peer_public_key.strip():
        raise TokenError("wrong_key", "peer token is bound to a different peer key")
    if claims.session in set(revoked_sessions):
        raise TokenError("revoked_token", "peer token was revoked by the coordinator")
    return claims


def new_secret(prefix: str) -> str:
    """A fresh credential such as ``vc_…`` (volunteer) or ``org_…`` (organizer): 256 random bits."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_secret(secret: str) -> str:
    """What the store keeps of a credential."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


_REVOCATION_DOMAIN = b"volunteer-app/revocation/v1\x00"


def sign_revocation(
    signing_key: SigningKey, *, run: str, session: str, expires_at: float
) -> dict[str, object]:
    """A revocation record the coordinator's swarm peer stores in the DHT so that every peer of ``run``
    refuses ``session``'s tokens before they expire (a ban)."""
    body = json.dumps(
        {"run": run, "session": session, "expires_at": expires_at, "kid": signing_key.kid}, sort_keys=True
    )
    return {"body": body, "signature": signing_key.sign(_REVOCATION_DOMAIN + body.encode("utf-8"))}


def verify_revocation(record: object, keys: VerifyingKeys, *, run: str) -> str:
    """The revoked session id from a DHT revocation record, or :class:`TokenError` if it is not genuine."""
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("body"), str)
        or not isinstance(record.get("signature"), bytes)
    ):
        raise TokenError("malformed_revocation", "revocation record is malformed")
    try:
        body = json.loads(record["body"])
        kid, record_run, session = str(body["kid"]), str(body["run"]), str(body["session"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenError("malformed_revocation", f"revocation record is malformed: {exc}") from exc
    public_key = keys.get(kid)
    if public_key is None:
        raise TokenError("unknown_key", f"revocation is signed by unknown key {kid!r}")
    try:
        public_key.verify(record["signature"], _REVOCATION_DOMAIN + record["body"].encode("utf-8"))
    except InvalidSignature as exc:
        raise TokenError("forged_revocation", "revocation record signature does not verify") from exc
    if record_run != run:
        raise TokenError("wrong_run", "revocation record is for another run")
    return session
