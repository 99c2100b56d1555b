"""Security issue, defect 11: invite-code guesses were limited per credential, not per address.

Credentials are free, so the attacker made many and guessed 269 codes a minute from one address. Wrong
codes now spend a budget of the client address (over all its credentials, runs and registrations); once
it is spent, every code from that address, the right one too, gets 429 with Retry-After until the
window ends. Other addresses are not affected, and honest joins with the right code never spend it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.settings import LimitSettings
from tests.conftest import PROFILE
from tests.coordinator.conftest import CLIENT_HEADER, Clocked, make_clocked

ATTACKER, NEIGHBOUR, HONEST = "203.0.113.66", "198.51.100.7", "2001:db8:77::1"

LIFTED = {"register_per_minute": 1e6, "join_per_minute": 1e6, "burst": 100_000}
"""The per-credential and per-minute rates lifted: what stops the guessing here is the guess budget."""


@pytest.fixture
def c(tmp_path: Path) -> Iterator[Clocked]:
    yield from make_clocked(tmp_path, addresses=True, limits=LimitSettings(**LIFTED))


def _register(c: Clocked, name: str, address: str, **body: Any) -> Any:
    return c.client.post("/api/v1/volunteers", json={"name": name, **body}, headers={CLIENT_HEADER: address})


def _credential(c: Clocked, name: str, address: str) -> dict[str, str]:
    answer = _register(c, name, address)
    assert answer.status_code == 201, answer.text
    return {"Authorization": f"Bearer {answer.json()['credential']}", CLIENT_HEADER: address}


def _join(c: Clocked, headers: dict[str, str], code: str) -> Any:
    body = {
        "profile": PROFILE,
        "agent_version": "test",
        "peer_public_key": c.new_key()[1],
        "invite_code": code,
    }
    return c.client.post("/api/v1/runs/secret/join", json=body, headers=headers)


def test_guesses_from_many_credentials_of_one_address_meet_one_budget(c: Clocked) -> None:
    code = c.create_run("secret", visibility="invite")["invite_code"]
    budget = c.settings.limits.invite_guesses
    window = c.settings.limits.invite_guess_window
    # an honest volunteer mistypes twice, then joins: the right code spends nothing
    honest = _credential(c, "honest", HONEST)
    assert _join(c, honest, "inv_mistyped").status_code == 403
    assert _join(c, honest, "inv_mistyped-again").status_code == 403
    assert _join(c, honest, code).status_code == 200

    # one address, a fresh credential per guess (credentials are free)
    answers = [
        _join(c, _credential(c, f"guesser{i}", ATTACKER), f"guess-{i:06d}") for i in range(budget + 15)
    ]
    errors = [a.json()["error"] for a in answers]
    assert errors[:budget] == ["invalid_invite_code"] * budget
    assert [a.status_code for a in answers[budget:]] == [429] * 15
    assert set(errors[budget:]) == {"too_many_guesses"}
    retry = int(answers[-1].headers["Retry-After"])
    assert 1 <= retry <= window
    # registering with a code is the same budget, and the right code is refused too until the window ends
    assert _register(c, "guesser-reg", ATTACKER, invite_code="guess-reg").status_code == 429
    late = _join(c, _credential(c, "late", ATTACKER), code)
    assert late.status_code == 429 and late.json()["error"] == "too_many_guesses"
    assert _register(c, "late-reg", ATTACKER, invite_code=code).status_code == 429
    # joining an open run, or registering without a code, does not involve the budget
    assert _register(c, "plain", ATTACKER).status_code == 201

    # another address is not affected: a wrong code is a plain 403, the right one admits
    neighbour = _credential(c, "neighbour", NEIGHBOUR)
    wrong = _join(c, neighbour, "guess-neighbour")
    assert wrong.status_code == 403 and wrong.json()["error"] == "invalid_invite_code"
    assert _join(c, neighbour, code).status_code == 200
    assert _register(c, "neighbour2", NEIGHBOUR, invite_code=code).status_code == 201

    # once the window has passed, the attacker's address may try again (and the right code admits)
    c.clock.advance(window + 1)
    assert _join(c, _credential(c, "after", ATTACKER), code).status_code == 200
    refused = c.client.get("/metrics").text
    assert 'volunteer_coordinator_rate_limited_requests_total{action="invite_guess"} 18.0' in refused


def test_honest_members_with_the_right_code_never_spend_the_budget(c: Clocked) -> None:
    """A classroom behind one NAT: more volunteers than the budget, each joining with the right code."""
    code = c.create_run("secret", visibility="invite")["invite_code"]
    budget = c.settings.limits.invite_guesses
    for i in range(budget + 5):
        assert _join(c, _credential(c, f"student{i}", ATTACKER), code).status_code == 200
        assert _register(c, f"student{i}-reg", ATTACKER, invite_code=code).status_code == 201
    # members join again without a code; the budget is all there for a mistyping student
    for i in range(budget - 1):
        assert _join(c, _credential(c, f"typo{i}", ATTACKER), "wrong-code-x").status_code == 403


def test_generated_invite_codes_are_long_random_secrets(c: Clocked) -> None:
    own = c.create_run("secret", visibility="invite")["invite_code"]
    added = c.client.post("/api/v1/runs/secret/invites", json={"label": "group"}, headers=c.admin)
    assert added.status_code == 201, added.text
    for code in (own, added.json()["code"]):
        # "inv_" and 20 URL-safe base64 characters: 120 random bits, beyond any guess budget
        assert len(code) == 24 and code.startswith("inv_") and len(set(code[4:])) > 8
