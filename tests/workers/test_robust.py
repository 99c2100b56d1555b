"""Robust averaging (workers/robust.py): the aggregation rule, and hivemind's reducer running it."""

from __future__ import annotations

import asyncio

import torch

from workers import robust


def _honest(n: int, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=g)
    return [base + 0.01 * torch.randn(size, generator=g) for _ in range(n)]


def test_an_honest_group_averages_as_before() -> None:
    parts = _honest(3)
    average, radius, rejected = robust.robust_average(parts, [1.0, 2.0, 1.0], own_index=0)
    plain = (parts[0] + 2 * parts[1] + parts[2]) / 4
    assert rejected == [] and radius is not None
    assert torch.allclose(average, plain, atol=2e-3)


def test_non_finite_contributions_are_left_out_not_weighted() -> None:
    parts = _honest(3)
    for poison in (float("nan"), float("inf"), float("-inf")):
        bad = parts[2].clone()
        bad[17] = poison
        average, _, rejected = robust.robust_average([parts[0], parts[1], bad], [1.0, 1.0, 1.0], own_index=0)
        assert rejected == [2] and torch.isfinite(average).all()
        assert torch.allclose(average, (parts[0] + parts[1]) / 2, atol=1e-5)
    # a non-finite or negative weight is refused too (0 * NaN would be NaN)
    _, _, rejected = robust.robust_average(parts, [1.0, float("nan"), -1.0], own_index=0)
    assert rejected == [1, 2]


def test_a_huge_contribution_moves_the_average_by_at_most_the_honest_spread() -> None:
    parts = _honest(3)
    honest_mean = (parts[0] + parts[1]) / 2
    spread = max(float((p - honest_mean).norm()) for p in parts[:2])
    for scale in (1e3, 1e6, 1e30):
        huge = torch.full_like(parts[0], scale)
        average, radius, _ = robust.robust_average([parts[0], parts[1], huge], [1.0, 1.0, 1.0], own_index=0)
        assert radius is not None
        moved = float((average - honest_mean).norm())
        # the documented bound: ITERATIONS * share * radius, radius ~ the honest peers' distance to the centre
        assert moved <= robust.ITERATIONS * radius / 3 + 1e-4
        assert moved < 4 * spread, (scale, moved, spread)
    # the plain mean would have moved by about the poison's norm
    assert float(((parts[0] + parts[1] + huge) / 3 - honest_mean).norm()) > 1e20


def test_a_huge_weight_is_capped() -> None:
    parts = _honest(3)
    parts[2] = parts[2] + 5.0
    average, _, _ = robust.robust_average(parts, [1.0, 1.0, 1e12], own_index=0)
    capped = robust.robust_average(parts, [1.0, 1.0, robust.WEIGHT_CAP], own_index=0)[0]
    assert torch.allclose(average, capped)


def test_a_pair_trusts_its_own_part_and_clips_the_other() -> None:
    own, other = _honest(2)
    average, radius, _ = robust.robust_average([own, other], [1.0, 1.0], own_index=0)
    assert torch.allclose(average, (own + other) / 2, atol=1e-5)  # an honest partner: plain average
    huge = torch.full_like(own, 1e20)
    average, radius, _ = robust.robust_average([own, huge], [1.0, 1.0], own_index=0, pair_radius=0.5)
    assert radius == 0.5 and float((average - own).norm()) <= robust.ITERATIONS * 0.5 / 2 + 1e-4
    # without a remembered radius, the radius is the own part's norm
    average, radius, _ = robust.robust_average([own, huge], [1.0, 1.0], own_index=0)
    assert radius is not None and abs(radius - float(own.norm())) < 1e-3
    assert float((average - own).norm()) <= robust.ITERATIONS * radius / 2 + 1e-3


def test_nothing_finite_gives_nan_so_every_sender_keeps_its_own() -> None:
    bad = torch.full((4,), float("nan"))
    average, _, rejected = robust.robust_average([bad, bad], [1.0, 1.0])
    assert rejected == [0, 1] and torch.isnan(average).all()


def test_hivemind_reducer_with_the_robust_rule() -> None:
    """The reducer as hivemind's all-reduce drives it: three senders, two parts, one poisoner."""

    async def run() -> list[list[torch.Tensor]]:
        shapes = (torch.Size([64]), torch.Size([32]))
        reducer = robust.RobustTensorPartReducer(shapes, 3, own_sender_index=0, kind="test")
        g = torch.Generator().manual_seed(1)
        honest = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
        poison = [torch.full(shapes[0], float("nan")), torch.full(shapes[1], 1e30)]
        inputs = [*honest, poison]

        async def sender(index: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(index, p, inputs[index][p], weight=1.0) for p in range(2)]

        results = await asyncio.gather(*(sender(i) for i in range(3)))
        expected0 = (honest[0][0] + honest[1][0]) / 2
        assert torch.allclose(results[0][0], expected0, atol=1e-5)  # NaN part left out
        assert torch.isfinite(results[0][1]).all()
        spread = float((honest[0][1] - honest[1][1]).norm())
        assert float((results[0][1] - (honest[0][1] + honest[1][1]) / 2).norm()) < 2 * spread
        assert all(torch.equal(results[0][p], results[i][p]) for i in range(3) for p in range(2))
        return results

    before = robust.rejected_contributions
    asyncio.run(run())
    assert robust.rejected_contributions == before + 1
