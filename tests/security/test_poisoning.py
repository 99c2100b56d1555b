"""A poisoning volunteer cannot wreck the shared model: a real three-peer swarm (``serve`` and three
``volunteer-app join`` processes) in which mallory runs a modified copy of the software
(``tests/security/poisoner``): every gradient she contributes is reversed and amplified a thousandfold, and
the parts of the average she reduces come back as garbage. The two honest peers must keep learning, and
their workers must say whose numbers they left out. The same swarm without mallory's poison, side by side,
is ``tests/perf/bench_poisoning.py`` (README, reliability section)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.security.poisoning import HONEST, run_swarm

pytestmark = pytest.mark.swarm


@pytest.mark.timeout(600)
def test_honest_peers_keep_learning_while_one_peer_poisons_its_gradients(tmp_path: Path) -> None:
    result = run_swarm(tmp_path, poison="gradients", mode="gradients", seconds=60)
    for name in HONEST:
        status = result["final"][name]
        curve = [loss for _, loss in result["curves"][name]]
        assert curve and all(math.isfinite(loss) for loss in curve), (name, curve)
        # untrained, the loss is ~6.9; a swarm that follows mallory's ascent goes up or to NaN instead
        assert status["loss"] < status["first_loss"] - 1.5, (name, status["first_loss"], curve)
        assert max(curve) < status["first_loss"] + 0.5, (name, curve)
        assert status["averaging_rounds"] >= 5, "the honest peers still average (with each other)"
        assert result["refusals"][name] >= 1, f"{name}'s worker never said it left mallory's numbers out"
