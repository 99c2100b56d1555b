"""The pace of matchmaking's DHT reads and of the state-download records (:mod:`workers.compat.matchmaking`),
with real hivemind averagers."""

from __future__ import annotations

import pytest

from tests.workers.compat.peers import run_peer_script

_PACE_SCRIPT = r"""
import json, threading, time
import hivemind, torch
from hivemind.averaging import DecentralizedAverager
from workers import compat

compat.install_calm_matchmaking(query_interval=compat.matchmaking_query_interval(0.5))
first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
averagers = [DecentralizedAverager([torch.zeros(4)], dht=d, prefix="pace", target_group_size=2,
                                   min_matchmaking_time=0.5, request_timeout=0.25, start=True) for d in (first, second)]
matched = 0
for _ in range(12):  # both peers look for a group at the same moment, as at an epoch's end
    results = [None, None]
    def run(i):
        try:
            results[i] = averagers[i].step(timeout=1.5)
        except Exception as exc:
            results[i] = repr(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    matched += all(isinstance(r, dict) and len(r) == 2 for r in results)
    time.sleep(0.3)
print(json.dumps({"matched": matched}), flush=True)
for a in averagers: a.shutdown()
for d in (first, second): d.shutdown()
"""


def test_two_peers_with_short_matchmaking_find_each_other_at_every_round() -> None:
    """The worker paces its reads of a group's key; at one read per 0.5 s, peers with 0.5 s of matchmaking
    often read only after each other's declaration had expired, and rounds took 2-3.5 s to match or failed
    (a demo with rounds of 512 samples went 15 of 116 epochs without one; this script matched 11 and 2 of
    12 rounds, and 6 of 8 in a shorter run). The pace now follows the matchmaking time."""
    from workers.compat import matchmaking_query_interval

    assert matchmaking_query_interval(3.0) == 0.5  # the runs' default: the pace the DHT load was measured at
    assert matchmaking_query_interval(0.5) == 0.125
    outcome, log = run_peer_script(_PACE_SCRIPT, timeout=180)
    assert outcome == {"matched": 12}, log[-3000:]


_LONE_AVERAGER_SCRIPT = r"""
import json, multiprocessing as mp
from functools import partial
import hivemind, torch
from hivemind.averaging import key_manager
from workers import compat

reads = mp.Value("i", 0)  # shared with the averager's process, which hivemind forks
original = key_manager.GroupKeyManager.get_averagers

async def counted(self, group_key, only_active):
    with reads.get_lock():
        reads.value += 1
    return await original(self, group_key, only_active)

key_manager.GroupKeyManager.get_averagers = counted
compat.install_calm_matchmaking()
dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
averager = compat.GuardedStateAverager(
    dht=dht, optimizer=partial(torch.optim.SGD, lr=0.1), params=torch.nn.Linear(4, 4).parameters(),
    prefix="lone_state_averager", target_group_size=2, min_matchmaking_time=4.0, request_timeout=1.0, start=True)
averager.step(averaging_round=True, delay_averaging=False, averaging_opts=dict(timeout=4.0))
print(json.dumps({"reads": reads.value}), flush=True)
averager.shutdown()
dht.shutdown()
"""


def test_an_averager_waiting_for_a_partner_reads_the_dht_twice_a_second_not_in_a_loop() -> None:
    """hivemind reads the group key again as soon as the last read ends while no partner is in view:
    3,687 DHT reads in the 4 seconds of this lone averager's round (measured without the pacing); in a
    swarm each is a signed request every other peer's DHT answers. Paced, it reads about twice a second."""
    outcome, _ = run_peer_script(_LONE_AVERAGER_SCRIPT, timeout=120)
    assert 2 <= outcome["reads"] <= 12, outcome


_DECLARE_SCRIPT = r"""
import json, multiprocessing as mp, sys, time
import hivemind, torch
from hivemind.averaging import DecentralizedAverager
from workers import compat

stores = mp.Value("i", 0)  # shared with the averager's process, which hivemind forks
original = hivemind.DHT.store

def counted(self, key, *args, **kwargs):
    if str(key).endswith(".all_averagers"):
        with stores.get_lock():
            stores.value += 1
    return original(self, key, *args, **kwargs)

hivemind.DHT.store = counted
if sys.argv[1] == "":
    compat.install_calm_matchmaking(declare_interval=1.0)
dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
averager = DecentralizedAverager([torch.zeros(4)], dht=dht, prefix="declare", target_group_size=2, start=True)
time.sleep(1.5)
before, start = stores.value, time.monotonic()
for priority in range(1, 41):  # what an averaging round did: the state marked changed once per tensor
    averager.state_sharing_priority = priority
    time.sleep(0.05)
time.sleep(2.5)  # past the pause after the last record
stored = dht.get("declare.all_averagers", latest=True)
print(json.dumps({"stores": stores.value - before, "seconds": time.monotonic() - start,
                  "latest": [v.value for v in stored.value.values()] if stored is not None else None}), flush=True)
averager.shutdown()
dht.shutdown()
"""


@pytest.mark.parametrize("handling", ["", "hivemind"])
def test_the_state_download_record_is_stored_at_most_every_declare_interval(handling: str) -> None:
    """hivemind stores an averager's state-download record again at every change of its state, and an
    averaging round changed it once per tensor: dozens of signed DHT stores in a burst. Paced, 40 changes in
    2 s make one record per second, and the one stored last holds the newest priority; hivemind's own loop
    stores one per change (run too, so that the test can tell them apart)."""
    outcome, log = run_peer_script(_DECLARE_SCRIPT, handling, timeout=120)
    assert outcome["latest"] == [40], log[-3000:]
    paced_at_most = outcome["seconds"] / 1.0 + 1  # one record per declare_interval, and the first at once
    if handling == "":
        assert 1 <= outcome["stores"] <= paced_at_most, outcome
    else:
        assert outcome["stores"] > paced_at_most, outcome
