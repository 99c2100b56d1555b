"""The torch half of ``shapes-dalle``: model, shards, loss, evaluation and the KV-cached sampler.

A training sample is one token sequence of ``TEXT_LEN + image tokens`` ids: the caption's word ids
(``[0, text_vocab)``) followed by the image's patch tokens shifted by ``text_vocab``. The model is one
:class:`~workers.tasks.transformer.CausalTransformer` over that joint vocabulary. Image
positions are scored only against the image part of the vocabulary and caption positions only against
the text part, so no probability is wasted on impossible tokens. With ``factored_tokens`` (the default)
a patch token's colour and footprint and an image cell's row and column are learned features shared by
every token and position that has them (:attr:`ShapesDalleRuntime.features`).

Shards are generated and tokenised with numpy (a 256-sample shard takes ~0.1 s) and the last few are
kept in memory, so a worker's data loading is negligible next to training.

Shape comments use the letters of :mod:`workers.tasks.transformer` (``B`` batch, ``C`` width) and this
runtime's attribute names (``text_len``, ``image_len``, ``seq_len``, ``text_vocab``, ``image_vocab``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from workers.optim import param_groups
from workers.tasks.base import PromptResult
from workers.tasks.batches import repeated_rows, shuffled_batches
from workers.tasks.shapes_dalle import SHOWCASE_PROMPTS, ShapesDalleConfig, checker, data
from workers.tasks.shapes_dalle.tokenizers import TEXT_LEN, ImageTokenizer, TextTokenizer
from workers.tasks.transformer import (
    CausalTransformer,
    Features,
    TransformerShape,
    adamw_for,
    pick_token,
)

_CACHED_SHARDS = 4
"""Tokenised shards kept in memory (a worker may re-read the shard it is on, e.g. after a retry)."""
_EVAL_BATCH = 128
"""Held-out samples per forward pass during evaluation and sampling."""


class ShapesDalleRuntime:
    """The :class:`~workers.tasks.base.TaskRuntime` of ``shapes-dalle``.

    :param config: a validated :class:`ShapesDalleConfig`.
    """

    def __init__(self, config: ShapesDalleConfig):
        self.config = config
        self.text_tokenizer = TextTokenizer()
        self.image_tokenizer = ImageTokenizer(config.image_size, config.patch_size, config.codebook_size)
        self.text_len = TEXT_LEN
        self.image_len = self.image_tokenizer.tokens_per_image
        self.text_vocab = self.text_tokenizer.vocab_size
        self.image_vocab = self.image_tokenizer.vocab_size
        self.seq_len = self.text_len + self.image_len
        self._shards: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._heldout: tuple[list[data.Scene], list[str], np.ndarray] | None = None

    # ------------------------------------------------------------------------------------------ model

    @property
    def model_shape(self) -> TransformerShape:
        """The transformer hyper-parameters this config implies."""
        c = self.config
        return TransformerShape(
            vocab_size=self.text_vocab + self.image_vocab,
            max_len=self.seq_len,
            d_model=c.d_model,
            n_layers=c.n_layers,
            n_heads=c.n_heads,
            mlp_ratio=c.mlp_ratio,
            dropout=c.dropout,
        )

    @property
    def features(self) -> Features:
        """With ``config.factored_tokens``: each image token's colour and footprint mask, and each image
        position's row and column, as learned features (:class:`Features`); otherwise none.

        Feature ids: tokens: colours ``0..C`` (0: background), masks ``C+1..C+M`` (the empty mask
        first), one id for every caption word (whose two slots repeat it); positions: 0 for every
        caption position, then ``1..g`` the image rows and ``g+1..2g`` the columns (of the cell a position
        predicts).
        """
        if not self.config.factored_tokens:
            return Features()
        colours = self.image_tokenizer.num_colours
        text_feature = colours + 1 + self.image_tokenizer.num_masks
        tokens: list[tuple[int, ...]] = [(text_feature, text_feature)] * self.text_vocab
        colour, mask = self.image_tokenizer.token_parts(np.arange(self.image_vocab))
        tokens += zip(colour.tolist(), (colours + 1 + mask).tolist(), strict=True)
        # A position's features are those of the cell its output predicts: position text_len - 1 (the
        # caption's last) predicts the first image cell. The sequence's last position is never an input.
        grid = self.image_tokenizer.grid
        positions: list[tuple[int, ...]] = [(0, 0)] * (self.text_len - 1)
        positions += [(1 + cell // grid, 1 + grid + cell % grid) for cell in range(self.image_len)]
        positions.append((0, 0))
        return Features(tokens=tuple(tokens), positions=tuple(positions))

    def build_model(self) -> CausalTransformer:
        """A fresh model on the CPU with weights determined by ``config.seed``."""
        return CausalTransformer(self.model_shape, seed=self.config.seed, features=self.features)

    def param_groups(self, model: CausalTransformer) -> list[dict[str, Any]]:
        """Weight matrices with ``config.weight_decay``; biases, LayerNorms and embeddings without."""
        return param_groups(model, weight_decay=self.config.weight_decay)

    def make_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The local optimizer the collaborative trainer wraps: AdamW at the peak ``config.lr`` (the
        schedule scales it); ``params`` are :meth:`param_groups` (or plain tensors, all decayed)."""
        return adamw_for(params, lr=self.config.lr, weight_decay=self.config.weight_decay)

    # ------------------------------------------------------------------------------------------- data

    def encode_examples(self, scenes: Sequence[data.Scene], captions: Sequence[str]) -> np.ndarray:
        """Token sequences ``(N, seq_len)`` int64 of (scene, caption) pairs: caption ids, then image ids."""
        text = self.text_tokenizer.encode_batch(list(captions))  # (N, text_len)
        images = np.stack([data.render(scene, self.config.image_size) for scene in scenes])  # (N, H, W, 3)
        image_ids = self.image_tokenizer.encode(images) + self.text_vocab  # (N, image_len)
        return np.concatenate([text, image_ids], axis=1)  # (N, seq_len)

    def shard_tokens(self, shard: int) -> np.ndarray:
        """All ``samples_per_shard`` token sequences of ``shard``, in index order (cached; read-only).

        A run hands out shards ``[0, num_shards)``, but the generator defines every shard ``>= 0``, so
        benchmarks and tools may read any.

        :raises ValueError: for a negative shard.
        """
        if shard < 0:
            raise ValueError(f"shard must be >= 0, got {shard}")
        tokens = self._shards.get(shard)
        if tokens is None:
            examples = [
                data.example_for(shard, index, self.config.seed, max_objects=self.config.max_objects)
                for index in range(self.config.samples_per_shard)
            ]
            tokens = self.encode_examples([scene for scene, _ in examples], [text for _, text in examples])
            tokens.setflags(write=False)
            self._shards[shard] = tokens
            while len(self._shards) > _CACHED_SHARDS:
                self._shards.popitem(last=False)
        else:
            self._shards.move_to_end(shard)
        return tokens

    def shard_batches(
        self, shard: int, *, batch_size: int, seed: int, device: torch.device | str = "cpu"
    ) -> Iterator[torch.Tensor]:
        """Every sample of ``shard`` once, in an order shuffled by ``(seed, shard)``, as ``(B, seq_len)``
        int64 tensors on ``device`` (the last one may be smaller).

        :param shard: the shard number (>= 0; a run uses ``[0, num_shards)``).
        :param batch_size: samples per micro-batch (>= 1).
        :param seed: the shuffling seed (>= 0).
        :param device: where the batches are put.
        """
        return shuffled_batches(self.shard_tokens, shard, batch_size=batch_size, seed=seed, device=device)

    def batch_size_of(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])

    def example_batch(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A ``(batch_size, seq_len)`` batch of real training samples (for benchmarks and smoke tests)."""
        return repeated_rows(self.shard_tokens(0), batch_size, device)

    # ------------------------------------------------------------------------------------------- loss

    def _image_logits(self, model: CausalTransformer, hidden: torch.Tensor) -> torch.Tensor:
        return model.logits(hidden, self.text_vocab).float()

    def losses(
        self, model: CausalTransformer, batch: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(image loss, text loss or None)``: mean cross-entropies per image token and per caption word.

        The text loss is computed only when ``text_loss_weight > 0``; padding is not scored.
        """
        hidden = model(batch[:, :-1])  # (B, seq_len - 1, C)
        # position text_len - 1 (the caption's last) predicts the first image token
        logits = self._image_logits(model, hidden[:, self.text_len - 1 :])  # (B, image_len, image_vocab)
        targets = batch[:, self.text_len :] - self.text_vocab  # (B, image_len)
        image_loss = F.cross_entropy(
            logits.reshape(-1, self.image_vocab),  # (B * image_len, image_vocab)
            targets.reshape(-1),  # (B * image_len,)
        )
        if self.config.text_loss_weight <= 0:
            return image_loss, None
        text_logits = model.logits(hidden[:, : self.text_len - 1], 0, self.text_vocab)
        # text_logits: (B, text_len - 1, text_vocab), predicting caption tokens 1 .. text_len - 1
        text_loss = F.cross_entropy(
            text_logits.float().reshape(-1, self.text_vocab),  # (B * (text_len - 1), text_vocab)
            batch[:, 1 : self.text_len].reshape(-1),  # (B * (text_len - 1),)
            ignore_index=self.text_tokenizer.pad_id,
        )
        return image_loss, text_loss

    def loss(self, model: CausalTransformer, batch: torch.Tensor) -> torch.Tensor:
        """The training loss: image-token cross-entropy plus ``text_loss_weight`` x caption cross-entropy."""
        image_loss, text_loss = self.losses(model, batch)
        if text_loss is None:
            return image_loss
        return image_loss + self.config.text_loss_weight * text_loss

    # ------------------------------------------------------------------------------------- sampling

    @torch.no_grad()
    def sample_tokens(
        self,
        model: CausalTransformer,
        prompts: Sequence[str],
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Image tokens ``(N, image_len)`` (image vocabulary ids, on the model's device) for ``prompts``.

        Decodes one token per step with a KV cache; the model is put in eval mode and restored after.

        :param model: the model.
        :param prompts: captions in the data set's language (unknown words become ``<unk>``).
        :param temperature: softmax temperature; 0 picks the most likely token (greedy).
        :param top_k: sample only among the ``top_k`` most likely tokens.
        :param generator: the random source, on the model's device (for reproducible pictures).
        """
        device = model.head.weight.device
        was_training = model.training
        model.eval()
        try:
            chunks = []
            for start in range(0, len(prompts), _EVAL_BATCH):
                text = self.text_tokenizer.encode_batch(list(prompts[start : start + _EVAL_BATCH]))
                text_ids = torch.from_numpy(text).to(device)  # (B, text_len)
                cache = model.new_cache(len(text_ids))
                hidden = model(text_ids, cache)[:, -1]  # (B, text_len, C) -> the last position's (B, C)
                picked = []
                for step in range(self.image_len):
                    logits = self._image_logits(model, hidden)  # (B, image_vocab)
                    token = pick_token(logits, temperature, top_k, generator)  # (B,)
                    picked.append(token)
                    if step + 1 < self.image_len:
                        next_ids = (token + self.text_vocab)[:, None]  # (B, 1): one new position
                        hidden = model(next_ids, cache)[:, -1]  # (B, 1, C) -> (B, C)
                chunks.append(torch.stack(picked, dim=1))  # (B, image_len)
            return (
                torch.cat(chunks)
                if chunks
                else torch.zeros((0, self.image_len), dtype=torch.long, device=device)
            )
        finally:
            model.train(was_training)

    def sample(
        self,
        model: CausalTransformer,
        prompts: list[str],
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> np.ndarray:
        """Pictures ``(N, image_size, image_size, 3)`` uint8 drawn by ``model`` for ``prompts``.

        See :meth:`sample_tokens` for the parameters; :func:`data.image_to_png_bytes` turns one into a PNG.
        """
        tokens = self.sample_tokens(model, prompts, temperature=temperature, top_k=top_k, generator=generator)
        return self.image_tokenizer.decode(tokens.cpu().numpy())

    # ----------------------------------------------------------------------------------- evaluation

    def heldout(self) -> tuple[list[data.Scene], list[str], np.ndarray]:
        """The held-out scenes, captions and token sequences (``max(eval_samples, eval_prompts)`` of each)."""
        if self._heldout is None:
            count = max(self.config.eval_samples, self.config.eval_prompts)
            examples = data.heldout_examples(count, self.config.seed, max_objects=self.config.max_objects)
            scenes = [scene for scene, _ in examples]
            captions = [text for _, text in examples]
            self._heldout = scenes, captions, self.encode_examples(scenes, captions)
        return self._heldout

    @torch.no_grad()
    def evaluate(self, model: CausalTransformer, *, max_samples: int | None = None) -> dict[str, float]:
        """Held-out metrics of ``model`` (left in the train/eval mode it came in).

        * ``loss``: mean image-token cross-entropy on ``eval_samples`` held-out samples.
        * ``text_loss``: the caption cross-entropy, only when ``text_loss_weight > 0``.
        * ``prompt_accuracy``: the fraction of ``eval_prompts`` held-out captions whose sampled picture
          the checker finds entirely right; ``object_accuracy``: the fraction of their objects drawn right.

        :param max_samples: caps both counts, to at least one each (for quick checks); sampling uses a generator seeded with
          ``config.seed``, so the same weights always give the same numbers.
        """
        cap = (
            max_samples
            if max_samples is not None
            else max(self.config.eval_samples, self.config.eval_prompts)
        )
        n_loss = max(1, min(self.config.eval_samples, cap))
        n_prompts = max(1, min(self.config.eval_prompts, cap))
        scenes, captions, tokens = self.heldout()
        device = model.head.weight.device
        was_training = model.training
        model.eval()
        try:
            image_total, text_total = 0.0, 0.0
            for start in range(0, n_loss, _EVAL_BATCH):
                batch = torch.from_numpy(tokens[start : min(start + _EVAL_BATCH, n_loss)]).to(device)
                image_loss, text_loss = self.losses(model, batch)
                image_total += float(image_loss) * len(batch)
                text_total += float(text_loss) * len(batch) if text_loss is not None else 0.0
        finally:
            model.train(was_training)
        metrics = {"loss": image_total / n_loss}
        if self.config.text_loss_weight > 0:
            metrics["text_loss"] = text_total / n_loss
        generator = torch.Generator(device=device).manual_seed(self.config.seed)
        images = self.sample(
            model,
            captions[:n_prompts],
            temperature=self.config.eval_temperature,
            top_k=self.config.eval_top_k,
            generator=generator,
        )
        checks = checker.check_images(images, scenes[:n_prompts])
        objects = [result.ok for check in checks for result in check.objects]
        metrics["prompt_accuracy"] = sum(check.ok for check in checks) / len(checks)
        metrics["object_accuracy"] = sum(objects) / len(objects)
        return metrics

    # ------------------------------------------------------------------------------------- showcase

    def showcase_prompts(self) -> list[str]:
        """The fixed prompts the demo, the TUI and the checkpoint grids draw (:data:`SHOWCASE_PROMPTS`)."""
        if self.config.max_objects == 1:
            return [p for p in SHOWCASE_PROMPTS if len(data.parse_prompt(p).objects) == 1]
        return list(SHOWCASE_PROMPTS)

    def prompt_problem(self, prompt: str) -> tuple[str | None, data.Scene | None]:
        """``(None, scene)`` for a caption the model can draw, else ``(why not, None)``."""
        words = data.words_of(prompt)
        if not words:
            return (
                "the caption is empty; describe one or two shapes, e.g. 'a big red circle at the top left'",
                None,
            )
        unknown = sorted({w for w in words if w not in data.VOCABULARY})
        if unknown:
            listed = ", ".join(repr(w) for w in unknown[:5])
            return (
                f"unknown word{'s' if len(unknown) > 1 else ''} {listed}: the model knows sizes (small, big), "
                f"colours ({', '.join(data.COLOURS)}), shapes ({', '.join(data.SHAPES)}) and positions "
                "(top, bottom, left, right, center)",
                None,
            )
        if len(words) > self.text_len - 1:
            return f"the caption has {len(words)} words; at most {self.text_len - 1} fit", None
        try:
            scene = data.parse_prompt(prompt)
        except ValueError as exc:
            return str(exc), None
        if len(scene.objects) > self.config.max_objects:
            return f"this run draws at most {self.config.max_objects} shape(s) per picture", None
        return None, scene

    def answer_prompts(self, model: CausalTransformer, prompts: list[str]) -> list[PromptResult]:
        """Greedy drawings of ``prompts``, each judged by the checker against what its caption says.

        Captions the model cannot read come back with ``error`` set (and are not drawn).
        """
        results: list[PromptResult] = []
        drawable: list[tuple[int, data.Scene]] = []
        for index, prompt in enumerate(prompts):
            problem, scene = self.prompt_problem(prompt)
            results.append(PromptResult(prompt=prompt, kind="image", error=problem))
            if scene is not None:
                drawable.append((index, scene))
        if drawable:
            images = self.sample(model, [prompts[i] for i, _ in drawable], temperature=0.0)
            for (index, scene), image in zip(drawable, images, strict=True):
                results[index].image = image
                results[index].correct = checker.check_image(image, scene).ok
        return results


def build_runtime(config: ShapesDalleConfig) -> ShapesDalleRuntime:
    """The runtime for ``config`` (what ``TASK.build_runtime`` calls)."""
    return ShapesDalleRuntime(config)
