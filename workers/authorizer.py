"""The hivemind authorizer that keeps a run's DHT to the peers the coordinator signed for.

Every DHT request and response carries the sender's peer token (hivemind's ``AccessToken``) and is
signed with the sender's RSA key. :class:`PeerTokenAuthorizer` presents this peer's token and accepts a
peer only if its token verifies offline with the coordinator's public keys, is for this run, has not
expired and is not revoked; hivemind itself checks that the request was signed by the key the token is
bound to, so a copied token is useless without its private key.

The authorizer lives inside the DHT's background process. Push a refreshed token or new revocations
into it with :func:`push_token` / :func:`push_revocations` (they use ``DHT.run_coroutine``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey

from volunteer_app.tokens import PeerToken, PeerTokenClaims, TokenError, VerifyingKeys, verify_peer_token

logger = logging.getLogger(__name__)

TokenFactory = Callable[[], PeerToken]


class PeerTokenAuthorizer(TokenAuthorizerBase):
    """Admits to the DHT only peers holding a valid peer token for ``run``.

    :param run: the run name; tokens for any other run are refused.
    :param coordinator_keys: the coordinator public keys from the join answer.
    :param peer_token: this peer's own token (bound to ``local_private_key``'s public key).
    :param local_private_key: this peer's hivemind RSA key (default: hivemind's process-wide key).
    :param token_factory: optional callable that makes a fresh token when ours is near expiry (the
      coordinator's own swarm peer signs its own); workers instead receive new tokens through
      :func:`push_token`.
    :param refresh_before: seconds before expiry at which ``token_factory`` is asked for a new token.
    """

    def __init__(
        self,
        *,
        run: str,
        coordinator_keys: VerifyingKeys,
        peer_token: PeerToken,
        local_private_key: RSAPrivateKey | None = None,
        token_factory: TokenFactory | None = None,
        refresh_before: float = 300.0,
    ):
        super().__init__(local_private_key)
        self.run = run
        self.coordinator_keys = coordinator_keys
        self._token_factory = token_factory
        self._refresh_before = refresh_before
        self._revoked: frozenset[str] = frozenset()
        self._verified: dict[bytes, PeerTokenClaims] = {}
        self._token = peer_token
        self._check_own(peer_token)
        self._token_generation = 0
        self._served_generation = -1

    def _check_own(self, token: PeerToken) -> None:
        verify_peer_token(
            token, self.coordinator_keys, run=self.run, peer_public_key=self.local_public_key.to_bytes()
        )

    # ---------------------------------------------------------------- called from the owning process
    def set_token(self, token: PeerToken) -> None:
        """Use ``token`` from now on (it must be valid and bound to this peer's key)."""
        self._check_own(token)
        self._token = token
        self._token_generation += 1

    def set_revoked(self, sessions: Iterable[str]) -> None:
        self._revoked = frozenset(sessions)
        self._verified.clear()

    @property
    def token_expires_at(self) -> float:
        return self._token.claims.expires_at

    # ---------------------------------------------------------------- TokenAuthorizerBase
    async def get_token(self) -> AccessToken:
        if (
            self._token_factory is not None
            and self._token.claims.expires_at - time.time() < self._refresh_before
        ):
            self.set_token(self._token_factory())
        self._served_generation = self._token_generation
        return AccessToken(**self._token.access_token_fields())

    def is_token_valid(self, access_token: AccessToken) -> bool:
        claims = self.check_access_token(access_token)
        return claims is not None

    def check_access_token(self, access_token: AccessToken) -> PeerTokenClaims | None:
        """The claims of a valid token, or None (the reason is logged at debug level)."""
        signature = bytes(access_token.signature)
        cached = self._verified.get(signature)
        try:
            if cached is not None and cached.run == self.run:
                if time.time() > cached.expires_at:
                    raise TokenError("expired_token", "peer token has expired")
                if cached.session in self._revoked:
                    raise TokenError("revoked_token", "peer token was revoked")
                return cached
            token = PeerToken.from_access_token_fields(
                username=access_token.username, public_key=access_token.public_key, signature=signature
            )
            claims = verify_peer_token(
                token, self.coordinator_keys, run=self.run, revoked_sessions=self._revoked
            )
        except TokenError as exc:
            logger.debug("refusing a peer: %s (%s)", exc.detail, exc.code)
            return None
        if len(self._verified) > 4096:
            self._verified.clear()
        self._verified[signature] = claims
        return claims

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        if self._served_generation != self._token_generation:
            return True
        if self._token_factory is not None:
            return self._token.claims.expires_at - time.time() < self._refresh_before
        return False


async def _push_token(token_text: str, _dht: Any, node: Any) -> float:
    from workers.compat import node_authorizer

    authorizer: PeerTokenAuthorizer = node_authorizer(node)
    authorizer.set_token(PeerToken.decode(token_text))
    return authorizer.token_expires_at


async def _push_revocations(sessions: tuple[str, ...], _dht: Any, node: Any) -> int:
    from workers.compat import node_authorizer

    authorizer: PeerTokenAuthorizer = node_authorizer(node)
    authorizer.set_revoked(sessions)
    return len(sessions)


def push_token(dht: Any, token_text: str) -> float:
    """Hand a refreshed peer token to the authorizer inside ``dht``'s process. Returns its expiry."""
    return dht.run_coroutine(partial(_push_token, token_text))


def push_revocations(dht: Any, sessions: Iterable[str]) -> int:
    """Replace the set of revoked sessions known to the authorizer inside ``dht``'s process."""
    return dht.run_coroutine(partial(_push_revocations, tuple(sorted(set(sessions)))))
