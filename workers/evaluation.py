"""Evaluation and drawing: the task's held-out metrics and its answers to prompts, as one ``EvalEvent``.

The worker runs it between micro-batches when the supervisor asks (an ``EvaluateCommand``) and before it
stops when told to; the coordinator's swarm peer uses the same conversion for checkpoint grids and
``generate``. Drawing a handful of prompts takes well under a second for the built-in tasks' small
presets, and the metrics are capped by ``max_samples``, so training pauses only briefly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from volunteer_app.worker_protocol import MAX_EVAL_PROMPTS, EvalEvent, EvalImage, EvalSample
from workers.tasks.base import PromptResult

logger = logging.getLogger(__name__)


def eval_sample(result: PromptResult) -> EvalSample:
    """The wire form of one prompt's answer (an image becomes raw RGB bytes in base64)."""
    image = None
    if result.image is not None:
        import numpy as np

        pixels = np.ascontiguousarray(result.image, dtype=np.uint8)
        if pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"a task drew an image of shape {pixels.shape}; expected (H, W, 3)")
        image = EvalImage.from_rgb(int(pixels.shape[1]), int(pixels.shape[0]), pixels.tobytes())
    return EvalSample(
        prompt=result.prompt,
        kind="text" if result.kind == "text" else "image",
        text=result.text,
        image=image,
        correct=result.correct,
        error=result.error,
    )


def showcase_prompts(runtime: Any) -> list[str]:
    """The task's fixed prompts, or none when the task cannot show its work."""
    showcase = getattr(runtime, "showcase_prompts", None)
    return list(showcase())[:MAX_EVAL_PROMPTS] if showcase is not None else []


def answer(runtime: Any, model: Any, prompts: Sequence[str]) -> list[EvalSample]:
    """The model's answers to ``prompts`` (at most :data:`MAX_EVAL_PROMPTS`), with the model in eval mode
    and no gradients; empty when the task has no way to answer prompts."""
    import torch

    respond = getattr(runtime, "answer_prompts", None)
    if respond is None or not prompts:
        return []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [eval_sample(result) for result in respond(model, list(prompts)[:MAX_EVAL_PROMPTS])]
    finally:
        model.train(was_training)


def evaluate(
    runtime: Any,
    model: Any,
    *,
    epoch: int,
    max_samples: int | None = None,
    prompts: Sequence[str] | None = None,
    metrics: bool = True,
    request_id: str | None = None,
) -> EvalEvent:
    """Metrics (when asked) and answers to ``prompts`` (None: the task's showcase prompts) as an event.

    :raises Exception: whatever the task raises while evaluating (the caller reports it).
    """
    import torch

    values: dict[str, float] = {}
    if metrics:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                values = {k: float(v) for k, v in runtime.evaluate(model, max_samples=max_samples).items()}
        finally:
            model.train(was_training)
    asked = showcase_prompts(runtime) if prompts is None else list(prompts)
    return EvalEvent(
        metrics=values, epoch=epoch, request_id=request_id, samples=answer(runtime, model, asked)
    )
