"""The spot check's judgement (``spotchecks.judge_loss``) and the loss it recomputes
(``coordinator.swarm.spotchecker.shard_loss``), against real training of the tiny shapes-dalle model."""

from __future__ import annotations

import math

import pytest

from coordinator.credit import spotchecks


@pytest.mark.parametrize(
    ("reported", "recomputed", "extra", "passed"),
    [
        (3.0, 2.5, {}, True),  # the model moved on since the peer's steps: an honest report is higher
        (5.2, 1.0, {"untrained": 5.5}, True),  # early in a run the loss falls fast; still no upper limit
        (2.3, 2.4, {}, True),  # the noise of a few micro-batches
        (2.0, 2.8, {"control": 2.1}, True),  # a hard shard: the control data says what the model reaches
        (0.001, 2.3, {}, False),  # made up
        (0.5, 2.3, {"control": 2.2}, False),  # fitted to other (easier) data, then reported
        (1e3, 2.3, {"untrained": 5.5}, False),  # far worse than no training at all
        (None, 2.3, {}, False),
        (float("nan"), 2.3, {}, False),
        (2.0, float("inf"), {}, False),
    ],
)
def test_judge_loss_fails_only_what_honest_training_cannot_report(
    reported: float | None, recomputed: float, extra: dict[str, float], passed: bool
) -> None:
    verdict, detail = spotchecks.judge_loss(reported, recomputed, **extra)
    assert verdict is passed, detail
    if not passed and reported is not None and math.isfinite(reported) and math.isfinite(recomputed):
        assert "outside the tolerance" in detail


def test_an_honest_peers_training_loss_passes_and_a_made_up_one_fails() -> None:
    """Train the tiny model the way a worker does (AdamW, micro-batches of 16, the loss EMA it reports), one
    lease per shard, and check each lease with the model as it is after all of them, and right away."""
    import torch

    from coordinator.swarm.spotchecker import shard_loss
    from workers.tasks import load_task

    torch.manual_seed(0)
    torch.set_num_threads(1)
    spec = load_task("shapes-dalle")
    config = spec.make_config({"preset": "tiny", "samples_per_shard": 64})
    runtime = spec.build_runtime(config)
    model = runtime.build_model()
    untrained_model = runtime.build_model()
    optimizer = runtime.make_optimizer(model.parameters())
    ema: float | None = None
    leases: list[tuple[int, int, float]] = []
    immediate: list[bool] = []
    for shard in range(6):
        seed = 100 + shard
        for batch in runtime.shard_batches(shard, batch_size=16, seed=seed):
            loss = runtime.loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            value = float(loss.detach())
            ema = value if ema is None else 0.95 * ema + 0.05 * value
        assert ema is not None
        leases.append((shard, seed, ema))
        # judged at once (the shared model exactly where this peer left it)
        now = shard_loss(runtime, model, shard=shard, seed=seed, micro_batch_size=16)
        immediate.append(spotchecks.judge_loss(ema, now)[0])
    assert all(immediate), leases
    first_loss = leases[0][2]
    assert leases[-1][2] < first_loss  # it learned, so the later checks see a model far ahead of the reports
    for shard, seed, reported in leases:
        args = {"seed": seed, "micro_batch_size": 16}
        recomputed = shard_loss(runtime, model, shard=shard, **args)
        control = shard_loss(runtime, model, shard=1000 + shard, **args)
        untrained = shard_loss(runtime, untrained_model, shard=shard, **args)
        passed, detail = spotchecks.judge_loss(reported, recomputed, control=control, untrained=untrained)
        assert passed, detail
        # the same check with a made-up loss fails: tiny, or half of what the shared model reaches now
        for made_up in (0.01, recomputed / 2, 50 * untrained):
            assert not spotchecks.judge_loss(made_up, recomputed, control=control, untrained=untrained)[0]
    # the recomputed loss is bounded: a few micro-batches of the peer's own order, at most 64 samples
    assert math.isfinite(shard_loss(runtime, model, shard=0, seed=1, micro_batch_size=1000))
