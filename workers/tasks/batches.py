"""Batches of a task's token rows, shared by the built-in tasks' runtimes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch


def shuffled_batches(
    shard_tokens: Callable[[int], np.ndarray],
    shard: int,
    *,
    batch_size: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> Iterator[torch.Tensor]:
    """Every row of ``shard_tokens(shard)`` once, in an order shuffled by ``(seed, shard)``, as int64
    tensors of ``batch_size`` rows on ``device`` (the last one may be smaller)."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    tokens = shard_tokens(shard)
    order = np.random.default_rng((seed, shard)).permutation(len(tokens))
    for start in range(0, len(order), batch_size):
        yield torch.from_numpy(tokens[order[start : start + batch_size]]).to(device)


def repeated_rows(tokens: np.ndarray, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``batch_size`` rows of ``tokens`` from the first on, starting over when they run out."""
    return torch.from_numpy(tokens[np.resize(np.arange(len(tokens)), batch_size)]).to(device)
