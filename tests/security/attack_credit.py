"""Play the attacker of issue 10 against a real ``serve`` and measure the credit minted without training.

    python tests/security/attack_credit.py [--seconds 120] [--names 3] [--no-swarm]

The coordinator runs as organizers run it (with its swarm peer, unless ``--no-swarm``). The attacker
trains nothing and runs no hivemind peer: it registers a few names, joins each with as many workers
as one volunteer may have, with a profile that boasts 64 cores, 8 GPUs and a benchmark of 10 million
samples/s, and then for ``--seconds`` takes leases, reports each complete as soon as the server allows
(honouring every Retry-After: an attacker within the rate limits), heartbeats inflated figures and
trades tokens. It prints what that bought: ranked (verified, settled) credit, credit shown apart, the
shards it finished and whether the run ended, each per hour. Asserts nothing; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import python_env, start_serve, stop_serve  # noqa: E402
from volunteer_app.identity import public_key_openssh  # noqa: E402

BOAST = {
    "cpu_model": "Threadripper 9999X",
    "cpu_cores": 64,
    "cpu_threads": 128,
    "ram_bytes": 2**40,
    "gpus": [{"name": "H200", "memory_bytes": 141 * 2**30}] * 8,
    "benchmark": {"task": "shapes-dalle", "device": "cuda", "threads": 1, "micro_batch_size": 16,
                  "samples_per_second": 1e7},
}  # fmt: skip


class Attacker:
    def __init__(self, http: httpx.AsyncClient, deadline: float):
        self.http = http
        self.deadline = deadline
        self.requests = 0
        self.refused: dict[str, int] = {}

    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; a 429 is waited out (Retry-After) and retried, as a patient attacker would."""
        while True:
            self.requests += 1
            answer = await self.http.request(method, path, **kwargs)
            if answer.status_code != 429 or time.monotonic() > self.deadline:
                if answer.status_code >= 400:
                    code = str(answer.json().get("error", answer.status_code))
                    self.refused[code] = self.refused.get(code, 0) + 1
                return answer
            await asyncio.sleep(min(float(answer.headers.get("retry-after", "1")), 5.0))

    async def worker(self, credential: str, session: dict[str, Any]) -> None:
        await asyncio.gather(self.leases(credential, session), self.noise(credential, session))

    async def leases(self, credential: str, session: dict[str, Any]) -> None:
        """Take and report leases as fast as the server lets it: the credit-minting loop."""
        headers = {"Authorization": f"Bearer {credential}"}
        sid, lease = session["session_id"], session["lease"]
        while time.monotonic() < self.deadline:
            if lease is None:
                taken = await self.call("POST", f"/api/v1/sessions/{sid}/leases", headers=headers)
                body = taken.json() if taken.status_code == 200 else {}
                lease = body.get("lease")
                if lease is None:
                    await asyncio.sleep(min(float(body.get("retry_after") or 1.0), 5.0))
                    continue
            done = await self.call(
                "POST", f"/api/v1/sessions/{sid}/leases/{lease['lease_id']}/complete", headers=headers,
                json={"samples": lease["samples"], "compute_seconds": 1.0, "loss": 0.01},
            )  # fmt: skip
            if done.status_code == 409 and done.json().get("error") == "lease_too_early":
                await asyncio.sleep(float(done.headers.get("retry-after", "1")))
                continue
            lease = None

    async def noise(self, credential: str, session: dict[str, Any]) -> None:
        """Inflated heartbeats and token trading on the side (what the dashboard and the swarm would see)."""
        headers = {"Authorization": f"Bearer {credential}"}
        sid, token = session["session_id"], session["peer_token"]
        samples_total = 0
        while time.monotonic() < self.deadline:
            samples_total += 10**9
            await self.call(
                "POST", f"/api/v1/sessions/{sid}/heartbeat", headers=headers,
                json={"state": "training", "samples_total": min(samples_total, 10**15), "samples_per_second": 1e7,
                      "global_epoch": 2**31 - 1, "averaging_rounds": 2**31 - 1, "loss": 0.0},
            )  # fmt: skip
            for presented in (token, session["peer_token"]):  # the newest token, and a replay of the first
                refreshed = await self.call(
                    "POST", f"/api/v1/sessions/{sid}/token", headers=headers, json={"peer_token": presented}
                )
                if refreshed.status_code == 200:
                    token = refreshed.json()["peer_token"]
            await asyncio.sleep(2.0)


async def attack(url: str, *, seconds: float, names: int, sessions_per_name: int) -> dict[str, Any]:
    from cryptography.hazmat.primitives.asymmetric import rsa

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        attacker = Attacker(http, time.monotonic() + 3600)
        joined: list[tuple[str, dict[str, Any]]] = []
        for i in range(names):
            registered = await attacker.call("POST", "/api/v1/volunteers", json={"name": f"mallory{i}"})
            credential = registered.json()["credential"]
            for _ in range(sessions_per_name):
                key = public_key_openssh(rsa.generate_private_key(public_exponent=65537, key_size=2048))
                answer = await attacker.call(
                    "POST", "/api/v1/runs/shapes/join", headers={"Authorization": f"Bearer {credential}"},
                    json={"profile": BOAST, "agent_version": "evil", "peer_public_key": key},
                )  # fmt: skip
                if answer.status_code == 200:
                    joined.append((credential, answer.json()))
        start = time.monotonic()
        attacker.deadline = start + seconds
        await asyncio.gather(*(attacker.worker(c, s) for c, s in joined))
        elapsed = time.monotonic() - start
        board = (await http.get("/api/v1/runs/shapes/leaderboard")).json()["entries"]
        run = (await http.get("/api/v1/runs/shapes")).json()
    mine = [e for e in board if e["volunteer"].startswith("mallory")]
    settled = sum(e["verified_samples"] - e["pending_samples"] for e in mine)
    return {
        "seconds": elapsed,
        "sessions": len(joined),
        "requests": attacker.requests,
        "refused": attacker.refused,
        "ranked_credit": settled,
        "verified_incl_pending": sum(e["verified_samples"] for e in mine),
        "unverified_credit": sum(e["unverified_samples"] for e in mine),
        "shards_done": run["stats"]["shards_done"],
        "run_state": run["state"],
        "ranked_entries": sum(1 for e in mine if e["verified_samples"] - e["pending_samples"] > 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--names", type=int, default=3, help="volunteer names the attacker registers")
    parser.add_argument("--no-swarm", action="store_true", help="run serve without its swarm peer")
    args = parser.parse_args()
    started: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        extra = ["--no-swarm"] if args.no_swarm else []
        process, url = start_serve(data, started, *extra, env=python_env())
        try:
            admin = (data / "admin-token").read_text().strip()
            created = httpx.post(
                f"{url}/api/v1/runs",
                json={"name": "shapes", "task": "shapes-dalle", "task_config": {"preset": "tiny"}},
                headers={"Authorization": f"Bearer {admin}"},
                timeout=60,
            )
            created.raise_for_status()
            sessions = 8  # WorkSettings.max_sessions_per_volunteer
            result = asyncio.run(
                attack(url, seconds=args.seconds, names=args.names, sessions_per_name=sessions)
            )
        finally:
            stop_serve(process)
    hours = result["seconds"] / 3600
    print(f"attacker: {args.names} names x {result['sessions'] // max(1, args.names)} workers, no training, "
          f"{result['requests']} requests in {result['seconds']:.0f} s (swarm peer {'off' if args.no_swarm else 'on'})")  # fmt: skip
    print(f"refusals: {dict(sorted(result['refused'].items(), key=lambda kv: -kv[1]))}")
    print(f"ranked (verified, settled) credit minted: {result['ranked_credit']} samples "
          f"= {result['ranked_credit'] / hours:.0f} per hour")  # fmt: skip
    print(f"verified incl. pending spot checks: {result['verified_incl_pending']}")
    print(f"unverified credit (shown apart, never ranked): {result['unverified_credit']} samples "
          f"= {result['unverified_credit'] / hours:.0f} per hour")  # fmt: skip
    print(f"shards finished by the attacker: {result['shards_done']}; run state: {result['run_state']}; "
          f"attacker names with ranked credit: {result['ranked_entries']}")  # fmt: skip


if __name__ == "__main__":
    main()
