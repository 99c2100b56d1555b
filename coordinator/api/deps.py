"""Dependencies: the app's resources (from the lifespan state) and who is calling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from coordinator.authority import Caller, TokenAuthority
from coordinator.limits import RateLimiter
from coordinator.live import LiveHub
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


def get_resources(request: Request) -> Resources:
    return request.state.resources


Res = Annotated[Resources, Depends(get_resources)]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def _volunteer(request: Request, res: Res) -> Caller:
    with res.store.read() as db:
        return res.authority.authenticate(db, bearer_token(request), kind="volunteer")


def _organizer(request: Request, res: Res) -> Caller:
    with res.store.read() as db:
        return res.authority.authenticate(db, bearer_token(request), kind="organizer")


VolunteerCredential = Annotated[Caller, Depends(_volunteer)]
OrganizerCredential = Annotated[Caller, Depends(_organizer)]


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"
