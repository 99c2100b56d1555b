"""Robust averaging: a peer that sends NaN, infinite or huge values into an all-reduce cannot wreck the
shared model.

hivemind 1.1.12's butterfly all-reduce cuts every averaged tensor into parts; each peer of a group
*reduces* a share of the parts: it receives that part from every sender, averages it
(``TensorPartReducer.accumulate_part``: a running weighted sum) and sends the average back, and every
sender adds ``average - own part`` to its tensors. A plain weighted mean lets one sender decide the
result: one NaN makes the average NaN (and ``0 * NaN`` is NaN, so a zero weight does not help), one
value of 1e30 drags it anywhere. :class:`RobustTensorPartReducer` instead collects a part from every
sender and aggregates it with :func:`robust_average`:

1. **Non-finite contributions are rejected**: a part with any NaN or infinite value, or a non-finite or
   non-positive weight, is left out of the average (not weighted by zero).
2. **Weights are capped** at :data:`WEIGHT_CAP` times the median weight (in a group of two: the
   reducer's own weight), so a peer cannot claim to have accumulated a million samples.
3. **CenteredClip** (Karimireddy et al. 2021, used by Gorbunov et al., "Secure Distributed Training at
   Scale", 2022): starting from a robust centre ``v`` (the coordinate-wise median of three or more
   contributions; in a group of two, the reducer's own part: with two peers there is no majority, so a
   peer trusts itself), :data:`ITERATIONS` times ``v += sum_i w_i * (x_i - v) * min(1, tau / |x_i - v|)
   / sum_i w_i``. The radius ``tau`` is the median distance of the contributions from the centre (times
   :data:`CLIP_RATIO`): in an honest majority, the spread of the honest peers. In a group of two it is the
   radius this peer saw for the same part in its last group of three or more, or, before it saw one,
   :data:`PAIR_RATIO` times the norm of its own part.

**The bound.** Each contribution pulls ``v`` by at most ``tau`` per iteration, so a sender with weight
share ``s = w_a / sum w`` moves the result by at most ``ITERATIONS * s * tau`` from where the others put
it, whatever it sends: in a group of three with equal weights, one poisoner moves each part by at most
``3 * tau / 3 = tau``, i.e. the honest peers' own spread. Honest contributions inside the radius pass
unclipped (the centred clip of points within ``tau`` of the centre is their weighted mean), so an honest
group averages exactly as before up to the clipping of outliers.

What this fits, per update mode (``workers/collab.py``): ``gradients`` averages gradients (weight =
samples accumulated; honest gradients differ by their noise, which sets ``tau``), ``local`` and ``diloco``
average parameters (honest peers differ by a round of local steps, a small ``tau``; DiLoCo's outer step
then treats the clipped average as usual). The state averager of ``gradients`` mode averages parameters
too.

**Receiving results.** A sender also checks what reducers send back: a non-finite averaged part is
dropped and the peer keeps its own values for it (:class:`RobustAllReduceRunner`). A *reducer* that
returns finite but wrong averages for its own share of the parts is not caught here (BTARD verifies
reducers by redundant recomputation; this project does not yet): such a peer moves the parts it reduces.

Installed by :func:`workers.compat.install_robust_averaging` (it replaces hivemind's ``AllReduceRunner``
in ``hivemind.averaging.averager``, which every averager uses), before the worker's averagers start.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer

logger = logging.getLogger(__name__)

ITERATIONS = 3
"""CenteredClip iterations per part."""
CLIP_RATIO = 1.0
"""The clipping radius as a multiple of the median distance of the contributions from the centre."""
PAIR_RATIO = 1.0
"""In a group of two with no earlier radius: the radius as a multiple of the reducer's own part's norm."""
WEIGHT_CAP = 8.0
"""No contribution weighs more than this many times the median weight (the reducer's own, in a pair)."""

# The radius seen for each part (by averager class, part index and size) in this process's last group of
# three or more: what a group of two clips with. Each hivemind averager runs in its own process.
_RADII: dict[tuple[str, int, int], float] = {}
rejected_contributions = 0
"""Contributions this process left out of an average (non-finite values or weights)."""
rejected_results = 0
"""Averaged parts from reducers this process refused (non-finite values)."""


def is_finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())


def robust_average(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    own_index: int | None = None,
    pair_radius: float | None = None,
    iterations: int = ITERATIONS,
    clip_ratio: float = CLIP_RATIO,
    pair_ratio: float = PAIR_RATIO,
    weight_cap: float = WEIGHT_CAP,
) -> tuple[torch.Tensor, float | None, list[int]]:
    """The robust weighted average of one tensor part received from a group's senders.

    :param parts: each sender's part (same shape).
    :param weights: each sender's weight.
    :param own_index: which of ``parts`` is the reducer's own (None: it sends none).
    :param pair_radius: the clipping radius to use in a group of two (from an earlier, larger group).
    :returns: ``(average, radius, rejected)``: the average (all NaN when no contribution was finite, so
      that every sender keeps its own values), the clipping radius used (None when nothing was clipped
      against), and the indices of the contributions left out.
    """
    if not parts:
        raise ValueError("nothing to average")
    shape, dtype = parts[0].shape, parts[0].dtype
    kept: list[int] = []
    rejected: list[int] = []
    for index, (part, weight) in enumerate(zip(parts, weights, strict=True)):
        ok = isinstance(weight, int | float) and math.isfinite(weight) and weight > 0 and is_finite(part)
        (kept if ok else rejected).append(index)
    if not kept:
        return torch.full(shape, float("nan"), dtype=dtype), None, rejected
    x = torch.stack([parts[i].detach().to(torch.float32).reshape(-1) for i in kept])  # (n, numel)
    w = torch.tensor([float(weights[i]) for i in kept], dtype=torch.float64)
    n = len(kept)
    own = kept.index(own_index) if own_index in kept else None
    if n == 1:
        return x[0].reshape(shape).to(dtype), None, rejected
    reference = float(w[own]) if n == 2 and own is not None else float(w.median())
    w = torch.clamp(w, max=weight_cap * reference)
    if n >= 3:
        centre = x.median(dim=0).values  # (numel,)
        radius = clip_ratio * float((x - centre).norm(dim=1).median())
    elif own is not None:
        centre = x[own].clone()
        radius = pair_radius if pair_radius is not None else pair_ratio * float(centre.norm())
    else:  # a reducer that sends nothing, with two senders: nobody to trust more than the other
        centre = (x * (w / w.sum()).to(torch.float32)[:, None]).sum(dim=0)
        radius = float((x - centre).norm(dim=1).min())
    if not math.isfinite(radius) or radius <= 0.0:
        return centre.reshape(shape).to(dtype), radius, rejected
    share = (w / w.sum()).to(torch.float32)  # (n,)
    v = centre
    for _ in range(max(1, iterations)):
        diff = x - v  # (n, numel)
        distance = diff.norm(dim=1)  # (n,)
        scale = torch.clamp(radius / distance.clamp_min(1e-30), max=1.0)  # (n,)
        v = v + (diff * (share * scale)[:, None]).sum(dim=0)
    return v.reshape(shape).to(dtype), radius, rejected


class RobustTensorPartReducer(TensorPartReducer):
    """A ``TensorPartReducer`` that aggregates each part with :func:`robust_average` instead of a running
    weighted sum: it keeps every sender's part until all have arrived (one part at a time, as hivemind
    reduces them, so the extra memory is one part per sender).

    :param own_sender_index: the reducer's own index among the senders (None if it sends nothing).
    :param kind: names the averager (its class) for the per-part radius memory and the logs.
    :param sender_names: the senders' peer ids, for the logs.
    """

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        *,
        own_sender_index: int | None = None,
        kind: str = "tensors",
        sender_names: Sequence[str] = (),
    ):
        self.own_sender_index = own_sender_index
        self.kind = kind
        self.sender_names = list(sender_names)
        self._received: list[tuple[int, torch.Tensor, float]] = []
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        self._received = []
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """hivemind's ``accumulate_part``, keeping the part instead of adding it to a running sum."""
        import asyncio

        from hivemind.averaging.partition import AllreduceException

        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(
                    f"attempted to aggregate part in a finalized {self.__class__.__name__}"
                )
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._received.append((sender_index, tensor_part, float(weight)))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        global rejected_contributions
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from != self.num_current_senders:
            return
        shape = self.part_shapes[self.current_part_index]
        if not self._received:
            result = torch.full(shape, float("nan"))
        else:
            senders = [sender for sender, _, _ in self._received]
            own = senders.index(self.own_sender_index) if self.own_sender_index in senders else None
            key = (self.kind, self.current_part_index, int(math.prod(shape)))
            result, radius, rejected = robust_average(
                [part for _, part, _ in self._received],
                [weight for _, _, weight in self._received],
                own_index=own,
                pair_radius=_RADII.get(key),
            )
            if len(self._received) - len(rejected) >= 3 and radius is not None and radius > 0:
                _RADII[key] = radius
            for index in rejected:
                rejected_contributions += 1
                sender = senders[index]
                name = self.sender_names[sender] if sender < len(self.sender_names) else str(sender)
                logger.warning(
                    "left a non-finite contribution out of the average (%s part %d, from %s)",
                    self.kind, self.current_part_index, name,
                )  # fmt: skip
        self._received = []
        self.current_part_future.set_result(result.to(torch.float32))
        self.reset_accumulators()


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's ``AllReduceRunner`` with a :class:`RobustTensorPartReducer`, and a sender that refuses
    non-finite averaged parts from reducers (it keeps its own values for those parts)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        own = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        plain: TensorPartReducer = self.tensor_part_reducer  # type: ignore[has-type]
        self.tensor_part_reducer = RobustTensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            own_sender_index=own,
            kind=self._servicer_type.__name__,
            sender_names=[str(peer)[-8:] for peer in self.sender_peer_ids],
        )
        plain.finalize()
        container = self.tensor_part_container
        register = container.register_processed_part
        names = [str(peer)[-8:] for peer in self.ordered_peer_ids]

        def register_finite(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            global rejected_results
            if not is_finite(part):
                rejected_results += 1
                logger.warning(
                    "refused a non-finite average from %s (part %d); keeping this peer's own values",
                    names[peer_index], part_index,
                )  # fmt: skip
                part = torch.zeros_like(part)  # results are deltas: zero keeps the local values
            register(peer_index, part_index, part)

        container.register_processed_part = register_finite
