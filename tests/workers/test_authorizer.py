"""The hivemind authorizer, on hivemind's own AccessToken protobufs."""

from __future__ import annotations

import time

import pytest
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from volunteer_app.tokens import PeerToken, SigningKey, TokenError, VerifyingKeys, issue_peer_token
from workers.authorizer import PeerTokenAuthorizer


@pytest.fixture(scope="module")
def coordinator_key() -> SigningKey:
    return SigningKey.generate()


def _issue(
    key: SigningKey,
    rsa: RSAPrivateKey,
    *,
    run: str = "r",
    session: str = "s",
    ttl: float = 600,
    now: float | None = None,
) -> PeerToken:
    return issue_peer_token(
        key,
        run=run,
        volunteer="v",
        session=session,
        peer_public_key=rsa.get_public_key().to_bytes(),
        ttl=ttl,
        now=now,
    )


def _authorizer(key: SigningKey, *, run: str = "r") -> PeerTokenAuthorizer:
    rsa = RSAPrivateKey()
    return PeerTokenAuthorizer(
        run=run,
        coordinator_keys=VerifyingKeys.of(key),
        peer_token=_issue(key, rsa, run=run),
        local_private_key=rsa,
    )


def _access(token: PeerToken) -> AccessToken:
    return AccessToken(**token.access_token_fields())


def test_accepts_only_peers_the_coordinator_signed_for_this_run(coordinator_key: SigningKey) -> None:
    checker = _authorizer(coordinator_key)
    other = RSAPrivateKey()
    assert checker.is_token_valid(_access(_issue(coordinator_key, other)))
    assert not checker.is_token_valid(_access(_issue(coordinator_key, other, run="another")))
    assert not checker.is_token_valid(_access(_issue(coordinator_key, other, now=time.time() - 3600)))
    assert not checker.is_token_valid(_access(_issue(SigningKey.generate(), other)))
    genuine = _issue(coordinator_key, other, session="bad")
    forged = AccessToken(**{**genuine.access_token_fields(), "signature": b"\0" * 64})
    assert not checker.is_token_valid(forged)
    # a stolen token names its owner's key: swapping in the thief's key breaks the signature
    thief = RSAPrivateKey().get_public_key().to_bytes()
    assert not checker.is_token_valid(AccessToken(**{**genuine.access_token_fields(), "public_key": thief}))


def test_revocations_take_effect_even_for_cached_tokens(coordinator_key: SigningKey) -> None:
    checker = _authorizer(coordinator_key)
    token = _access(_issue(coordinator_key, RSAPrivateKey(), session="banned"))
    assert checker.is_token_valid(token)
    checker.set_revoked({"banned"})
    assert not checker.is_token_valid(token)


def test_own_token_must_be_bound_to_own_key_and_run(coordinator_key: SigningKey) -> None:
    rsa = RSAPrivateKey()
    keys = VerifyingKeys.of(coordinator_key)
    with pytest.raises(TokenError):
        PeerTokenAuthorizer(
            run="r",
            coordinator_keys=keys,
            peer_token=_issue(coordinator_key, RSAPrivateKey()),
            local_private_key=rsa,
        )
    checker = PeerTokenAuthorizer(
        run="r", coordinator_keys=keys, peer_token=_issue(coordinator_key, rsa, ttl=60), local_private_key=rsa
    )
    with pytest.raises(TokenError):
        checker.set_token(_issue(coordinator_key, rsa, run="other"))
    newer = _issue(coordinator_key, rsa, ttl=3600)
    checker.set_token(newer)
    assert checker.token_expires_at == pytest.approx(newer.claims.expires_at)
