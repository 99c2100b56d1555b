"""Organizer sign-in for the dashboard: the organizer token is traded once for a session cookie.

The token never lives in the browser: ``POST /api/v1/auth/login`` checks it and sets a cookie holding a
random secret (HttpOnly, so no script can read it; SameSite=Strict, so no other site's page can make the
browser send it; Secure, with the ``__Host-`` name prefix, when the dashboard is served over TLS). Only
the secret's SHA-256 is stored (:class:`coordinator.models.OrganizerLogin`), bound to the organizer
credential it was made with: rotating the organizer token ends every sign-in, and so does logging out,
``dashboard.session_ttl`` or ``dashboard.session_idle_timeout``.

Writes made with the cookie need CSRF protection on top of SameSite: the request must carry
``X-CSRF-Token``, an HMAC of the cookie's secret that only pages of this origin can read (from the login
answer or ``GET /api/v1/auth/session``), and a browser's ``Origin``/``Sec-Fetch-Site`` must not name
another site. A bearer token (scripts, the CLI's HTTP users) needs neither: browsers never attach it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.accounts.authority import Caller, TokenAuthority, new_id
from coordinator.errors import Forbidden, Unauthorized
from coordinator.models import Credential, OrganizerLogin
from coordinator.settings import CoordinatorSettings
from volunteer_app.tokens import hash_secret

COOKIE = "vc_organizer"
"""The cookie's name over plain HTTP (loopback, a private network)."""
SECURE_COOKIE = "__Host-vc_organizer"
"""The cookie's name over HTTPS: browsers accept a ``__Host-`` cookie only with Secure, Path=/ and no
Domain, so a sibling subdomain cannot plant one."""
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_LAST_SEEN_RESOLUTION = 60.0
"""A sign-in's last use is written at most once a minute (it bounds the idle timeout's precision)."""


@dataclass(frozen=True)
class SignIn:
    """A new sign-in: the cookie's secret (never stored), its CSRF token, and when it expires."""

    secret: str
    csrf_token: str
    expires_at: float


def csrf_token(secret: str) -> str:
    """The CSRF token of a sign-in: derived from the cookie's secret, so nothing more is stored, and
    useless without the cookie."""
    return hmac.new(secret.encode(), b"volunteer-coordinator csrf", hashlib.sha256).hexdigest()


def cookie_name(secure: bool) -> str:
    return SECURE_COOKIE if secure else COOKIE


def sign_in(
    db: Session,
    *,
    token: str,
    settings: CoordinatorSettings,
    now: float,
    address: str = "",
    user_agent: str = "",
) -> SignIn:
    """Check the organizer token and open a sign-in. 401 for an unknown token, 403 for a volunteer's
    credential or a retired organizer token (the authority's own answers)."""
    caller = TokenAuthority.authenticate(db, token.strip() or None, kind="organizer")
    secret = secrets.token_urlsafe(32)
    expires = now + settings.dashboard.session_ttl
    db.add(
        OrganizerLogin(
            id=new_id(),
            secret_hash=hash_secret(secret),
            credential_id=caller.id,
            created_at=now,
            expires_at=expires,
            last_seen_at=now,
            address=address[:64],
            user_agent=user_agent[:200],
        )
    )
    return SignIn(secret=secret, csrf_token=csrf_token(secret), expires_at=expires)


@dataclass(frozen=True)
class LoginState:
    login_id: str
    caller: Caller
    expires_at: float
    last_seen_at: float


def check(db: Session, *, secret: str, settings: CoordinatorSettings, now: float) -> LoginState:
    """Who a session cookie belongs to. 401 ``invalid_session`` for a cookie the coordinator never issued
    (forged), 401 ``session_expired`` for one that ended (logged out, expired, idle, token rotated)."""
    row = db.execute(
        select(OrganizerLogin, Credential.kind, Credential.revoked_at)
        .join(Credential, Credential.id == OrganizerLogin.credential_id)
        .where(OrganizerLogin.secret_hash == hash_secret(secret))
    ).first()
    if row is None:
        raise Unauthorized("this sign-in is not known here; sign in again", code="invalid_session")
    login, kind, revoked_at = row
    if kind != "organizer":  # only organizer credentials ever sign in; a row saying otherwise is refused
        raise Forbidden("this endpoint needs the organizer token", code="organizer_only")
    ended = (
        login.revoked_at is not None
        or revoked_at is not None
        or now >= login.expires_at
        or now - login.last_seen_at >= settings.dashboard.session_idle_timeout
    )
    if ended:
        raise Unauthorized("this sign-in has ended; sign in again", code="session_expired")
    return LoginState(
        login_id=login.id,
        caller=Caller(id=login.credential_id, kind="organizer", volunteer_id=None),
        expires_at=login.expires_at,
        last_seen_at=login.last_seen_at,
    )


def touch(db: Session, *, login_id: str, now: float) -> None:
    """Record a sign-in's use (for the idle timeout)."""
    login = db.get(OrganizerLogin, login_id)
    if login is not None:
        login.last_seen_at = now


def needs_touch(state: LoginState, now: float) -> bool:
    return now - state.last_seen_at >= _LAST_SEEN_RESOLUTION


def sign_out(db: Session, *, secret: str, now: float) -> bool:
    """End the sign-in of a cookie; False when there was none to end."""
    login = db.scalars(
        select(OrganizerLogin).where(OrganizerLogin.secret_hash == hash_secret(secret))
    ).first()
    if login is None or login.revoked_at is not None:
        return False
    login.revoked_at = now
    return True


def same_origin(origin: str, *, scheme: str, host: str) -> bool:
    """Whether a browser's ``Origin`` (or ``Referer``) names this coordinator (scheme and host:port)."""
    parts = urlsplit(origin)
    return bool(parts.scheme) and parts.scheme == scheme and parts.netloc.lower() == host.lower()


def check_browser_write(
    *,
    secret: str,
    method: str,
    presented_csrf: str | None,
    origin: str | None,
    fetch_site: str | None,
    scheme: str,
    host: str,
) -> None:
    """CSRF checks of a write made with the session cookie: 403 ``cross_site_request`` when the browser
    says another site made it, 403 ``csrf_failed`` without this sign-in's CSRF token."""
    if method.upper() in SAFE_METHODS:
        return
    if fetch_site is not None and fetch_site.lower() not in ("same-origin", "none"):
        raise Forbidden(
            f"refused a {fetch_site} request: the dashboard's writes come from its own pages only",
            code="cross_site_request",
        )
    if origin is not None and origin != "null" and not same_origin(origin, scheme=scheme, host=host):
        raise Forbidden(
            "refused a request from another origin: the dashboard's writes come from its own pages only",
            code="cross_site_request",
        )
    if origin == "null":
        raise Forbidden("refused a request from an opaque origin", code="cross_site_request")
    if not presented_csrf or not hmac.compare_digest(presented_csrf.encode(), csrf_token(secret).encode()):
        raise Forbidden(
            f"missing or wrong {CSRF_HEADER} header: reload the dashboard and try again", code="csrf_failed"
        )
