"""Dependencies: the app's resources (from the lifespan state), who is calling, and the per-caller limits."""

from __future__ import annotations

import contextlib
import ipaddress
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from coordinator.accounts import logins
from coordinator.accounts.authority import Caller, TokenAuthority
from coordinator.accounts.invites import InviteGuard
from coordinator.accounts.limits import GuessLimiter, RateLimiter
from coordinator.monitoring.live import LiveHub
from coordinator.monitoring.metrics import CountingRateLimiter, Metrics
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store


@dataclass
class Resources:
    """Everything a request may use; built once in the lifespan."""

    settings: CoordinatorSettings
    store: Store
    authority: TokenAuthority
    limiter: RateLimiter
    hub: LiveHub
    clock: Callable[[], float] = time.time
    """Unix time for everything the services stamp (leases, deadlines, heartbeats); tests inject their own."""
    rng: random.Random | None = field(default=None)
    """Where spot checks are drawn from (None: the operating system's unpredictable source)."""
    metrics: Metrics = field(default_factory=Metrics)
    """This process's counters for ``/metrics``."""
    quotas: RateLimiter = field(init=False)
    """Daily quotas (registrations per address, joins per volunteer), on ``clock`` so that tests can move a
    day; ``limiter`` keeps the per-minute rates on the monotonic clock."""
    invite_guesses: GuessLimiter = field(init=False)
    """Wrong invite codes per client address (``coordinator.accounts.invites.InviteGuard``)."""

    def __post_init__(self) -> None:
        self.quotas = CountingRateLimiter(
            burst=self.settings.limits.burst, metrics=self.metrics, clock=self.clock
        )
        self.invite_guesses = GuessLimiter(
            clock=self.clock, on_refused=self.metrics.rate_limited.labels(action="invite_guess").inc
        )

    @contextlib.contextmanager
    def daily_quota(self, action: str, key: str, *, per_day: float) -> Iterator[None]:
        """Take one from ``key``'s daily quota of ``action`` (a bucket of ``per_day`` refilled over 24 h) or
        raise ``RateLimited`` (429 with Retry-After); give it back if the block fails, since a refused
        registration or join adds nothing to the store (a paused run's agent retrying stays within it)."""
        name = f"{action} per day"
        self.quotas.check(name, key, per_minute=per_day / 1440.0, burst=max(1, int(per_day)))
        try:
            yield
        except BaseException:
            self.quotas.refund(name, key)
            raise


def get_resources(request: Request) -> Resources:
    return request.state.resources


Res = Annotated[Resources, Depends(get_resources)]

# Declared security schemes: they put the two kinds of bearer token into the OpenAPI document. Missing or
# malformed headers are answered by the authority (401 missing_credential), not by FastAPI.
volunteer_scheme = HTTPBearer(
    scheme_name="volunteer_credential",
    description="The volunteer credential from `POST /api/v1/volunteers` (shown once at registration).",
    auto_error=False,
)
organizer_scheme = HTTPBearer(
    scheme_name="organizer_token",
    description="The organizer token that `volunteer-coordinator init` writes to DATA_DIR/admin-token. "
    "Browsers use the dashboard's sign-in instead: `POST /api/v1/auth/login` trades the token for an "
    "HttpOnly, SameSite=Strict session cookie, accepted in its place; writes made with the cookie also "
    "need the sign-in's `X-CSRF-Token` header (`GET /api/v1/auth/session`).",
    auto_error=False,
)


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def _volunteer(
    request: Request,
    res: Res,
    _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(volunteer_scheme)],
) -> Caller:
    with res.store.read() as db:
        return res.authority.authenticate(db, bearer_token(request), kind="volunteer")


def login_cookie(connection: HTTPConnection) -> str | None:
    """The dashboard sign-in's secret from its cookie (the ``__Host-`` name over HTTPS), if any."""
    for name in (logins.SECURE_COOKIE, logins.COOKIE):
        value = connection.cookies.get(name)
        if value:
            return value[:512]
    return None


def _organizer(
    request: Request,
    res: Res,
    _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(organizer_scheme)],
) -> Caller:
    """The organizer: by bearer token (scripts), or by the dashboard's sign-in cookie (browsers), whose
    writes must also pass the CSRF checks. A bearer header, even a malformed one, takes precedence."""
    secret = login_cookie(request)
    if "authorization" in request.headers or secret is None:
        with res.store.read() as db:
            return res.authority.authenticate(db, bearer_token(request), kind="organizer")
    now = res.clock()
    with res.store.read() as db:
        state = logins.check(db, secret=secret, settings=res.settings, now=now)
    logins.check_browser_write(
        secret=secret,
        method=request.method,
        presented_csrf=request.headers.get(logins.CSRF_HEADER),
        origin=request.headers.get("origin"),
        fetch_site=request.headers.get("sec-fetch-site"),
        scheme=request.url.scheme,
        host=request.headers.get("host", ""),
    )
    if logins.needs_touch(state, now):
        with res.store.write() as db:
            logins.touch(db, login_id=state.login_id, now=now)
    return state.caller


VolunteerCredential = Annotated[Caller, Depends(_volunteer)]
OrganizerCredential = Annotated[Caller, Depends(_organizer)]


def client_address(connection: HTTPConnection) -> str:
    """The caller's address for per-address limits: the peer's own address (X-Forwarded-For counts only
    from ``--trusted-proxy`` proxies, which uvicorn applies), and for IPv6 its /64, since one household
    or server gets a whole /64 and could otherwise rotate through it."""
    host = connection.client.host if connection.client is not None else "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address.ipv4_mapped or address) if isinstance(address, ipaddress.IPv6Address) else str(address)


READ_BURST = 60
"""Public reads a client may make at once (a dashboard asks for several things when it opens)."""


def _public_read(request: Request, res: Res) -> None:
    res.limiter.check(
        "read", client_address(request), per_minute=res.settings.limits.read_per_minute, burst=READ_BURST
    )


PublicRead = Depends(_public_read)


def _invite_guard(request: Request, res: Res) -> InviteGuard:
    return InviteGuard(
        guesses=res.invite_guesses, address=client_address(request), limits=res.settings.limits
    )


ClientInviteGuard = Annotated[InviteGuard, Depends(_invite_guard)]
"""The caller's address's budget of wrong invite codes, for the routes that take a code."""


def _register_quota(request: Request, res: Res) -> Iterator[None]:
    address = client_address(request)
    limits = res.settings.limits
    res.limiter.check("register", address, per_minute=limits.register_per_minute)
    with res.daily_quota("register", address, per_day=limits.register_per_day):
        yield


RegisterQuota = Depends(_register_quota)
"""Registrations per client address: per minute, and per day (only those that succeed count) so that one
address cannot mint a crowd of volunteers."""


def _join_quota(credential: VolunteerCredential, res: Res) -> Iterator[None]:
    limits = res.settings.limits
    res.limiter.check("join", credential.id, per_minute=limits.join_per_minute)
    with res.daily_quota("join", credential.volunteer_id or credential.id, per_day=limits.join_per_day):
        yield


JoinQuota = Depends(_join_quota)
"""Joins per credential per minute, and per volunteer per day (only those that succeed count): a bound on
the sessions one volunteer adds to the store."""
