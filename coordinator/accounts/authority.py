"""The token authority: the coordinator's signing keys, the organizer token, volunteer credentials and
peer tokens.

Private keys live in ``DATA_DIR/keys/<kid>.pem`` (mode 0600); the store records their public halves so
that old keys keep verifying tokens during a rotation. Credentials are stored as hashes only.
"""

from __future__ import annotations

import hmac
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.errors import Forbidden, Unauthorized
from coordinator.models import Credential, SigningKeyRecord, Volunteer
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store
from volunteer_app.tokens import (
    PeerToken,
    SigningKey,
    TokenError,
    VerifyingKeys,
    hash_secret,
    issue_peer_token,
    new_secret,
    public_key_from_text,
    verify_peer_token,
    write_private_file,
)


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Caller:
    """An authenticated credential: its id, kind (volunteer or organizer) and volunteer."""

    id: str
    kind: str
    volunteer_id: str | None


@dataclass(frozen=True)
class InitResult:
    created_key: bool
    admin_token: str | None
    """The organizer token if this call created it (it is shown once), else None."""


class TokenAuthority:
    """Issues and checks everything the coordinator signs. Build with :meth:`open` after ``init``."""

    def __init__(self, *, settings: CoordinatorSettings, store: Store):
        self.settings = settings
        self.store = store
        self._signing_key: SigningKey | None = None
        self._verifying: VerifyingKeys | None = None

    # ------------------------------------------------------------------ keys
    def key_path(self, kid: str) -> Path:
        return self.settings.keys_dir / f"{kid}.pem"

    def initialize(self, *, rotate_admin_token: bool = False) -> InitResult:
        """Create the signing key and organizer token if missing. Safe to call on every start."""
        created_key = False
        admin_token = None
        with self.store.write() as db:
            active = db.scalars(select(SigningKeyRecord).where(SigningKeyRecord.active)).first()
            if active is None or not self.key_path(active.kid).exists():
                if active is not None:
                    active.active = False
                    active.retired_at = time.time()
                key = SigningKey.generate()
                key.save(self.key_path(key.kid))
                db.add(
                    SigningKeyRecord(
                        kid=key.kid, public_key=key.public_key_text, created_at=time.time(), active=True
                    )
                )
                created_key = True
            organizer = db.scalars(
                select(Credential).where(Credential.kind == "organizer", Credential.revoked_at.is_(None))
            ).first()
            if organizer is None or rotate_admin_token:
                if organizer is not None:
                    organizer.revoked_at = time.time()
                admin_token = new_secret("org")
                db.add(
                    Credential(
                        id=new_id(),
                        kind="organizer",
                        secret_hash=hash_secret(admin_token),
                        created_at=time.time(),
                    )
                )
                write_private_file(self.settings.admin_token_path, (admin_token + "\n").encode())
        self._signing_key = None
        self._verifying = None
        return InitResult(created_key=created_key, admin_token=admin_token)

    def rotate_signing_key(self) -> str:
        """Make a new active key; old ones keep verifying until their tokens expire. Returns the new kid."""
        key = SigningKey.generate()
        key.save(self.key_path(key.kid))
        with self.store.write() as db:
            for record in db.scalars(select(SigningKeyRecord).where(SigningKeyRecord.active)):
                record.active = False
                record.retired_at = time.time()
            db.add(
                SigningKeyRecord(
                    kid=key.kid, public_key=key.public_key_text, created_at=time.time(), active=True
                )
            )
        self._signing_key = None
        self._verifying = None
        return key.kid

    @property
    def signing_key(self) -> SigningKey:
        if self._signing_key is None:
            with self.store.read() as db:
                record = db.scalars(select(SigningKeyRecord).where(SigningKeyRecord.active)).first()
            if record is None:
                raise RuntimeError(
                    "the coordinator has no signing key; run `volunteer-coordinator init` first"
                )
            self._signing_key = SigningKey.load(self.key_path(record.kid))
        return self._signing_key

    @property
    def verifying_keys(self) -> VerifyingKeys:
        """Keys that still verify tokens: the active key and keys retired less than a token lifetime ago."""
        if self._verifying is None:
            horizon = time.time() - self.settings.tokens.peer_token_ttl - self.settings.tokens.refresh_grace
            with self.store.read() as db:
                records = db.scalars(select(SigningKeyRecord)).all()
            self._verifying = VerifyingKeys(
                {
                    r.kid: public_key_from_text(r.public_key)
                    for r in records
                    if r.active or (r.retired_at is not None and r.retired_at > horizon)
                }
            )
        return self._verifying

    # ------------------------------------------------------------------ credentials
    @staticmethod
    def authenticate(db: Session, secret: str | None, *, kind: str) -> Caller:
        """Who is calling: 401 for a missing or unknown credential, 403 if revoked or the volunteer is banned.

        One indexed query; every authenticated request pays for it, so it reads no more than it needs.
        """
        if not secret:
            raise Unauthorized(
                "missing credential: send `Authorization: Bearer <credential>`", code="missing_credential"
            )
        row = db.execute(
            select(
                Credential.id,
                Credential.kind,
                Credential.volunteer_id,
                Credential.revoked_at,
                Volunteer.banned_at,
            )
            .outerjoin(Volunteer, Volunteer.id == Credential.volunteer_id)
            .where(Credential.secret_hash == hash_secret(secret))
        ).first()
        if row is None:
            raise Unauthorized(
                "unknown credential; register again or check the token you sent", code="invalid_credential"
            )
        credential_id, credential_kind, volunteer_id, revoked_at, banned_at = row
        if credential_kind != kind:
            if kind == "organizer":
                raise Forbidden("this endpoint needs the organizer token", code="organizer_only")
            raise Forbidden("this endpoint needs a volunteer credential", code="volunteer_only")
        if revoked_at is not None:
            raise Forbidden("this credential was revoked by the organizers", code="revoked_credential")
        if volunteer_id is not None and banned_at is not None:
            raise Forbidden("this volunteer is banned from the coordinator", code="volunteer_banned")
        return Caller(id=credential_id, kind=credential_kind, volunteer_id=volunteer_id)

    @staticmethod
    def new_volunteer_credential(db: Session, *, volunteer_id: str) -> str:
        secret = new_secret("vc")
        db.add(
            Credential(
                id=new_id(),
                kind="volunteer",
                volunteer_id=volunteer_id,
                secret_hash=hash_secret(secret),
                created_at=time.time(),
            )
        )
        return secret

    # ------------------------------------------------------------------ peer tokens
    def issue_peer_token(self, *, run: str, volunteer: str, session: str, peer_public_key: str) -> PeerToken:
        return issue_peer_token(
            self.signing_key,
            run=run,
            volunteer=volunteer,
            session=session,
            peer_public_key=peer_public_key.encode("utf-8"),
            ttl=self.settings.tokens.peer_token_ttl,
        )

    def check_presented_peer_token(
        self,
        text: str,
        *,
        run: str,
        session: str,
        peer_public_key: str,
        revoked: bool,
        current_hash: str | None = None,
    ) -> None:
        """Check a peer token presented for a refresh: ours, this run, this session's key, not revoked, and
        the session's newest token (``current_hash``; None for sessions stored before tokens were tracked).

        An expired token is still accepted for ``refresh_grace`` seconds so that an agent that was
        offline briefly can get a new one; after that it must join again.
        """
        try:
            token = PeerToken.decode(text)
            claims = verify_peer_token(
                token,
                self.verifying_keys,
                run=run,
                peer_public_key=peer_public_key.encode("utf-8"),
                leeway=self.settings.tokens.refresh_grace,
            )
        except TokenError as exc:
            status = (
                Unauthorized
                if exc.code in ("malformed_token", "forged_token", "unknown_key", "expired_token")
                else Forbidden
            )
            raise status(exc.detail, code=exc.code) from exc
        if claims.session != session:
            raise Forbidden("peer token belongs to another session", code="wrong_session")
        if revoked:
            raise Forbidden("peer token was revoked by the organizers", code="revoked_token")
        if current_hash is not None and not hmac.compare_digest(hash_secret(token.encode()), current_hash):
            raise Forbidden(
                "this peer token was already traded for a newer one; present the newest token or join again",
                code="token_superseded",
            )
