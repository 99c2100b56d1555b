"""State downloads, checked, taken from another peer when refused, and averaged over several peers
(:mod:`workers.compat.state_download`), with real hivemind averagers."""

from __future__ import annotations

import pytest

from tests.workers.compat.peers import run_peer_script

_STATE_CHECK_SCRIPT = r"""
import json, sys, time
from functools import partial
import hivemind, torch
from hivemind.optim.state_averager import TrainingStateAverager
from workers import compat

torch.manual_seed(0)
inputs = torch.randn(64, 4)
true = torch.arange(16.0).reshape(4, 4) / 10
target = inputs @ true.T

def make(cls, dht, weight, share=True):
    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(weight)
    averager = cls(dht=dht, optimizer=partial(torch.optim.SGD, lr=0.1), params=model.parameters(),
                   prefix="check_state_averager", allow_state_sharing=share, request_timeout=1.0, start=True)
    return model, averager

first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
dhts = [first] + [hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(),
                               start=True) for _ in range(2)]
model, downloader = make(compat.GuardedStateAverager, dhts[0], torch.zeros(4, 4), share=False)
downloader.state_probe = lambda: float(torch.nn.functional.mse_loss(model(inputs), target))
_, honest = make(TrainingStateAverager, dhts[1], true, share=sys.argv[1] == "both")
_, hostile = make(TrainingStateAverager, dhts[2], -10 * true)  # a wrecked model, finite
hostile.state_sharing_priority = 100  # "I have the newest epoch"
honest.state_sharing_priority = 10
time.sleep(2)
result = {}
for attempt in ("first", "again"):
    with torch.no_grad():
        model.weight.zero_()
    downloader.load_state_from_peers(timeout=20)
    result[attempt] = [round(model.weight[1, 0].item(), 3), downloader.refused_states,
                       downloader.last_download_refused]
print(json.dumps(result), flush=True)
for a in (downloader, honest, hostile): a.shutdown()
for d in dhts: d.shutdown()
"""


@pytest.mark.parametrize(
    ("sharing", "expected"),
    [
        # the wrecked state is refused and the honest one loaded; the next download does not ask the hostile peer
        ("both", {"first": [0.4, 1, False], "again": [0.4, 1, False]}),
        # nobody else serves a state: the peer keeps its own parameters each time
        ("hostile", {"first": [0.0, 1, True], "again": [0.0, 1, True]}),
    ],
)
def test_a_downloaded_state_far_worse_than_the_peers_own_is_refused_and_taken_from_another_peer(
    sharing: str, expected: dict[str, object]
) -> None:
    """hivemind loads the state of whichever peer claims the newest epoch; a hostile peer can serve a wrecked
    but finite model to every peer that joins or catches up. Its loss on a fixed batch gives it away."""
    outcome, log = run_peer_script(_STATE_CHECK_SCRIPT, sharing, timeout=180)
    assert outcome == expected, log[-3000:]


_CONSENSUS_SCRIPT = r"""
import json, sys, time
from functools import partial
import hivemind, torch
from hivemind.optim.state_averager import TrainingStateAverager
from workers import compat

torch.manual_seed(0)
inputs = torch.randn(64, 4)
true = torch.arange(16.0).reshape(4, 4) / 10
target = inputs @ true.T
drift = torch.randn(4, 4) * 0.05  # each peer's own steps since the last round

def make(cls, dht, weight, epoch, priority):
    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(weight)
    averager = cls(dht=dht, optimizer=partial(torch.optim.SGD, lr=0.1), params=model.parameters(),
                   prefix="consensus_state_averager", allow_state_sharing=priority is not None,
                   request_timeout=1.0, start=True)
    averager.local_epoch = epoch
    if priority is not None:
        averager.state_sharing_priority = priority
    return model, averager

first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
dhts = [first] + [hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(),
                               start=True) for _ in range(5)]
own = sys.argv[1] == "own"  # a peer at epoch 10 averages its parameters with the others' (the final evaluation)
model, downloader = make(compat.GuardedStateAverager, dhts[0], true + 2 * drift if own else torch.zeros(4, 4),
                         10 if own else 0, None)
downloader.state_probe = lambda: float(torch.nn.functional.mse_loss(model(inputs), target))
downloader.consensus_peers = 1 if own else int(sys.argv[1])
peers = [
    make(TrainingStateAverager, dhts[1], true - drift if own else true + drift, 10, 10)[1],
    make(TrainingStateAverager, dhts[2], true - drift, 10, 10)[1],
    make(TrainingStateAverager, dhts[3], true + 3 * drift, 9, 9)[1],  # an epoch behind: the round before
    make(TrainingStateAverager, dhts[4], -10 * true, 10, 100)[1],  # a wrecked model claiming the newest epoch
    make(TrainingStateAverager, dhts[5], true + 4 * drift, 12, 50)[1],  # a plausible model, a newer epoch claimed
]
time.sleep(2)
if own:
    peers_averaged = 1 + downloader.average_with_peers(3, timeout=20)
else:
    downloader.load_state_from_peers(timeout=20)
    peers_averaged = downloader.last_download_peers
with torch.no_grad():
    error = float((model.weight - true).abs().max())
print(json.dumps({"error_from_the_mean": round(error, 6), "peers": peers_averaged,
                  "refused": downloader.refused_states, "epoch": downloader.local_epoch}), flush=True)
for a in [downloader, *peers]: a.shutdown()
for d in dhts: d.shutdown()
"""


@pytest.mark.parametrize("consensus_peers", ["4", "1", "own"])
def test_a_consensus_download_loads_the_mean_of_the_peers_at_the_newest_epoch(consensus_peers: str) -> None:
    """The coordinator's checkpoints are the mean of several peers' models (each peer drifts from the
    swarm's by its own steps between two rounds), and so is the model a peer evaluates when it stops (``own``:
    its parameters and the others'); the peer behind, the wrecked model and the peer alone at the newer
    epoch it claims are left out. Downloading one state (``1``, hivemind's way) takes the claimant's."""
    outcome, log = run_peer_script(_CONSENSUS_SCRIPT, consensus_peers, timeout=180)
    drift = 0.05 * 0.5  # the drift pattern's scale, well above float rounding, well below its largest value
    if consensus_peers == "4":
        assert outcome["error_from_the_mean"] < 1e-6, log[-3000:]
        assert outcome["peers"] == 2, log[-3000:]
    elif consensus_peers == "own":  # (own + 2 x drift) and two peers' (true - drift): true
        assert outcome["error_from_the_mean"] < 1e-6, log[-3000:]
        assert outcome["peers"] == 3, log[-3000:]
    else:  # one peer's model, drift and all: the one that claims the newest epoch
        assert outcome["error_from_the_mean"] > drift and outcome["peers"] == 1, log[-3000:]
    assert outcome["refused"] == 1, log[-3000:]
    assert outcome["epoch"] == (12 if consensus_peers == "1" else 10), log[-3000:]
