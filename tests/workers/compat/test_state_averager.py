"""The guarded state averager and DiLoCo's (:mod:`workers.compat.state_averager`): the RPC names, no NaN in
or out, local steps during a round; with real hivemind averagers."""

from __future__ import annotations

import pytest

from tests.workers.compat.peers import MAKE_STATE_AVERAGER, run_peer_script


def test_the_diloco_averager_speaks_the_plain_averagers_protocol() -> None:
    """hivemind names RPCs after the class; the coordinator's checkpointer is a plain TrainingStateAverager."""
    from hivemind.optim.state_averager import TrainingStateAverager

    from workers.compat import OuterStepStateAverager

    for method in ("rpc_download_state", "rpc_join_group", "rpc_aggregate_part"):
        plain = TrainingStateAverager._get_handle_name("run_state_averager", method)
        assert OuterStepStateAverager._get_handle_name("run_state_averager", method) == plain
        assert plain == f"run_state_averager::TrainingStateAverager.{method}"


_GUARD_SCRIPT = (
    r"""
import json, sys, threading, time
from functools import partial
import hivemind, torch
from hivemind.optim.state_averager import TrainingStateAverager
from workers import compat

PREFIX = "guard_state_averager"
"""
    + MAKE_STATE_AVERAGER
    + r"""
first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
honest_model, honest = make(first, 1.0)
other_model, other = make(second, float(sys.argv[1]), cls=TrainingStateAverager)  # a plain (or hostile) peer
result = {}
threads = [threading.Thread(target=a.step, kwargs=dict(averaging_round=True, delay_averaging=False))
           for a in (honest, other)]
for t in threads: t.start()
for t in threads: t.join(60)
result["after_round"] = honest_model.weight[0, 0].item()
other.state_sharing_priority, honest.state_sharing_priority = 10, 0
time.sleep(1)
honest.load_state_from_peers(timeout=20)
result["after_download"] = honest_model.weight[0, 0].item()
# the guarded peer breaks; a plain peer asks it for its state
with torch.no_grad():
    for p in honest_model.parameters():
        p.fill_(float("nan"))
    for p in other_model.parameters():
        p.fill_(5.0)
other.state_sharing_priority, honest.state_sharing_priority = 0, 20
time.sleep(1)
other.load_state_from_peers(timeout=20)
result["served"] = other_model.weight[0, 0].item()
result["refused"] = [honest.refused_rounds, honest.refused_states]
print(json.dumps(result), flush=True)
for a in (honest, other): a.shutdown()
for d in (first, second): d.shutdown()
"""
)


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        ("3.0", {"after_round": 2.0, "after_download": 2.0, "served": 5.0, "refused": [0, 0]}),
        ("nan", {"after_round": 1.0, "after_download": 1.0, "served": 5.0, "refused": [1, 1]}),
    ],
)
def test_no_nan_enters_or_leaves_a_peer_through_averaging_or_state_downloads(
    other: str, expected: dict[str, object]
) -> None:
    """A peer averaging with (or downloading from) one whose parameters are NaN keeps its own; a finite
    partner averages as before; a peer whose own state broke does not serve it."""
    outcome, log = run_peer_script(_GUARD_SCRIPT, other, timeout=180)
    assert outcome == expected, log[-3000:]


_BACKGROUND_ROUND_SCRIPT = (
    r"""
import json, threading, time
from functools import partial
import hivemind, torch
from workers import compat

compat.install_calm_matchmaking()

PREFIX = "background_state_averager"
"""
    + MAKE_STATE_AVERAGER
    + r"""
first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
model, peer = make(first, 1.0, delta_rule_averaging=True)
_, partner = make(second, 3.0, delta_rule_averaging=True)
partner_joined = threading.Event()

def join_late():
    partner_joined.set()
    partner.step(averaging_round=True, delay_averaging=False)

peer.step(averaging_round=True, delay_averaging=True)  # the round runs in the background
deadline = time.monotonic() + 30
while getattr(peer, "_old_tensors", None) is None and time.monotonic() < deadline:
    time.sleep(0.01)  # until the round has taken its copy of the parameters
joiner = threading.Timer(3.0, join_late)  # the partner is late: the round cannot end before it joins
joiner.start()
for _ in range(10):  # local steps while the round waits for the partner
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    peer.step(optimizer_step=True)
steps_before_partner = not partner_joined.is_set()
joiner.join()
deadline = time.monotonic() + 60
while not peer.finished_averaging_round.is_set() and time.monotonic() < deadline:
    time.sleep(0.05)
for p in model.parameters():
    p.grad = torch.ones_like(p)
peer.step(optimizer_step=True)  # applies the round's result, then steps
print(json.dumps({"steps_before_partner": steps_before_partner,
                  "weight": round(model.weight[0, 0].item(), 4), "bias": round(model.bias[0].item(), 4)}),
      flush=True)
for a in (peer, partner): a.shutdown()
for d in (first, second): d.shutdown()
"""
)


def test_local_steps_go_on_while_an_averaging_round_runs_and_keep_their_progress() -> None:
    """A peer of the local-updates modes keeps stepping while its averaging round waits for a late partner
    (hivemind 1.1.12 blocked every step until the round ended), and the round's result is applied by the
    delta rule: the average of what the peers contributed (1 and 3), plus the 11 local steps of -0.1."""
    outcome, log = run_peer_script(_BACKGROUND_ROUND_SCRIPT, timeout=180)
    assert outcome == {"steps_before_partner": True, "weight": 0.9, "bias": 0.9}, log[-3000:]
