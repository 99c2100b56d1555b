"""The torch half of ``tiny-lm``: the character vocabulary, windows, loss, evaluation and sampling.

The whole text is turned into one array of character ids once (a few MB of text takes well under a
second); a shard is then a fancy-indexing gather of ``samples_per_shard`` windows, so data loading
costs nothing. The network is the decoder-only transformer shared with ``shapes-dalle``
(:mod:`workers.tasks.transformer`), whose letters the shape comments use (``B`` batch, ``C`` width,
``V`` the vocabulary); a training window has ``seq_len + 1`` characters (the inputs and, shifted by
one, the targets).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from workers.optim import param_groups
from workers.tasks.base import PromptResult
from workers.tasks.batches import repeated_rows, shuffled_batches
from workers.tasks.tiny_lm import TinyLmConfig, corpus
from workers.tasks.transformer import CausalTransformer, TransformerShape, adamw_for, pick_token

_EVAL_BATCH = 64
"""Held-out windows per forward pass during evaluation."""


class TinyLmRuntime:
    """The :class:`~workers.tasks.base.TaskRuntime` of ``tiny-lm``.

    :param config: a validated :class:`TinyLmConfig`.
    :raises FileNotFoundError: when ``text_path`` does not exist on this machine.
    :raises ValueError: when the file's SHA-256 differs from ``text_sha256``, or the text is too short.
    """

    def __init__(self, config: TinyLmConfig):
        self.config = config
        if config.text_path is not None and config.text_sha256 is not None:
            actual = corpus.file_sha256(config.text_path)
            if actual != config.text_sha256:
                raise ValueError(
                    f"{config.text_path!r} has SHA-256 {actual}, but the run expects {config.text_sha256}"
                )
        text = corpus.load_corpus(config.text_path, config.fallback_chars)
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        alphabet, ids = np.unique(codepoints, return_inverse=True)
        self.chars: tuple[str, ...] = tuple(chr(int(c)) for c in alphabet)
        """The vocabulary: every character of the text, sorted by code point."""
        self._index = {char: i for i, char in enumerate(self.chars)}
        ids = ids.astype(np.int64).reshape(-1)  # (characters in the text,)
        split = len(ids) - corpus.heldout_chars(len(ids), config.seq_len, config.heldout_fraction)
        self._train, self._heldout = ids[:split], ids[split:]
        self.windows = corpus.train_windows(len(ids), config.seq_len, config.heldout_fraction)
        """Training windows of ``seq_len + 1`` characters."""
        if self.windows < 1:
            raise ValueError(f"the text has {len(ids)} characters, too few for seq_len {config.seq_len}")
        self._offsets = np.arange(config.seq_len + 1)  # (seq_len + 1,)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def build_model(self) -> CausalTransformer:
        """A fresh model on the CPU with weights determined by ``config.seed``."""
        c = self.config
        shape = TransformerShape(
            vocab_size=self.vocab_size,
            max_len=c.seq_len,
            d_model=c.d_model,
            n_layers=c.n_layers,
            n_heads=c.n_heads,
            mlp_ratio=c.mlp_ratio,
            dropout=c.dropout,
        )
        return CausalTransformer(shape, seed=c.seed)

    def param_groups(self, model: CausalTransformer) -> list[dict[str, Any]]:
        """Weight matrices with ``config.weight_decay``; biases, LayerNorms and embeddings without."""
        return param_groups(model, weight_decay=self.config.weight_decay)

    def make_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The local optimizer the collaborative trainer wraps: AdamW with ``config.lr`` and
        ``config.weight_decay`` (see :func:`adamw_for`); ``params`` may be tensors or param-group dicts."""
        return adamw_for(params, lr=self.config.lr, weight_decay=self.config.weight_decay)

    # ------------------------------------------------------------------------------------------- data

    def encode(self, text: str) -> np.ndarray:
        """Character ids of ``text``.

        :raises ValueError: when ``text`` has a character the training text never uses.
        """
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(f"characters not in the training text: {''.join(unknown)!r}")
        return np.array([self._index[char] for char in text], dtype=np.int64)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """The text of character ids."""
        return "".join(self.chars[i] for i in np.asarray(ids).tolist())

    def shard_tokens(self, shard: int) -> np.ndarray:
        """The ``(samples_per_shard, seq_len + 1)`` int64 windows of ``shard``, in order.

        Window ``w`` starts at character ``w * seq_len`` of the training text; shard ``s`` holds windows
        ``s * samples_per_shard + i`` modulo the number of windows, so every shard ``>= 0`` is defined
        (a run hands out ``[0, shard_count)``; later ones repeat the text).

        :raises ValueError: for a negative shard.
        """
        if shard < 0:
            raise ValueError(f"shard must be >= 0, got {shard}")
        first = shard * self.config.samples_per_shard
        windows = (first + np.arange(self.config.samples_per_shard)) % self.windows  # (samples_per_shard,)
        starts = windows[:, None] * self.config.seq_len  # (samples_per_shard, 1)
        return self._train[starts + self._offsets]  # (samples_per_shard, seq_len + 1)

    def shard_batches(
        self, shard: int, *, batch_size: int, seed: int, device: torch.device | str = "cpu"
    ) -> Iterator[torch.Tensor]:
        """Every window of ``shard`` once, shuffled by ``(seed, shard)``, as ``(B, seq_len + 1)`` int64
        tensors on ``device`` (the last one may be smaller)."""
        return shuffled_batches(self.shard_tokens, shard, batch_size=batch_size, seed=seed, device=device)

    def batch_size_of(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])

    def example_batch(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A ``(batch_size, seq_len + 1)`` batch of real training windows (for benchmarks)."""
        return repeated_rows(self.shard_tokens(0), batch_size, device)

    # ------------------------------------------------------------------------------------ objective

    def loss(self, model: CausalTransformer, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy (nats) over every position of ``batch``."""
        logits = model.head(model(batch[:, :-1])).float()  # (B, seq_len, V)
        return F.cross_entropy(
            logits.reshape(-1, self.vocab_size),  # (B * seq_len, V)
            batch[:, 1:].reshape(-1),  # (B * seq_len,)
        )

    def heldout_tokens(self) -> np.ndarray:
        """The held-out text as non-overlapping ``(n, seq_len + 1)`` windows (at least one)."""
        step = self.config.seq_len
        count = max(1, (len(self._heldout) - 1) // step)
        starts = np.arange(count)[:, None] * step  # (count, 1)
        return self._heldout[starts + self._offsets]  # (count, seq_len + 1)

    @torch.no_grad()
    def evaluate(self, model: CausalTransformer, *, max_samples: int | None = None) -> dict[str, float]:
        """Held-out ``loss`` (nats per character) and ``bits_per_char`` of ``model``.

        :param max_samples: evaluate at most this many windows (at least one); default ``eval_samples``.
        """
        windows = self.heldout_tokens()
        limit = (
            self.config.eval_samples if max_samples is None else min(max_samples, self.config.eval_samples)
        )
        windows = windows[: max(1, limit)]
        device = model.head.weight.device
        was_training = model.training
        model.eval()
        try:
            total = 0.0
            for start in range(0, len(windows), _EVAL_BATCH):
                batch = torch.from_numpy(windows[start : start + _EVAL_BATCH]).to(device)
                total += float(self.loss(model, batch)) * len(batch)
        finally:
            model.train(was_training)
        loss = total / len(windows)
        return {"loss": loss, "bits_per_char": loss / math.log(2)}

    # -------------------------------------------------------------------------------------- sampling

    @torch.no_grad()
    def sample(
        self,
        model: CausalTransformer,
        prompt: str,
        *,
        max_new_chars: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> str:
        """``prompt`` continued by ``max_new_chars`` characters drawn from ``model``.

        Uses a KV cache; when the context fills up, it restarts from the last half of it.

        :param model: the model.
        :param prompt: a non-empty text made of characters of the training text.
        :param max_new_chars: how many characters to add.
        :param temperature: softmax temperature; 0 picks the most likely character.
        :param top_k: sample only among the ``top_k`` most likely characters.
        :param generator: the random source, on the model's device.
        """
        if not prompt:
            raise ValueError("the prompt must not be empty")
        ids = self.encode(prompt).tolist()
        device = model.head.weight.device
        context = self.config.seq_len
        was_training = model.training
        model.eval()
        try:
            cache = None
            hidden = torch.empty(0)
            for _ in range(max_new_chars):
                if cache is None or cache.length == context:
                    keep = context if cache is None else context // 2
                    cache = model.new_cache(1)
                    prompt_ids = torch.tensor([ids[-keep:]], device=device)  # (1, T)
                    hidden = model(prompt_ids, cache)[:, -1]  # (1, T, C) -> the last position's (1, C)
                logits = model.head(hidden).float()  # (1, V)
                next_id = int(pick_token(logits, temperature, top_k, generator)[0])  # (1,) -> one id
                ids.append(next_id)
                if cache.length < context:
                    next_ids = torch.tensor([[next_id]], device=device)  # (1, 1)
                    hidden = model(next_ids, cache)[:, -1]  # (1, 1, C) -> (1, C)
        finally:
            model.train(was_training)
        return prompt + self.decode(ids[len(prompt) :])

    # -------------------------------------------------------------------------------------- showcase

    SHOWCASE_COUNT = 4
    SHOWCASE_PROMPT_CHARS = 24
    SHOWCASE_NEW_CHARS = 120

    def showcase_prompts(self) -> list[str]:
        """The starts of a few held-out windows: lines the model never trained on."""
        windows = self.heldout_tokens()
        step = max(1, len(windows) // self.SHOWCASE_COUNT)
        return [self.decode(windows[i][: self.SHOWCASE_PROMPT_CHARS]) for i in range(0, len(windows), step)][
            : self.SHOWCASE_COUNT
        ]

    def answer_prompts(self, model: CausalTransformer, prompts: list[str]) -> list[PromptResult]:
        """Each prompt continued by 120 characters (temperature 0.8, seeded: the same weights always write
        the same lines). A prompt with characters the text never uses is answered with an error."""
        results = []
        for index, prompt in enumerate(prompts):
            if not prompt:
                results.append(PromptResult(prompt=prompt, kind="text", error="the prompt is empty"))
                continue
            unknown = sorted(set(prompt) - self._index.keys())
            if unknown:
                error = f"characters the training text never uses: {''.join(unknown)!r}"
                results.append(PromptResult(prompt=prompt, kind="text", error=error))
                continue
            generator = torch.Generator(device=model.head.weight.device).manual_seed(self.config.seed + index)
            text = self.sample(
                model, prompt, max_new_chars=self.SHOWCASE_NEW_CHARS, temperature=0.8, generator=generator
            )
            results.append(PromptResult(prompt=prompt, kind="text", text=text))
        return results


def build_runtime(config: TinyLmConfig) -> TinyLmRuntime:
    """The runtime for ``config`` (what ``TASK.build_runtime`` calls)."""
    return TinyLmRuntime(config)
