"""A bare hivemind DHT peer used by the swarm tests (run as its own process, as every hivemind peer is).

Usage: python dht_client.py JSON_ARGS. Prints one JSON line: {"joined": bool, "error": str | None}.
With "forge": true it presents a token whose signature it made up, as an attacker would.
With "progress": N it publishes a signed training-progress record of N samples, as hivemind.Optimizer does.
"""

from __future__ import annotations

import json
import sys
import time

import hivemind
from hivemind.optim.progress_tracker import ProgressTracker

from volunteer_app.tokens import PeerToken, VerifyingKeys
from workers.authorizer import PeerTokenAuthorizer
from workers.identity import load_hivemind_key


class ForgingAuthorizer(PeerTokenAuthorizer):
    def _check_own(self, token: PeerToken) -> None:  # an attacker skips its own checks
        pass


def main() -> None:
    args = json.loads(sys.argv[1])
    key = load_hivemind_key(__import__("pathlib").Path(args["key_path"]))
    token = PeerToken.decode(args["token"])
    cls = PeerTokenAuthorizer
    if args.get("forge"):
        token = PeerToken(token.claims_json, key.get_public_key().to_bytes(), b"\x01" * 64)
        cls = ForgingAuthorizer
    authorizer = cls(
        run=args["run"],
        coordinator_keys=VerifyingKeys.from_records(args["keys"]),
        peer_token=token,
        local_private_key=key,
    )
    try:
        dht = hivemind.DHT(
            initial_peers=args["initial_peers"],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            start=True,
            authorizer=authorizer,
        )
    except Exception as exc:
        print(json.dumps({"joined": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    if args.get("progress"):
        tracker = ProgressTracker(
            dht, args["hivemind_run_id"], target_batch_size=10_000, start=True, min_refresh_period=0.5
        )
        tracker.report_local_progress(0, args["progress"])
        time.sleep(args.get("linger", 8))
        tracker.shutdown()
    print(json.dumps({"joined": True, "error": None}), flush=True)
    dht.shutdown()


if __name__ == "__main__":
    main()
