"""Robust averaging: what keeps one hostile peer in an averaging group from wrecking the shared model.

hivemind's all-reduce splits the averaged tensors into parts; every peer *reduces* some parts (it receives
every group member's copy of them and sends back the average) and *receives* the averages of the other
parts from their reducers. A hostile peer can attack both ways: as a sender it contributes NaN, infinite or
huge values to the parts honest peers reduce; as a reducer it sends back whatever it likes for its own
parts. Both sides are defended here (hivemind's classes are patched in :mod:`workers.compat`):

* **Reducing** (:func:`robust_mean`): contributions holding NaN or infinity are dropped. With three or
  more, a contribution farther from the coordinate-wise median than :data:`OUTLIER_FACTOR` times the
  median distance is dropped too, a sender's weight is capped at twice the median weight (nobody speaks for
  the whole group), and the rest is averaged by **CenteredClip** (Karimireddy et al. 2021, the aggregator
  of "Secure Distributed Training at Scale", Gorbunov et al. 2022): start at the coordinate-wise median and
  move toward each contribution by at most ``tau``, four times the median distance, so that honest
  contributions are averaged as they are (exactly hivemind's weighted mean when none lies farther) and a
  subtle outlier moves the result by at most its share of ``tau``. With two contributions nothing tells the
  honest one from the hostile one; the weighted mean is all there is. Which honest groups these rules
  change, and what that costs in learning: docs/averaging.md#what-robust-averaging-changes.
* **Receiving** (:func:`screen_deltas`): an average holding NaN or infinity is not applied (the peer keeps
  its own values for that part). In a group of three or more, another reducer's answer that changes a part
  far more than it should is refused and the peer keeps its own values for that part: for gradients,
  over :data:`RECEIVER_FACTOR` times what that part changes when this peer reduces it itself (robustly;
  :class:`ChangeHistory`), relative to the part's size; for parameters, over
  :data:`PARAMETER_CHANGE_LIMIT` times the part's size, in any group (a fixed bound that only absurd
  answers cross: a hostile reducer can still move its parts within it).

* **Downloading state** (joining, catching up, the coordinator's checkpoints; :func:`state_loss_problem`):
  hivemind takes the state of whichever peer claims the newest epoch, and a hostile peer can serve any
  finite numbers. The downloaded parameters' loss on a fixed batch of the task (:func:`loss_probe`) is
  compared with this peer's own: a state far worse than the one it would replace is refused, and the
  state is taken from another peer (:class:`workers.compat.GuardedStateAverager`).

What it does not catch: a hostile peer in a group of two (half the group), a hostile majority, biases
within the radii (bounded: at most a share of the honest spread per round), and a served state that is
wrong but within the loss bound (averaging with honest peers then pulls it back). The coordinator's spot
checks and flags are the other half of the defence; see docs/reliability.md#poisoned-averaging.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

CENTERED_CLIP_ITERATIONS = 3
"""Iterations of CenteredClip (the paper converges in a few from a robust start)."""
CENTERED_CLIP_TAU_FACTOR = 4.0
"""``tau`` is this times the median distance of the contributions from their coordinate-wise median. At 2 (until
2026-12) the clip moved 4.5 % of the honest parts' averages of 4 replicas with the same data and 8 % with
different data, and they ended 0.03 and 0.07 nats worse than plain averaging; at 4, 0.3 % (docs/averaging.md)."""
OUTLIER_FACTOR = 10.0
"""With three or more contributions, one farther than this times the median distance from the coordinate-wise
median is left out (honest contributions of one part lie at similar distances)."""
WEIGHT_CAP_FACTOR = 2.0
"""A contribution's weight is capped at this times the median weight of the group (three or more)."""
RECEIVER_FACTOR = 4.0
"""Another reducer's change to a part may be this many times the part's reference relative change (the
decaying maximum of what it was when this peer reduced it itself)."""
RECEIVER_FALLBACK_FACTOR = 10.0
"""For a part this peer never reduced: this many times this round's relative change of its own parts."""
PARAMETER_CHANGE_LIMIT = 2.0
"""Parameter averaging: another reducer may change a part by at most this many times its size.

Two honest peers' copies of a part differ by at most the sum of their sizes, so an honest average moves a
part by about its size at most (two peers whose training took it in opposite directions); this bound is
twice that. It must not be tight: a refused part is not averaged, so the peers drift further apart on it
and the next round refuses it again, for good. Early in training honest peers do move a part farther than
half its size apart from the other's: small initial weights, and Adam steps of about the learning rate per
element whatever the gradient's size. At 0.5 (the bound until 2026-12) a real 2-peer demo at lr 3e-3
refused two attention ``qkv`` weights in its first round (changes of 1.07 and 0.89 times their size) and
in every round after (1.0-1.2 times): the two peers ended with different attention in two of four blocks,
while every other tensor agreed within 1-9 %."""
PARAMETER_FLOOR = 0.01
"""Parameter averaging: the size of a part is at least this per element (biases start at zero)."""
HARD_LIMIT = {"gradients": 20.0, "parameters": 2 * PARAMETER_CHANGE_LIMIT}
"""In any group, even of two: a contribution (reducing) or an answer (receiving) that differs from this
peer's own numbers by more than this times their size is refused. Honest gradients of one part differ by
a few times their size at most (noise); honest parameters by at most the sum of the two copies' sizes
(a contribution twice as far from this peer's as an answer may move it: in a group of two the answer is
half the distance; see :data:`PARAMETER_CHANGE_LIMIT`). A peer contributing its parameters x -10 is
11 times their size away."""
STATE_LOSS_FACTOR = 2.0
STATE_LOSS_SLACK = 2.0
"""A downloaded state is refused when its loss on the check batch exceeds ``STATE_LOSS_FACTOR`` times this
peer's own loss plus ``STATE_LOSS_SLACK`` (nats). Honest states are better than, or close to, the one a
peer replaces (it is behind, or untrained: ~6.9 for ``shapes-dalle``); a model more than twice as wrong
and 2 nats worse than an older copy of itself is not the swarm's. Loose on purpose: a refused honest state
leaves a peer on its own parameters, which averaging then merges anyway."""
STATE_CHECK_SAMPLES = 32
"""Samples in the fixed batch a downloaded state is checked on (one forward pass, no gradients)."""


def is_finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())


GRADIENT_FLOOR = 0.5
"""Receiving gradients: a part's size is at least this times the size of an average part of this peer's
gradient (its root mean square per element). A part this peer's batches left at zero (embedding rows of
tokens it never saw, common when volunteers' data differ) would otherwise refuse every other peer's average
for it, and the peer would never learn those rows from the swarm."""


def size_of(part: torch.Tensor, kind: str, rms: float = 0.0) -> float:
    """The size a change to ``part`` is measured against: its norm; for parameters at least
    :data:`PARAMETER_FLOOR` per element (a fresh bias is all zeros); for gradients at least
    :data:`GRADIENT_FLOOR` times ``rms`` (this peer's whole gradient's root mean square per element) per element."""
    size = float(part.float().norm())
    floor = PARAMETER_FLOOR if kind == "parameters" else GRADIENT_FLOOR * rms
    return max(size, floor * math.sqrt(part.numel()))


def root_mean_square(parts: Sequence[Sequence[torch.Tensor]]) -> float:
    """The root mean square per element of all of ``parts`` (lists of tensors) together."""
    total = sum(float(x.float().pow(2).sum()) for group in parts for x in group)
    count = sum(x.numel() for group in parts for x in group)
    return math.sqrt(total / count) if count else 0.0


def robust_mean(
    parts: Sequence[tuple[torch.Tensor, float]],
    shape: torch.Size | Sequence[int],
    dropped: list[int] | None = None,
    *,
    own: int | None = None,
    kind: str = "gradients",
    rms: float = 0.0,
) -> torch.Tensor:
    """The robust average of one part's contributions ``[(tensor, weight)]`` (see the module's docstring).

    ``dropped`` (when given) receives the indices of contributions left out: non-finite ones; when this
    peer's own contribution is ``parts[own]``, those farther from it than :data:`HARD_LIMIT` of its size
    (any group size: a peer trusts its own numbers; its size is at least :data:`GRADIENT_FLOOR` times ``rms``,
    its whole gradient's root mean square, per element, and at least the group's lower median size); and,
    with three or more left, outliers farther from
    the coordinate-wise median than :data:`OUTLIER_FACTOR` times the median distance. Returns a NaN tensor
    when nothing usable was contributed (every contribution non-finite, or every weight zero): receivers
    then keep their own values for the part.
    """
    usable: list[tuple[int, torch.Tensor, float]] = []
    for index, (tensor, weight) in enumerate(parts):
        if not math.isfinite(float(weight)) or weight < 0 or not is_finite(tensor):
            if dropped is not None:
                dropped.append(index)
        elif weight > 0 or index == own:
            usable.append((index, tensor.float().reshape(-1), float(weight)))
    if own is not None and any(index == own for index, _, _ in usable):
        mine = next(t for index, t, _ in usable if index == own)
        # measured against this peer's numbers (floored by its whole gradient's size, ``rms``), or the group's
        # typical size (the lower median: no minority can raise it) where that is larger: an all-zero gradient
        # part (embedding rows this peer's batches never used) must not refuse everyone else's
        typical = sorted(size_of(t, kind) for _, t, _ in usable)[(len(usable) - 1) // 2]
        limit = HARD_LIMIT[kind] * max(size_of(mine, kind, rms), typical)
        far = {index for index, t, _ in usable if index != own and float((t - mine).norm()) > limit}
        if dropped is not None:
            dropped.extend(sorted(far))
        usable = [u for u in usable if u[0] not in far]
    usable = [u for u in usable if u[2] > 0]
    if not usable:
        return torch.full(tuple(shape), float("nan"))
    if len(usable) >= 3:
        points = torch.stack([t for _, t, _ in usable])
        distances = (points - points.median(dim=0).values).norm(dim=1)
        limit = OUTLIER_FACTOR * float(distances.median())
        kept = [u for u, distance in zip(usable, distances.tolist(), strict=True) if distance <= limit]
        if dropped is not None:
            dropped.extend(index for index, _, _ in usable if all(index != k for k, _, _ in kept))
        usable = kept
    weights = torch.tensor([w for _, _, w in usable], dtype=torch.float64)
    if len(usable) >= 3:
        weights = weights.clamp(max=WEIGHT_CAP_FACTOR * float(weights.median()))
    weights = (weights / weights.sum()).to(torch.float32)
    points = torch.stack([t for _, t, _ in usable])
    if len(usable) < 3:
        return (weights[:, None] * points).sum(dim=0).reshape(tuple(shape))
    return centered_clip(points, weights).reshape(tuple(shape))


def centered_clip(
    points: torch.Tensor, weights: torch.Tensor, *, iterations: int = CENTERED_CLIP_ITERATIONS
) -> torch.Tensor:
    """CenteredClip of the rows of ``points`` (n x d) with ``weights`` summing to 1, from the coordinate-wise
    median, radius ``tau`` = :data:`CENTERED_CLIP_TAU_FACTOR` x the median distance to it."""
    center = points.median(dim=0).values
    distances = (points - center).norm(dim=1)
    tau = CENTERED_CLIP_TAU_FACTOR * float(distances.median())
    if tau <= 0:  # most contributions are identical: the median is their value
        return center
    clipped = False
    for _ in range(iterations):
        diff = points - center
        norms = diff.norm(dim=1, keepdim=True).clamp_min(1e-30)
        scale = (tau / norms).clamp(max=1.0)
        clipped = clipped or bool((scale < 1.0).any())
        center = center + (weights[:, None] * diff * scale).sum(dim=0)
    if not clipped:  # every contribution within tau: exactly the weighted mean, summed as hivemind sums it
        return (weights[:, None] * points).sum(dim=0)
    return center


class ScreenReport:
    """What receiving one round's averages refused (for the worker's log)."""

    def __init__(self) -> None:
        self.non_finite_parts = 0
        self.refused_parts: dict[int, int] = {}
        self.largest_refused = 0.0
        """The largest refused change, relative to its part's size (:func:`size_of`): how far over the bound
        the refused answers were (honest peers refused by a tight bound sit just over it)."""

    def refuse(self, peer: int, change: float, size: float) -> None:
        self.refused_parts[peer] = self.refused_parts.get(peer, 0) + 1
        if size > 0:
            self.largest_refused = max(self.largest_refused, change / size)

    def __bool__(self) -> bool:
        return bool(self.non_finite_parts or self.refused_parts)


class ChangeHistory:
    """How much each part of one averager's tensors changes in the rounds this peer reduces it itself
    (robustly): the reference against which other reducers' answers for that part are screened.

    Parts are identified by their position in hivemind's split (tensor by tensor, fixed part size), which
    does not depend on the group. The reference is a slowly decaying maximum of the relative change
    (``|average - input| / |input|``): it follows the high end of what honest rounds do.
    """

    DECAY = 0.9

    def __init__(self) -> None:
        self.reference: dict[int, float] = {}

    def learn(self, part: int, relative: float) -> None:
        if math.isfinite(relative):
            self.reference[part] = max(relative, self.DECAY * self.reference.get(part, 0.0))


def screen_deltas(
    deltas: Sequence[list[torch.Tensor]],
    inputs: Sequence[Sequence[torch.Tensor]],
    *,
    own_index: int | None,
    senders: int,
    history: ChangeHistory | None = None,
    kind: str = "gradients",
    factor: float = RECEIVER_FACTOR,
    fallback_factor: float = RECEIVER_FALLBACK_FACTOR,
) -> ScreenReport:
    """Screen, in place, the changes (``deltas[peer][part]``: average minus this peer's input) that each
    reducer sent back for its parts; a refused change becomes zero (the peer keeps its own values).

    Non-finite changes are always refused. With ``senders`` >= 3, a change to a part whose relative size
    (``|delta| / |input|``) exceeds ``factor`` times that part's reference in ``history`` is refused; a
    part without a reference yet is held to ``fallback_factor`` times this round's relative change of the
    parts this peer reduced itself. The parts this peer reduced (``own_index``) teach ``history``. Without
    any reference (a client-mode peer reduces nothing and has no history) only non-finite changes are
    refused. Parts are numbered in hivemind's order: peer by peer, as ``inputs`` lists them.

    ``kind="parameters"`` (state averaging) uses a fixed bound instead: a change larger than
    :data:`PARAMETER_CHANGE_LIMIT` times the part's size (with a floor of :data:`PARAMETER_FLOOR` per element,
    for parts near zero such as fresh biases) is refused. Parameter averaging's honest changes vary too
    much from round to round (a peer that fell behind, a peer that just joined) for a learnt reference."""
    report = ScreenReport()
    for peer_deltas in deltas:
        for delta in peer_deltas:
            if not is_finite(delta):
                delta.zero_()
                report.non_finite_parts += 1
    rms = root_mean_square(inputs) if kind == "gradients" else 0.0
    offsets = [0]
    for peer_inputs in inputs:
        offsets.append(offsets[-1] + len(peer_inputs))
    own_relative: float | None = None
    if own_index is not None and deltas[own_index]:
        own_change = math.sqrt(sum(float(d.float().pow(2).sum()) for d in deltas[own_index]))
        own_size = math.sqrt(sum(float(x.float().pow(2).sum()) for x in inputs[own_index]))
        if own_size > 0 and own_change > 0:
            own_relative = own_change / own_size
        if history is not None and senders >= 3:
            for index, delta in enumerate(deltas[own_index]):
                size = size_of(inputs[own_index][index], kind, rms)
                if size > 0:
                    history.learn(offsets[own_index] + index, float(delta.float().norm()) / size)
    hard = PARAMETER_CHANGE_LIMIT if kind == "parameters" else HARD_LIMIT[kind]
    for peer, peer_deltas in enumerate(deltas):  # any group size: absurd answers
        if peer == own_index:
            continue
        for index, delta in enumerate(peer_deltas):
            change, size = float(delta.float().norm()), size_of(inputs[peer][index], kind, rms)
            if change > hard * size:
                delta.zero_()
                report.refuse(peer, change, size)
    if senders < 3 or kind == "parameters":
        return report
    for peer, peer_deltas in enumerate(deltas):
        if peer == own_index:
            continue
        for index, delta in enumerate(peer_deltas):
            reference = history.reference.get(offsets[peer] + index) if history is not None else None
            if reference is not None and reference > 0:
                allowed = factor * reference
            elif own_relative is not None:
                allowed = fallback_factor * own_relative
            else:
                continue
            size = size_of(inputs[peer][index], kind, rms)
            change = float(delta.float().norm())
            if change > allowed * size * (1 + 1e-6) + 1e-30:
                delta.zero_()
                report.refuse(peer, change, size)
    return report


def state_loss_problem(own: float, served: float) -> str | None:
    """Why a downloaded state whose parameters lose ``served`` on the check batch must not replace this peer's,
    which lose ``own`` there (None when it may). A peer whose own model is broken (non-finite loss) takes
    any finite state."""
    if not math.isfinite(served):
        return "its loss on the check batch is not finite"
    if not math.isfinite(own):
        return None
    limit = STATE_LOSS_FACTOR * own + STATE_LOSS_SLACK
    if served > limit:
        return f"its loss on the check batch is {served:.4g}, this peer's own model's {own:.4g} (limit {limit:.4g})"
    return None


def loss_probe(
    runtime: Any, model: torch.nn.Module, *, samples: int = STATE_CHECK_SAMPLES
) -> Callable[[], float]:
    """A function that returns ``model``'s current loss (evaluation mode, no gradients) on a fixed batch of
    ``samples`` real training samples of ``runtime``'s task: the yardstick for downloaded states."""
    device = next(model.parameters()).device
    batch = runtime.example_batch(max(1, samples), device)

    def probe() -> float:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return float(runtime.loss(model, batch))
        finally:
            model.train(was_training)

    return probe
