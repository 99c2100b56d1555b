"""What a task's optimizer is made of: parameter groups, the learning-rate schedule, the outer optimizer.

Three pieces that every task shares, each usable alone (the benchmarks drive them without hivemind):

* :func:`param_groups` splits a model's parameters the way nanoGPT's ``configure_optimizers`` does:
  the weight matrices of linear layers take weight decay; biases, normalisation weights and embeddings
  take none (decaying an embedding pulls rare tokens toward zero, and decaying a LayerNorm gain fights
  the normalisation). hivemind's ``TrainingStateAverager`` accepts param-group dicts and hands them to
  the optimizer factory unchanged, so the groups survive the collaborative wrapper.
* :func:`lr_multiplier` is the schedule as a pure function of *samples the swarm has trained*: a linear
  warmup, then ``constant``, ``cosine`` decay to ``min_lr_ratio``, or ``inverse_sqrt`` decay (for
  open-ended volunteer runs whose length nobody knows). :func:`make_scheduler_factory` turns it into
  the ``scheduler=`` hook of ``hivemind.Optimizer``, which steps it on the swarm's *global epoch*: every
  peer computes the same learning rate from the same epoch, however fast or late it is.
* :class:`OuterNesterov` is DiLoCo's outer optimizer (Douillard et al. 2023; INTELLECT-1 ran it): after
  each averaging round, the averaged parameters' distance from the last synchronised parameters is a
  pseudo-gradient, and SGD with Nesterov momentum applies it to the synchronised copy.

Only this module's builders import torch, and only when called.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Schedule = Literal["constant", "cosine", "inverse_sqrt"]
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "inverse_sqrt")


@dataclass(frozen=True)
class ScheduleSettings:
    """A learning-rate schedule in samples (what a task config's schedule fields describe).

    :param peak_lr: the learning rate after warmup.
    :param schedule: ``constant``, ``cosine`` or ``inverse_sqrt`` after the warmup.
    :param warmup_samples: samples over which the rate rises linearly from ~0 to ``peak_lr``.
    :param decay_samples: ``cosine``: samples (after warmup) over which the rate falls to its floor;
      ``inverse_sqrt``: the time scale, the rate is ``peak / sqrt(1 + t / decay_samples)``.
    :param min_lr_ratio: the floor, as a fraction of ``peak_lr``.
    """

    peak_lr: float
    schedule: str = "constant"
    warmup_samples: int = 0
    decay_samples: int = 1
    min_lr_ratio: float = 0.0

    @classmethod
    def from_config(cls, config: Any) -> ScheduleSettings:
        """The schedule of a task config that has ``lr`` and, optionally, the schedule fields."""
        return cls(
            peak_lr=float(getattr(config, "lr", 1e-3)),
            schedule=str(getattr(config, "lr_schedule", "constant")),
            warmup_samples=int(getattr(config, "warmup_samples", 0)),
            decay_samples=max(1, int(getattr(config, "decay_samples", 1))),
            min_lr_ratio=float(getattr(config, "min_lr_ratio", 0.0)),
        )

    def multiplier(self, samples: float) -> float:
        return lr_multiplier(
            samples,
            schedule=self.schedule,
            warmup_samples=self.warmup_samples,
            decay_samples=self.decay_samples,
            min_lr_ratio=self.min_lr_ratio,
        )

    def lr_at(self, samples: float) -> float:
        return self.peak_lr * self.multiplier(samples)


def lr_multiplier(
    samples: float,
    *,
    schedule: str,
    warmup_samples: int,
    decay_samples: int,
    min_lr_ratio: float,
) -> float:
    """The learning rate after ``samples`` trained samples, as a fraction of the peak.

    The warmup never gives 0 (its first value is ``1 / warmup_samples``-ish, as the rate at the middle of
    the first epoch), so a swarm's first epoch is never wasted.

    :raises ValueError: for an unknown schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
    samples = max(0.0, float(samples))
    floor = min(1.0, max(0.0, min_lr_ratio))
    if warmup_samples > 0 and samples < warmup_samples:
        return max(samples, 1.0) / warmup_samples
    after = samples - warmup_samples
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, after / max(1, decay_samples))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(floor, 1.0 / math.sqrt(1.0 + after / max(1, decay_samples)))


SamplesPerEpoch = int | Callable[[float], float]
"""A run's epoch sizes: samples per global epoch, or (``OptimizerSettings.samples_at_epoch``) the samples the
swarm has trained, as planned, when it reaches a (possibly fractional) epoch."""


def samples_at_epoch(samples_per_epoch: SamplesPerEpoch) -> Callable[[float], float]:
    """``samples_per_epoch`` as a function of the epoch."""
    if callable(samples_per_epoch):
        return samples_per_epoch
    per_epoch = max(1, int(samples_per_epoch))
    return lambda epoch: epoch * per_epoch


def make_scheduler_factory(
    settings: ScheduleSettings, *, samples_per_epoch: SamplesPerEpoch
) -> Callable[[Any], Any]:
    """``scheduler=`` for ``hivemind.Optimizer``: a ``LambdaLR`` over the swarm's global epoch.

    hivemind steps the scheduler until its step count passes the local epoch (after every epoch and after
    loading state from peers), so during epoch ``e`` the rate is that of the middle of the epoch, the
    samples at epoch ``e + 0.5``. The optimizer's ``lr`` must be the peak.

    :param settings: the schedule.
    :param samples_per_epoch: the run's target batch size (samples the swarm trains per global epoch), or
        its epochs' sizes as a function (runs whose early epochs are shorter).
    """
    samples_at = samples_at_epoch(samples_per_epoch)

    def factory(optimizer: Any) -> Any:
        import torch

        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda epoch: settings.multiplier(samples_at(epoch + 0.5))
        )

    return factory


NO_DECAY_MODULES = ("Embedding", "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d")


def param_groups(model: Any, *, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups of ``model``: weight matrices of linear (and convolution) layers with
    ``weight_decay``; biases, normalisation parameters and embeddings with none.

    Every parameter lands in exactly one group, in ``model.parameters()`` order within a group, so two
    processes that build the same model get the same groups (hivemind matches tensors by position).
    """
    decay_ids: set[int] = set()
    for module in model.modules():
        kind = type(module).__name__
        weight = getattr(module, "weight", None)
        if weight is None or kind in NO_DECAY_MODULES:
            continue
        if getattr(weight, "ndim", 0) >= 2 and kind in ("Linear", "Conv1d", "Conv2d"):
            decay_ids.add(id(weight))
    decay: list[Any] = []
    no_decay: list[Any] = []
    for parameter in model.parameters():
        (decay if id(parameter) in decay_ids else no_decay).append(parameter)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def adamw(params: Iterable[Any], *, lr: float, weight_decay: float = 0.0) -> Any:
    """AdamW with ``betas=(0.9, 0.95)``, which keeps small transformers stable at high learning rates.

    ``params`` may be tensors or param-group dicts (a group's own ``weight_decay`` wins over the
    argument); hivemind calls optimizer factories with its own copies of the groups and requires the
    optimizer to keep exactly those groups.
    """
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


class OuterNesterov:
    """DiLoCo's outer step on the synchronised parameters, from the swarm's averaged parameters.

    Each peer keeps ``anchor`` (the parameters every peer agreed on after the previous round) and a
    momentum buffer. After a round that averaged the peers' parameters to ``averaged``, the outer
    gradient is ``anchor - averaged`` and ``anchor`` moves by SGD with Nesterov momentum; the peer then
    continues from the new ``anchor``. With ``lr=1, momentum=0`` this is plain parameter averaging.

    :param parameters: the model's parameters (their current values become the first anchor).
    :param lr: the outer learning rate (DiLoCo: 0.7).
    :param momentum: Nesterov momentum (DiLoCo: 0.9).
    """

    def __init__(self, parameters: Sequence[Any], *, lr: float = 0.7, momentum: float = 0.9):
        import torch

        self.lr = lr
        self.momentum = momentum
        with torch.no_grad():
            self.anchor = [p.detach().to("cpu", torch.float32, copy=True) for p in parameters]
            self.buffers = [torch.zeros_like(a) for a in self.anchor]

    def reset(self, parameters: Sequence[Any]) -> None:
        """Take ``parameters`` as the synchronised state (after loading the swarm's state); momentum is kept."""
        import torch

        with torch.no_grad():
            for anchor, parameter in zip(self.anchor, parameters, strict=True):
                anchor.copy_(parameter.detach().to("cpu", torch.float32))

    def step(self, averaged: Sequence[Any]) -> list[Any]:
        """Apply one outer step from the averaged parameters; returns the new anchor (a list of tensors)."""
        import torch

        with torch.no_grad():
            for anchor, buffer, average in zip(self.anchor, self.buffers, averaged, strict=True):
                gradient = anchor - average.detach().to("cpu", torch.float32)
                buffer.mul_(self.momentum).add_(gradient)
                anchor.sub_(gradient.add(buffer, alpha=self.momentum), alpha=self.lr)
        return self.anchor


def optimizer_parts(
    runtime: Any, model: Any, config: Any, *, samples_per_epoch: SamplesPerEpoch
) -> tuple[list[dict[str, Any]], Callable[[Any], Any], Callable[[Any], Any]]:
    """``(param_groups, optimizer_factory, scheduler_factory)`` of a task, for ``hivemind.Optimizer`` or a
    ``TrainingStateAverager``.

    Every process that shares a run's state (each worker, the coordinator's checkpointer) must build these
    the same way: hivemind matches parameters by position and sends the optimizer's state as a flat list
    packed into the receiver's structure (the scheduler adds ``initial_lr`` to every group, for one).
    The runtime's own ``param_groups`` and ``make_optimizer`` win over the defaults here.
    """
    weight_decay = float(getattr(config, "weight_decay", 0.0))
    groups_of = getattr(runtime, "param_groups", None)
    groups = groups_of(model) if groups_of is not None else param_groups(model, weight_decay=weight_decay)
    make = getattr(runtime, "make_optimizer", None)
    schedule = ScheduleSettings.from_config(config)

    def optimizer_factory(params: Any) -> Any:
        if make is not None:
            return make(params)
        return adamw(params, lr=schedule.peak_lr, weight_decay=weight_decay)

    return groups, optimizer_factory, make_scheduler_factory(schedule, samples_per_epoch=samples_per_epoch)
