"""The progress tracker's throttled reports (:mod:`workers.compat.progress`), with real hivemind peers."""

from __future__ import annotations

from tests.workers.compat.peers import run_peer_script

_FAST_PEER_SCRIPT = r"""
import json, sys, time
import hivemind
from hivemind.optim.progress_tracker import ProgressTracker
from workers import compat

dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
tracker = ProgressTracker(dht, "fast", target_batch_size=256, start=True, min_refresh_period=0.5)
compat.throttle_progress_reports(tracker, min_interval=float(sys.argv[1]))
tracker.report_local_progress(0, 0)  # what loading the swarm's state reports
time.sleep(0.5)
for samples in range(16, 256, 16):  # a fast peer fills an epoch before the throttle lets a record out
    tracker.report_local_progress(0, samples)
    time.sleep(0.1)  # a micro-batch; the reporter wakes in time even on a busy machine
tracker.report_local_progress(1, 0)  # the new epoch; then it idles (waiting for work)
time.sleep(3)
found = dht.get("fast_progress", latest=True)
print(json.dumps({"records": 0 if found is None else len(found.value)}), flush=True)
tracker.shutdown()
dht.shutdown()
"""


def test_a_peer_that_fills_an_epoch_between_two_throttled_reports_is_still_seen_by_the_swarm() -> None:
    """The coordinator verifies a lease by the peer's signed progress record; a fast peer that finished
    its leases before its first record went out used to stay invisible, its work unverified."""
    outcome, _ = run_peer_script(_FAST_PEER_SCRIPT, "30", timeout=120)
    assert outcome == {"records": 1}
