"""The optimizer's parts: learning-rate schedule, parameter groups, DiLoCo's outer step (no swarm)."""

from __future__ import annotations

import math

import pytest
import torch

from workers.optim import (
    OuterNesterov,
    ScheduleSettings,
    adamw,
    lr_multiplier,
    make_scheduler_factory,
    param_groups,
)
from workers.tasks import TaskConfigError, load_task


def test_warmup_rises_linearly_and_never_starts_at_zero() -> None:
    kwargs = {"schedule": "constant", "warmup_samples": 1000, "decay_samples": 1, "min_lr_ratio": 0.0}
    values = [lr_multiplier(s, **kwargs) for s in (0, 250, 500, 999, 1000, 50_000)]
    assert values[0] > 0, "the first epoch must not be wasted at learning rate 0"
    assert values[1] == pytest.approx(0.25) and values[2] == pytest.approx(0.5)
    assert values[3] < 1.0 and values[4] == values[5] == 1.0


def test_cosine_decays_to_its_floor_and_stays_there() -> None:
    kwargs = {"schedule": "cosine", "warmup_samples": 100, "decay_samples": 1000, "min_lr_ratio": 0.1}
    assert lr_multiplier(100, **kwargs) == pytest.approx(1.0)
    assert lr_multiplier(600, **kwargs) == pytest.approx(0.55)  # half way: the midpoint of 1 and 0.1
    assert lr_multiplier(1100, **kwargs) == pytest.approx(0.1)
    assert lr_multiplier(10**7, **kwargs) == pytest.approx(0.1)
    decay = [lr_multiplier(s, **kwargs) for s in range(100, 1200, 50)]
    assert decay == sorted(decay, reverse=True)


def test_inverse_sqrt_halves_at_three_time_scales_and_respects_the_floor() -> None:
    kwargs = {"schedule": "inverse_sqrt", "warmup_samples": 0, "decay_samples": 1000, "min_lr_ratio": 0.2}
    assert lr_multiplier(0, **kwargs) == 1.0
    assert lr_multiplier(3000, **kwargs) == pytest.approx(0.5)
    assert lr_multiplier(10**9, **kwargs) == pytest.approx(0.2)


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown learning-rate schedule"):
        lr_multiplier(10, schedule="linear", warmup_samples=0, decay_samples=1, min_lr_ratio=0)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_scheduler_follows_the_global_epoch_as_hivemind_steps_it() -> None:
    """hivemind steps the scheduler until its step count passes the epoch (also after loading state)."""
    settings = ScheduleSettings(
        peak_lr=1e-3, schedule="cosine", warmup_samples=2048, decay_samples=10_000, min_lr_ratio=0.1
    )
    model = torch.nn.Linear(4, 4)
    optimizer = adamw(model.parameters(), lr=settings.peak_lr)
    scheduler = make_scheduler_factory(settings, samples_per_epoch=1024)(optimizer)
    for epoch in (0, 1, 5, 11, 40):  # a late joiner jumps epochs at once
        while scheduler._step_count <= epoch:
            scheduler.step()
        expected = settings.lr_at((epoch + 0.5) * 1024)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(settings.peak_lr * 0.1)  # the floor


def test_parameter_groups_exempt_norms_biases_and_embeddings_from_decay() -> None:
    spec = load_task("shapes-dalle")
    runtime = spec.build_runtime(spec.make_config({"d_model": 32, "n_heads": 2, "n_layers": 1}))
    model = runtime.build_model()
    groups = param_groups(model, weight_decay=0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    everything = [id(p) for g in groups for p in g["params"]]
    assert sorted(everything) == sorted(id(p) for p in model.parameters()), "each parameter exactly once"
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in decayed} == {
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
        "blocks.0.fc.weight",
        "blocks.0.out.weight",
        "feature_head.weight",  # the heads of the tokens' shared features, like the tokens' own head
        "head.weight",
    }
    # with zero gradients, AdamW only decays: the exempt parameters must not move
    optimizer = adamw(groups, lr=0.1, weight_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(before[name], p.detach())
        assert moved == (id(p) in decayed), name


def test_outer_nesterov_is_plain_averaging_at_lr_one_and_extrapolates_with_momentum() -> None:
    start = [torch.zeros(3)]
    plain = OuterNesterov(start, lr=1.0, momentum=0.0)
    assert torch.allclose(plain.step([torch.tensor([1.0, 2.0, 3.0])])[0], torch.tensor([1.0, 2.0, 3.0]))
    summed = OuterNesterov(start, lr=2.0, momentum=0.0)  # two peers' deltas added instead of averaged
    assert torch.allclose(summed.step([torch.ones(3)])[0], torch.full((3,), 2.0))
    nesterov = OuterNesterov(start, lr=0.7, momentum=0.9)
    first = nesterov.step([torch.ones(3)])[0].clone()
    assert torch.allclose(first, torch.full((3,), 0.7 * 1.9))  # g + momentum * (momentum * 0 + g)
    second = nesterov.step([first + 1.0])[0]  # the same consensus direction again: a longer step
    assert float(second[0] - first[0]) > 0.7 * 1.9
    nesterov.reset([torch.full((3,), 5.0)])
    assert torch.equal(nesterov.anchor[0], torch.full((3,), 5.0))


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"lr_schedule": "linear"}, "lr_schedule"),
        ({"warmup_samples": -1}, "warmup_samples"),
        ({"decay_samples": 0}, "decay_samples"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"local_batch_size": 0}, "local_batch_size"),
    ],
)
@pytest.mark.parametrize("task", ["shapes-dalle", "tiny-lm"])
def test_schedule_fields_are_validated(task: str, values: dict[str, object], field: str) -> None:
    with pytest.raises(TaskConfigError) as caught:
        load_task(task).make_config(values)
    assert field in caught.value.problems


def test_every_task_default_schedule_is_valid_and_positive() -> None:
    for task in ("shapes-dalle", "tiny-lm"):
        config = load_task(task).make_config({})
        settings = ScheduleSettings.from_config(config)
        for samples in (0, 1000, 10**5, 10**7):
            lr = settings.lr_at(samples)
            assert 0 < lr <= settings.peak_lr and math.isfinite(lr)


def test_a_runs_early_epochs_are_shorter_and_the_schedule_follows_their_samples() -> None:
    from volunteer_app.protocol import OptimizerSettings

    settings = OptimizerSettings(early_epochs=4, early_target_batch_size=512, target_batch_size=2048)
    assert [settings.epoch_target_batch_size(e) for e in (0, 3, 4, 9)] == [512, 512, 2048, 2048]
    assert [settings.epoch_matchmaking_time(e) for e in (3, 4)] == [0.5, 3.0]
    assert settings.samples_at_epoch(2.5) == 1280 and settings.samples_at_epoch(6) == 4 * 512 + 2 * 2048
    schedule = ScheduleSettings(
        peak_lr=1e-3, schedule="cosine", warmup_samples=0, decay_samples=20_000, min_lr_ratio=0.1
    )
    model = torch.nn.Linear(4, 4)
    optimizer = adamw(model.parameters(), lr=schedule.peak_lr)
    scheduler = make_scheduler_factory(schedule, samples_per_epoch=settings.samples_at_epoch)(optimizer)
    for epoch in (1, 4, 7):
        while scheduler._step_count <= epoch:
            scheduler.step()
        expected = schedule.lr_at(settings.samples_at_epoch(epoch + 0.5))
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
