"""A hostile volunteer's modified copy of the software, for the poisoning tests and benchmark.

Put this folder first on ``PYTHONPATH`` and set ``VOLUNTEER_POISON``: every Python process of that
volunteer (its agent and its training worker) loads it at start-up and patches the worker the way an
attacker who edited the source would:

* ``gradients``: every gradient the peer contributes is reversed and amplified (x -1000: gradient ascent
  that a plain average would follow);
* ``parameters``: every parameter set the peer contributes to an averaging round is reversed and amplified
  (x -10: a model-replacement attack on ``local``/``diloco`` runs);

and in both modes the parts of the average that this peer reduces come back as garbage (-1000 x the mean).
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
