"""A hostile volunteer's modified copy of the software, for the poisoning tests and benchmark.

Put this folder first on ``PYTHONPATH`` and set ``VOLUNTEER_POISON``: every Python process of that
volunteer (its agent and its training worker) loads it at start-up and patches the worker the way an
attacker who edited the source would:

* ``gradients``: every gradient the peer contributes is reversed and amplified (x -1000: gradient ascent
  that a plain average would follow);
* ``parameters``: every parameter set the peer contributes to an averaging round is reversed and amplified
  (x -10: a model-replacement attack on ``local``/``diloco`` runs);

and in both modes the parts of the average that this peer reduces come back as garbage (-1000 x the mean),
and the state it serves to peers that download it (joining, catching up) is its parameters x -10 (finite
whatever its own model holds), under a claim of the newest epoch so that downloaders ask it first.
"""

from __future__ import annotations

import os

MODE = os.environ.get("VOLUNTEER_POISON", "")
SCALE = 1000.0

if MODE in ("gradients", "parameters"):
    import torch
    from hivemind.optim.state_averager import TrainingStateAverager

    from workers import compat, trainer

    def _garbage_mean(parts, shape, *args, **kwargs):  # type: ignore[no-untyped-def]
        tensors = [t.float() for t, _ in parts]
        return (-SCALE * sum(tensors) / max(1, len(tensors))).reshape(tuple(shape))

    compat.robust_mean = _garbage_mean  # what this peer sends back for the parts it reduces

    from hivemind.averaging.averager import DecentralizedAverager

    _priority = DecentralizedAverager.state_sharing_priority
    # hivemind downloads from the peer that declares the highest priority (the newest epoch, by its own word)
    DecentralizedAverager.state_sharing_priority = property(lambda self: 1e9, _priority.fset)
    original_state = TrainingStateAverager.get_current_state

    def _poisoned_state(self):  # type: ignore[no-untyped-def]
        metadata, tensors, *rest = original_state(self)
        count = len(self.main_parameters)
        served = [torch.nan_to_num(t.float(), nan=0.0, posinf=0.0, neginf=0.0).to(t.dtype) for t in tensors]
        served[:count] = [(-10.0 * t.clamp(-1.0, 1.0) - 1.0).to(t.dtype) for t in served[:count]]
        return (metadata, served, *rest)

    TrainingStateAverager.get_current_state = _poisoned_state

    if MODE == "gradients":
        original_step = trainer.Trainer._optimizer_step

        def _poisoned_step(self, samples, scaler):  # type: ignore[no-untyped-def]
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(-SCALE)
            original_step(self, samples, scaler)

        trainer.Trainer._optimizer_step = _poisoned_step
    else:
        original_load = TrainingStateAverager._load_local_tensors_into_averager_

        @torch.no_grad()
        def _poisoned_load(self):  # type: ignore[no-untyped-def]
            original_load(self)
            with self.get_tensors() as tensors:
                for tensor in tensors:
                    tensor.mul_(-10.0)

        TrainingStateAverager._load_local_tensors_into_averager_ = _poisoned_load
