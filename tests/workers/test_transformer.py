"""Tests of the transformer both built-in tasks share (``workers.tasks.transformer``).

A seed must keep building the same weights and a forward pass must keep computing the same outputs:
checkpoints name their tensors by the model's parameter names, and a refactor that reorders a reshape
or an initialisation would silently change what every run starts from.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import NamedTuple

import pytest
import torch

from workers.tasks.transformer import CausalTransformer, Features, TransformerShape

SHAPE = TransformerShape(vocab_size=40, max_len=16, d_model=32, n_layers=2, n_heads=4)
FEATURES = Features(
    tokens=tuple((i % 5, 5 + i % 3) for i in range(40)), positions=tuple((i % 4,) for i in range(16))
)
SEED = 1234


class Recorded(NamedTuple):
    """What the model built from ``SHAPE`` and ``SEED`` gave before it moved out of ``shapes_dalle/``."""

    layout: str
    """SHA-256 of the ``(name, shape)`` list of its parameters (exact on every machine)."""
    num_parameters: int
    weights: tuple[float, float]
    """:func:`_checksums` of the initial parameters."""
    hidden: tuple[float, float]
    """:func:`_checksums` of ``model(TOKENS)``."""
    logits: tuple[float, float]
    """:func:`_checksums` of ``model.logits(model(TOKENS))``."""


# Recorded from workers/tasks/shapes_dalle/transformer.py at commit 85b03432cf35 (before the move to
# workers/tasks/transformer.py), torch 2.13.0 on an x86-64 CPU with AVX2. The moved module gave
# byte-identical parameters, hidden states and logits (SHA-256 of their bytes) on that machine. The test
# compares float64 checksums rather than those hashes because the bytes themselves differ in the last
# bit between CPU kinds (torch's vectorised randn and matmul kernels round differently): with
# ATEN_CPU_CAPABILITY=default the weighted sums below move by under 3e-6 and the sums of squares by
# under 3e-8 of their value, well inside the tolerances, while a changed model moves them by far more.
RECORDED = {
    "plain": Recorded(
        layout="9c5dfb2e54585f931438dae67882e19bfbb175d3fc9ad3d5b4ff056ae2db3bc9",
        num_parameters=28584,
        weights=(-6.52377158986232, 168.09145973283336),
        hidden=(0.6153637837219268, 1012.6073696417274),
        logits=(-3.956977734442968, 16.01803046681998),
    ),
    "features": Recorded(
        layout="5d03a07e78b1b81c30edaa32d3f128cac3375e256f3db4b161539bf04c7313ea",
        num_parameters=29232,
        weights=(-1.956485381600818, 168.3882808747148),
        hidden=(-0.6074424395995175, 1018.8578593163985),
        logits=(8.113609629916919, 53.4975439298192),
    ),
}


def _checksums(tensors: Iterable[torch.Tensor]) -> tuple[float, float]:
    """``(ramp-weighted sum, sum of squares)`` of all values, in float64: the first moves when values
    trade places (a wrong reshape), the second when they are scaled (a wrong initialisation)."""
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    ramp = torch.linspace(-1.0, 1.0, len(flat), dtype=torch.float64)
    return float((flat * ramp).sum()), float((flat * flat).sum())


@pytest.mark.parametrize("variant", ["plain", "features"])
def test_seeded_model_matches_the_recorded_weights_and_outputs(variant: str) -> None:
    recorded = RECORDED[variant]
    model = CausalTransformer(SHAPE, seed=SEED, features=FEATURES if variant == "features" else None).eval()
    layout = [(name, tuple(parameter.shape)) for name, parameter in model.named_parameters()]
    assert hashlib.sha256(repr(layout).encode()).hexdigest() == recorded.layout
    assert model.num_parameters() == recorded.num_parameters
    assert _checksums(model.parameters()) == pytest.approx(recorded.weights, rel=1e-6, abs=1e-4)
    tokens = (torch.arange(2 * 16) * 7 % 40).view(2, 16)  # (B, T) = (2, 16), every id reachable
    with torch.no_grad():
        hidden = model(tokens)  # (B, T, C)
        logits = model.logits(hidden)  # (B, T, V)
    assert hidden.shape == (2, 16, 32) and logits.shape == (2, 16, 40)
    assert _checksums([hidden]) == pytest.approx(recorded.hidden, rel=1e-6, abs=1e-4)
    assert _checksums([logits]) == pytest.approx(recorded.logits, rel=1e-6, abs=1e-4)
