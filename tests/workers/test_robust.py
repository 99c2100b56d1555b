"""Robust averaging's maths (``workers.robust``): what a reducer makes of its group's contributions and what a
receiver accepts from other reducers. The end-to-end defence, with real peers, is in
``tests/security/test_poisoning.py``."""

from __future__ import annotations

import torch

from workers.robust import (
    centered_clip,
    robust_mean,
    screen_deltas,
    size_of,
    state_loss_problem,
)


def _honest(n: int, d: int = 2000, spread: float = 0.1, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    center = torch.randn(d, generator=g)
    return [center + spread * torch.randn(d, generator=g) for _ in range(n)]


def test_honest_groups_are_averaged_exactly_as_hivemind_would() -> None:
    for n in (1, 2, 3, 4, 5):
        parts = _honest(n, seed=n)
        weights = [1.0 + i for i in range(n)]  # within twice the median: not capped
        expected = sum(w * p for w, p in zip(weights, parts, strict=True)) / sum(weights)
        got = robust_mean(list(zip(parts, weights, strict=True)), parts[0].shape)
        assert torch.allclose(got, expected, atol=1e-5), n


def test_a_huge_or_non_finite_contribution_is_left_out() -> None:
    honest = _honest(2)
    honest_mean = (honest[0] + honest[1]) / 2
    for poison in (torch.full((2000,), 1e9), -1e3 * honest_mean, torch.full((2000,), float("nan"))):
        dropped: list[int] = []
        got = robust_mean([(honest[0], 1.0), (poison, 1.0), (honest[1], 1.0)], honest[0].shape, dropped)
        assert torch.allclose(got, honest_mean, atol=1e-5) and dropped == [1]


def test_a_subtle_outlier_moves_the_average_by_at_most_a_share_of_the_honest_spread() -> None:
    honest = _honest(4)
    honest_mean = sum(honest) / 4
    spread = float((honest[0] - honest_mean).norm())
    subtle = honest_mean - 3 * spread * honest_mean / honest_mean.norm()  # within the outlier limit
    dropped: list[int] = []
    got = robust_mean([(p, 1.0) for p in honest] + [(subtle, 1.0)], honest[0].shape, dropped)
    assert dropped == []
    assert float((got - honest_mean).norm()) < spread
    # a plain mean would have been wrecked
    assert float(((honest[0] + honest[1] + 1e9) / 3 - honest_mean).norm()) > 1e9


def test_a_peer_cannot_outweigh_the_group_by_claiming_a_huge_weight() -> None:
    honest = _honest(3)
    poison = torch.full((2000,), 100.0)
    parts = [(p, 1.0) for p in honest] + [(poison, 1e6)]
    got = robust_mean(parts, poison.shape)
    honest_mean = sum(honest) / 3
    assert float((got - honest_mean).norm()) < float((poison - honest_mean).norm()) / 10


def test_nothing_usable_gives_nan_which_receivers_refuse() -> None:
    nan = torch.full((4,), float("nan"))
    assert torch.isnan(robust_mean([(nan, 1.0), (torch.ones(4), 0.0)], (4,))).all()
    assert torch.isnan(robust_mean([], (4,))).all(), "all senders left: no 0/0 average is made up"


def test_centered_clip_returns_the_median_when_contributions_agree() -> None:
    points = torch.stack([torch.ones(5), torch.ones(5), torch.full((5,), 50.0)])
    assert torch.equal(centered_clip(points, torch.full((3,), 1 / 3)), torch.ones(5))


def test_receivers_refuse_non_finite_and_outlandish_answers() -> None:
    inputs = [[torch.ones(100)], [torch.ones(100) * 2], [torch.ones(100) * 3]]
    own_delta = torch.full((100,), 0.1)  # this peer's own part moved by 10% of its size
    honest_delta = torch.full((100,), -0.15)
    hostile_delta = torch.full((100,), 1e6)
    deltas = [[own_delta.clone()], [honest_delta.clone()], [hostile_delta.clone()]]
    report = screen_deltas(deltas, inputs, own_index=0, senders=3)
    assert torch.equal(deltas[1][0], honest_delta), "an honest answer is kept as it is"
    assert torch.equal(deltas[2][0], torch.zeros(100)), "refused: this peer keeps its own values"
    assert report.refused_parts == {2: 1} and report.non_finite_parts == 0

    deltas = [[own_delta.clone()], [torch.full((100,), float("inf"))], [honest_delta.clone()]]
    report = screen_deltas(deltas, inputs, own_index=0, senders=2)
    assert torch.equal(deltas[1][0], torch.zeros(100)) and report.non_finite_parts == 1
    assert torch.equal(deltas[2][0], honest_delta), "a group of two has no robust reference"

    deltas = [[own_delta.clone()], [hostile_delta.clone()]]
    report = screen_deltas(deltas, inputs[:2], own_index=0, senders=2)
    assert torch.equal(deltas[1][0], torch.zeros(100)), "an absurd answer is refused even in a group of two"

    moderate = torch.full((100,), 5.0)  # 2.5 times the part's size: within the hard limit
    deltas = [[], [hostile_delta.clone()], [moderate.clone()]]
    report = screen_deltas(deltas, inputs, own_index=None, senders=3)
    assert report.refused_parts == {1: 1} and torch.equal(deltas[2][0], moderate), (
        "a client peer: hard limit only"
    )

    params = [[torch.ones(100)], [torch.ones(100)], [torch.zeros(100)]]  # the last one: a fresh bias
    deltas = [[torch.full((100,), 0.01)], [torch.full((100,), 5.5)], [torch.full((100,), 0.004)]]
    report = screen_deltas(deltas, params, own_index=0, senders=3, kind="parameters")
    assert report.refused_parts == {1: 1}, "parameters: an absurd change (a partner's x -10) is refused"
    assert torch.equal(deltas[2][0], torch.full((100,), 0.004)), "a bias near zero may still move"


def test_honest_partners_far_apart_early_in_training_are_averaged_not_refused() -> None:
    """Two peers start from the same weights; early Adam steps move small weights farther than their size,
    in directions that partly disagree. Refusing such a part would keep it unaveraged for good (the peers
    drift on apart), as the real demo's first round did to two attention weights at the old bound."""
    torch.manual_seed(0)
    start = 0.02 * torch.randn(12288)  # a qkv weight at initialisation (std 0.02)
    moved = 0.05 * torch.randn(12288)  # where this peer's steps took it; the partner's went the other way
    mine = start + moved + 0.01 * torch.randn(12288)
    theirs = start - moved + 0.01 * torch.randn(12288)
    apart = float((theirs - mine).norm()) / size_of(mine, "parameters")
    assert 1.5 < apart < 2.2, "about as far apart as measured (2.1 times the part's size)"

    dropped: list[int] = []
    got = robust_mean([(mine, 1.0), (theirs, 1.0)], mine.shape, dropped, own=0, kind="parameters")
    assert dropped == [] and torch.allclose(got, (mine + theirs) / 2), "the reducer averages with its partner"

    deltas = [[(mine + theirs) / 2 - mine], [(mine + theirs) / 2 - mine]]
    report = screen_deltas(deltas, [[mine], [mine]], own_index=0, senders=2, kind="parameters")
    assert not report and torch.allclose(deltas[1][0], (theirs - mine) / 2), (
        "the receiver applies the average"
    )

    poisoned = -10 * theirs  # tests/security/poisoner's contribution
    got = robust_mean([(mine, 1.0), (poisoned, 1.0)], mine.shape, dropped, own=0, kind="parameters")
    assert dropped == [1] and torch.equal(got, mine), "a partner's parameters x -10 are still left out"
    deltas = [[torch.zeros(12288)], [(mine + poisoned) / 2 - mine]]
    report = screen_deltas(deltas, [[mine], [mine]], own_index=0, senders=2, kind="parameters")
    assert report.refused_parts == {1: 1}, "and an average that includes them is refused"
    expected = float(((mine + poisoned) / 2 - mine).norm()) / size_of(mine, "parameters")
    assert abs(report.largest_refused - expected) < 1e-3 and expected > 2.0, "how far over the bound it was"


def test_in_a_group_of_two_a_reducer_trusts_its_own_numbers_over_absurd_ones() -> None:
    mine, theirs = _honest(2)
    dropped: list[int] = []
    got = robust_mean([(mine, 1.0), (-1000 * theirs, 1.0)], mine.shape, dropped, own=0)
    assert torch.equal(got, mine) and dropped == [1]
    got = robust_mean([(mine, 1.0), (theirs, 1.0)], mine.shape, dropped, own=0)
    assert torch.allclose(got, (mine + theirs) / 2), "an honest partner is averaged with"


def test_a_served_state_is_refused_only_when_its_loss_is_far_worse_than_the_peers_own() -> None:
    # a fresh joiner (untrained, ~6.9) takes a trained state, and a peer that is behind takes a newer one
    assert state_loss_problem(6.9, 0.4) is None
    assert state_loss_problem(1.2, 1.1) is None
    # a loss spike in an honest swarm (twice as wrong, but within 2 nats) is still the swarm's state
    assert state_loss_problem(0.5, 2.9) is None
    # a wrecked model, or one whose numbers overflow, is not
    problem = state_loss_problem(6.9, 180.0)
    assert problem is not None and "180" in problem and "6.9" in problem
    assert state_loss_problem(0.5, 3.1) is not None
    assert state_loss_problem(0.5, float("nan")) is not None
    # a peer whose own model broke takes any finite state
    assert state_loss_problem(float("nan"), 50.0) is None


def test_diverse_honest_contributions_within_the_clipping_radius_are_averaged_exactly() -> None:
    """Volunteers with different data send gradients with no common centre (independent directions, sizes
    within a factor of two): every one lies within CenteredClip's radius, and the result is hivemind's weighted
    mean to float precision, not CenteredClip's approximation of it."""
    g = torch.Generator().manual_seed(7)
    for n in (3, 4, 6):
        parts = [(0.5 + i / n) * torch.randn(4096, generator=g) for i in range(n)]
        weights = [1.0 + 0.5 * i for i in range(n)]  # within twice the median weight
        expected = sum(w * p for w, p in zip(weights, parts, strict=True)) / sum(weights)
        dropped: list[int] = []
        got = robust_mean(list(zip(parts, weights, strict=True)), parts[0].shape, dropped, own=0)
        assert dropped == [] and torch.allclose(got, expected, rtol=0, atol=1e-6), n


def test_a_reducer_whose_own_gradient_part_is_zero_still_averages_its_partners() -> None:
    """Embedding rows of tokens this peer's batches never held have a zero gradient: its partners' gradients
    for them are not "farther than 20 times its own" (were: every partner left out, the average zero)."""
    g = torch.Generator().manual_seed(3)
    partner, other = (
        torch.randn(2000, generator=g),
        torch.randn(2000, generator=g),
    )  # diverse, as non-IID data
    zero = torch.zeros_like(partner)
    rms = float(
        partner.pow(2).mean().sqrt()
    )  # this peer's whole gradient: as large as its partners' elsewhere
    for parts in ([zero, partner], [zero, partner, other]):
        dropped: list[int] = []
        got = robust_mean([(p, 1.0) for p in parts], zero.shape, dropped, own=0, rms=rms)
        assert dropped == [] and torch.allclose(got, sum(parts) / len(parts), atol=1e-6), len(parts)
    # absurd contributions are still refused there
    dropped = []
    got = robust_mean([(zero, 1.0), (1e6 * partner, 1.0)], zero.shape, dropped, own=0, rms=rms)
    assert dropped == [1] and torch.equal(got, zero)


def test_a_receiver_whose_own_gradient_part_is_zero_applies_the_honest_average() -> None:
    """The receiving side of the same case: another reducer's honest average of a part this peer's gradient
    left at zero is applied (was: refused as an infinitely large change, so this peer never learnt those rows
    from the swarm), and an absurd one is still refused."""
    g = torch.Generator().manual_seed(5)
    mine, theirs, third = (torch.randn(2000, generator=g) for _ in range(3))  # diverse, as non-IID data
    own_part, zero_part = mine[:1000], torch.zeros(1000)
    average_part = (theirs[1000:] + third[1000:]) / 3  # this peer contributed zeros to it
    own_average = (mine[:1000] + theirs[:1000] + third[:1000]) / 3
    deltas = [[own_average - own_part], [average_part - zero_part]]
    report = screen_deltas(deltas, [[own_part], [zero_part]], own_index=0, senders=3)
    assert not report and torch.equal(deltas[1][0], average_part)
    deltas = [[own_average - own_part], [1e4 * average_part]]
    report = screen_deltas(deltas, [[own_part], [zero_part]], own_index=0, senders=3)
    assert report.refused_parts == {1: 1} and not deltas[1][0].any()


def _hivemind_group(seed: int) -> list[torch.Tensor]:
    """hivemind's test_allreduce_once tensors: randn, rand, -rand and randn ** 3 (heavy-tailed)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(123, generator=g),
        torch.rand(123, generator=g),
        -torch.rand(123, generator=g),
        torch.randn(123, generator=g) ** 3,
    ]


def test_a_diverse_honest_group_is_averaged_exactly_unless_one_lies_beyond_the_clipping_radius() -> None:
    """The deliberate difference hivemind's own test_allreduce_once meets (docs/averaging.md#what-robust-averaging-
    changes): its group is averaged exactly when the heavy-tailed randn ** 3 lies within CenteredClip's radius
    (4 times the median distance), here 2.3 times; at 9.2 times it is pulled in, not left out, and the result
    lies between the median and the mean."""
    exact = _hivemind_group(3)
    dropped: list[int] = []
    got = robust_mean([(p, 1.0) for p in exact], exact[0].shape, dropped)
    assert dropped == [] and torch.allclose(got, sum(exact) / 4, rtol=0, atol=1e-6)

    far = _hivemind_group(0)
    mean, median = sum(far) / 4, torch.stack(far).median(dim=0).values
    got = robust_mean([(p, 1.0) for p in far], far[0].shape, dropped)
    assert dropped == [], "within 10 times the median distance: clipped, not left out"
    assert not torch.allclose(got, mean, atol=1e-3)
    assert float((got - median).norm()) < float((mean - median).norm())
    assert float((got - mean).norm()) < float((mean - median).norm())
