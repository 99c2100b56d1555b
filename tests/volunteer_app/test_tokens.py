"""Peer tokens and revocation records: what the coordinator signs and everyone checks offline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from volunteer_app.identity import ensure_rsa_key, public_key_openssh
from volunteer_app.tokens import (
    PeerToken,
    SigningKey,
    TokenError,
    VerifyingKeys,
    hash_secret,
    issue_peer_token,
    new_secret,
    sign_revocation,
    verify_peer_token,
    verify_revocation,
)

KEY = b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC-test-peer"


@pytest.fixture(scope="module")
def signing_key() -> SigningKey:
    return SigningKey.generate()


def _token(signing_key: SigningKey, **kw: object) -> PeerToken:
    args: dict = {"run": "r", "volunteer": "v", "session": "s", "peer_public_key": KEY, "ttl": 60.0, **kw}
    return issue_peer_token(signing_key, **args)


def _code(token: PeerToken, keys: VerifyingKeys, **kw: object) -> str:
    with pytest.raises(TokenError) as info:
        verify_peer_token(token, keys, **kw)  # type: ignore[arg-type]
    return info.value.code


def test_a_genuine_token_round_trips_through_text_and_hivemind_fields(signing_key: SigningKey) -> None:
    keys = VerifyingKeys.of(signing_key)
    token = _token(signing_key)
    decoded = PeerToken.decode(token.encode())
    assert verify_peer_token(decoded, keys, run="r", peer_public_key=KEY).session == "s"
    fields = token.access_token_fields()
    assert fields["public_key"] == KEY and str(fields["expiration_time"]).endswith("+00:00")
    again = PeerToken.from_access_token_fields(
        username=str(fields["username"]),
        public_key=KEY,
        signature=bytes(fields["signature"]),  # type: ignore[arg-type]
    )
    assert verify_peer_token(again, keys, run="r").volunteer == "v"


def test_every_attack_is_refused_with_its_own_reason(signing_key: SigningKey) -> None:
    keys = VerifyingKeys.of(signing_key)
    token = _token(signing_key)
    assert _code(PeerToken(token.claims_json, token.peer_public_key, b"\0" * 64), keys) == "forged_token"
    swapped_key = PeerToken(token.claims_json, b"ssh-rsa AAAA-other", token.signature)
    assert _code(swapped_key, keys) == "forged_token"  # the key is covered by the signature
    assert _code(_token(signing_key, now=time.time() - 120), keys) == "expired_token"
    assert _code(token, keys, run="another-run") == "wrong_run"
    assert _code(token, keys, peer_public_key=b"ssh-rsa AAAA-other") == "wrong_key"
    assert _code(token, keys, revoked_sessions={"s"}) == "revoked_token"
    assert _code(_token(SigningKey.generate()), keys) == "unknown_key"
    for junk in ("", "pt1.a.b", "pt2.a.b.c", "pt1.!!!.b.c", "x" * 10_000):
        with pytest.raises(TokenError) as info:
            PeerToken.decode(junk)
        assert info.value.code == "malformed_token"
    assert verify_peer_token(_token(signing_key, now=time.time() - 61), keys, leeway=30.0).run == "r"


def test_rotated_keys_keep_verifying_by_key_id(signing_key: SigningKey) -> None:
    newer = SigningKey.generate()
    keys = VerifyingKeys.from_records(VerifyingKeys.of(signing_key, newer).records())
    assert verify_peer_token(_token(signing_key), keys).kid == signing_key.kid
    assert verify_peer_token(_token(newer), keys).kid == newer.kid
    record = VerifyingKeys.of(newer).records()[0]
    with pytest.raises(TokenError):
        VerifyingKeys.from_records([{"kid": signing_key.kid, "public_key": record["public_key"]}])


def test_signing_key_file_is_private_and_reloads(tmp_path: Path, signing_key: SigningKey) -> None:
    path = tmp_path / "keys" / "k.pem"
    signing_key.save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert SigningKey.load(path).kid == signing_key.kid
    path.write_text("garbage")
    with pytest.raises(TokenError):
        SigningKey.load(path)


def test_credentials_are_random_and_only_their_hash_is_kept() -> None:
    a, b = new_secret("vc"), new_secret("vc")
    assert a != b and a.startswith("vc_") and len(a) > 40
    assert hash_secret(a) == hash_secret(a) and a not in hash_secret(a)


def test_revocation_records_verify_and_resist_forgery(signing_key: SigningKey) -> None:
    keys = VerifyingKeys.of(signing_key)
    record = sign_revocation(signing_key, run="r", session="s1", expires_at=time.time() + 60)
    assert verify_revocation(record, keys, run="r") == "s1"
    with pytest.raises(TokenError):
        verify_revocation(record, keys, run="other")
    forged = {**record, "body": str(record["body"]).replace("s1", "s2")}
    with pytest.raises(TokenError):
        verify_revocation(forged, keys, run="r")
    with pytest.raises(TokenError):
        verify_revocation("junk", keys, run="r")


def test_peer_key_file_is_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "peer.rsa"
    first = public_key_openssh(ensure_rsa_key(path))
    assert path.stat().st_mode & 0o777 == 0o600
    assert public_key_openssh(ensure_rsa_key(path)) == first and first.startswith("ssh-rsa ")
