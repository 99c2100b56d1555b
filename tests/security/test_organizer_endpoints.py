"""Every organizer endpoint, taken from the served OpenAPI document (so a new one is covered the day it is
added), refuses no credential, a forged one, a volunteer's, a banned volunteer's and a retired organizer
token, and changes nothing when it does."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import bearer
from tests.coordinator.conftest import Clocked, make_clocked


@pytest.fixture
def c(tmp_path: Path) -> Any:
    yield from make_clocked(tmp_path)


def organizer_operations(c: Clocked) -> list[tuple[str, str]]:
    spec = c.client.get("/api/v1/openapi.json").json()
    found = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            if {"organizer_token": []} in (operation.get("security") or []):
                found.append((method.upper(), re.sub(r"\{[^}]+\}", "shapes", path)))
    return found


def test_every_organizer_endpoint_refuses_everyone_but_the_organizer(c: Clocked) -> None:
    c.create_run()
    alice, mallory = c.register("alice"), c.register("mallory")
    c.join(alice)
    c.client.post("/api/v1/volunteers/mallory/ban", json={}, headers=c.admin)
    operations = organizer_operations(c)
    known = {("POST", "/api/v1/runs"), ("GET", "/api/v1/volunteers"), ("POST", "/api/v1/runs/shapes/pause"),
             ("POST", "/api/v1/runs/shapes/resume"), ("POST", "/api/v1/runs/shapes/finish"),
             ("GET", "/api/v1/runs/shapes/flags"), ("POST", "/api/v1/volunteers/shapes/ban")}  # fmt: skip
    assert known <= set(operations), operations
    before = (c.client.get("/api/v1/runs").json(), c.client.get("/api/v1/volunteers", headers=c.admin).json())
    callers: list[tuple[dict[str, str], int, str]] = [
        ({}, 401, "missing_credential"),
        ({"Authorization": "Token " + c.admin_token}, 401, "missing_credential"),
        (bearer("org_forged"), 401, "invalid_credential"),
        (bearer(c.admin_token + "x"), 401, "invalid_credential"),
        (alice.headers, 403, "organizer_only"),
        (mallory.headers, 403, "organizer_only"),
    ]
    for method, path in operations:
        for headers, status, code in callers:
            answer = c.client.request(method, path, json={}, headers=headers)
            assert (answer.status_code, answer.json()["error"]) == (status, code), (method, path, headers)
    # a retired organizer token (init --rotate-admin-token) is refused too
    old = c.admin_token
    from coordinator.bootstrap import open_data_dir

    open_data_dir(c.settings, rotate_admin_token=True).store.close()
    for method, path in operations:
        answer = c.client.request(method, path, json={}, headers=bearer(old))
        assert (answer.status_code, answer.json()["error"]) == (403, "revoked_credential"), (method, path)
    new = bearer(c.settings.admin_token_path.read_text().strip())
    after = (c.client.get("/api/v1/runs").json(), c.client.get("/api/v1/volunteers", headers=new).json())
    assert [r["state"] for r in after[0]] == [r["state"] for r in before[0]] == ["active"]
    assert after[1] == before[1]  # nobody was banned or created


def test_volunteer_endpoints_refuse_the_organizer_token(c: Clocked) -> None:
    c.create_run()
    spec = c.client.get("/api/v1/openapi.json").json()
    volunteer_ops = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, operations in spec["paths"].items()
        for method, operation in operations.items()
        if {"volunteer_credential": []} in (operation.get("security") or [])
    ]
    assert len(volunteer_ops) >= 6
    for method, path in volunteer_ops:
        answer = c.client.request(method, path, json={}, headers=c.admin)
        assert (answer.status_code, answer.json()["error"]) == (403, "volunteer_only"), (method, path)
