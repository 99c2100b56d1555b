"""Tokenizers of ``shapes-dalle``: words to ids, and images to a grid of discrete patch tokens.

There is no pretrained VQGAN for this data, and none is needed: the images are flat-coloured shapes on
a plain background, so a fixed, deterministic codebook describes them well.

* :class:`TextTokenizer` maps the caption language's words (:data:`data.VOCABULARY`) plus ``<pad>``,
  ``<bos>`` and ``<unk>`` to ids, in a fixed order, and pads every caption to :data:`TEXT_LEN` tokens.
* :class:`ImageTokenizer` cuts an image into ``patch_size`` x ``patch_size`` patches. A patch's token
  is the pair (palette colour, footprint): the patch's most common non-background colour and the
  codebook mask nearest (by Hamming distance) to where that colour is. Token 0 is an empty patch.
  The codebook is the ``num_masks - 1`` most frequent non-empty patch footprints over every way a single
  object can be drawn (ties broken by the mask's bytes), so it is the same on every machine and
  covers the shapes' edges exactly. Decoding paints each mask in its colour, hence
  ``encode(decode(tokens)) == tokens`` for every valid token grid.

Needs numpy only. Shape comments name images ``n``, the grid's side in patches ``g``, a patch's side
in pixels ``p`` (an image is ``H = W = g * p`` pixels and ``T = g * g`` tokens) and the codebook's
masks ``M``.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from workers.tasks.shapes_dalle import data

TEXT_LEN = 32
"""Text tokens per caption, ``<bos>`` included; the longest generated caption has 30 words."""

PAD = "<pad>"
BOS = "<bos>"
UNK = "<unk>"


class TextTokenizer:
    """A word-level tokenizer over a fixed vocabulary, padding or truncating to ``length`` tokens.

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<unk>``, then the sorted words. An encoded caption is
    ``[<bos>, word ids..., <pad>...]``.

    :param words: the vocabulary (default: every word the caption generator uses).
    :param length: tokens per encoded caption, ``<bos>`` included.
    """

    def __init__(self, words: frozenset[str] | None = None, length: int = TEXT_LEN):
        self.vocab: tuple[str, ...] = (PAD, BOS, UNK, *sorted(data.VOCABULARY if words is None else words))
        self.length = length
        self._ids = {word: i for i, word in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.unk_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """``(length,)`` int64 ids of ``text``: ``<bos>``, its words (unknown ones as ``<unk>``; words
        past ``length - 1`` are dropped), then padding."""
        ids = np.full(self.length, self.pad_id, dtype=np.int64)
        ids[0] = self.bos_id
        words = data.words_of(text)[: self.length - 1]
        ids[1 : 1 + len(words)] = [self._ids.get(word, self.unk_id) for word in words]
        return ids

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        """``(len(texts), length)`` int64 ids."""
        return (
            np.stack([self.encode(text) for text in texts]) if texts else np.zeros((0, self.length), np.int64)
        )

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """The text of ``ids``, skipping ``<pad>``/``<bos>`` and attaching punctuation to the word before it.

        ``decode(encode(caption)) == caption`` for every caption the generator writes.
        """
        text = ""
        for i in np.asarray(ids).tolist():
            if i in (self.pad_id, self.bos_id):
                continue
            word = self.vocab[i] if 0 <= i < len(self.vocab) else UNK
            if word in data.PUNCTUATION or not text:
                text += word
            else:
                text += " " + word
        return text


def _pack(masks: np.ndarray) -> np.ndarray:
    """Pack ``(..., P*P)`` boolean masks into ``(..., ceil(P*P/8))`` uint8 rows (for Hamming distances)."""
    return np.packbits(masks, axis=-1)


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


@functools.lru_cache(maxsize=16)
def mask_codebook(image_size: int, patch_size: int, num_masks: int) -> np.ndarray:
    """The ``(num_masks, patch_size**2)`` boolean codebook; row 0 is the empty mask (read-only).

    Rows 1.. are the most frequent non-empty patch footprints over :func:`data.all_single_objects`
    rendered at ``image_size``, most frequent first, ties broken by the packed bytes. When fewer
    distinct footprints exist, the codebook is shorter than ``num_masks``.
    """
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    grid = image_size // patch_size
    counts: collections.Counter[bytes] = collections.Counter()
    for obj in data.all_single_objects():
        footprint = (data.render(data.Scene((obj,)), image_size) != data.BACKGROUND).any(axis=-1)  # (H, W)
        patches = footprint.reshape(grid, patch_size, grid, patch_size)  # (g, p, g, p)
        patches = patches.transpose(0, 2, 1, 3)  # (g, g, p, p)
        patches = patches.reshape(-1, patch_size * patch_size)  # (g * g, p * p): one row per patch
        for packed in _pack(patches[patches.any(axis=1)]):
            counts[packed.tobytes()] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[: max(0, num_masks - 1)]
    rows = [np.zeros(patch_size * patch_size, dtype=bool)]
    for packed, _ in ranked:
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8))[: patch_size * patch_size]
        rows.append(bits.astype(bool))
    codebook = np.stack(rows)
    codebook.setflags(write=False)
    return codebook


class ImageTokenizer:
    """Images to ``(image_size / patch_size)**2`` tokens and back, with a deterministic mask codebook.

    Token 0 is an empty (background) patch; token ``1 + (c - 1) * (M - 1) + (m - 1)`` paints codebook
    mask ``m`` (1..M-1) in palette colour ``c`` (1..8), where ``M`` is the codebook size.

    :param image_size: the image side in pixels.
    :param patch_size: the patch side in pixels (a divisor of ``image_size``).
    :param num_masks: the codebook size, the empty mask included. More masks draw edges more exactly
      but make the output vocabulary (``1 + 8 * (num_masks - 1)``) larger.
    """

    def __init__(self, image_size: int = data.IMAGE_SIZE, patch_size: int = 4, num_masks: int = 64):
        self.image_size = image_size
        self.patch_size = patch_size
        self.grid = image_size // patch_size
        self.palette = data.palette()
        self.codebook = mask_codebook(image_size, patch_size, num_masks)
        self._packed_codebook = _pack(self.codebook)
        self.num_masks = len(self.codebook)
        self.num_colours = len(self.palette) - 1

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_colours * (self.num_masks - 1)

    @property
    def tokens_per_image(self) -> int:
        return self.grid * self.grid

    def encode(self, images: np.ndarray) -> np.ndarray:
        """Tokens of one ``(H, W, 3)`` image or a ``(N, H, W, 3)`` batch: ``(T,)`` or ``(N, T)`` int64.

        Pixels are snapped to the nearest palette colour first, so slightly off colours still encode.
        """
        images = np.asarray(images)
        single = images.ndim == 3
        if single:
            images = images[None]  # (1, H, W, 3)
        if images.shape[1:] != (self.image_size, self.image_size, 3):
            raise ValueError(
                f"expected images of shape ({self.image_size}, {self.image_size}, 3), got {images.shape[1:]}"
            )
        n, g, p = len(images), self.grid, self.patch_size
        index = data.palette_indices(images)  # (n, H, W) palette ids
        patches = index.reshape(n, g, p, g, p)  # (n, patch row, pixel row, patch column, pixel column)
        patches = patches.transpose(0, 1, 3, 2, 4)  # (n, g, g, p, p)
        patches = patches.reshape(n * g * g, p * p)  # one row per patch, images and patches in raster order
        counts = np.stack([(patches == c).sum(axis=1) for c in range(1, self.num_colours + 1)], axis=1)
        colour = counts.argmax(axis=1) + 1  # the first of equally common colours wins
        nearest = np.zeros(len(patches), dtype=np.int64)
        drawn = np.flatnonzero(counts.any(axis=1))  # most patches are background: skip them
        # (drawn, p * p) == (drawn, 1), packed to (drawn, bytes)
        masks = _pack(patches[drawn] == colour[drawn, None])
        # (drawn, 1, bytes) ^ (1, M, bytes) -> bit counts summed over bytes: (drawn, M)
        distances = _POPCOUNT[masks[:, None, :] ^ self._packed_codebook[None, :, :]].sum(
            axis=-1, dtype=np.int32
        )
        nearest[drawn] = distances.argmin(axis=1)
        tokens = np.where(nearest == 0, 0, 1 + (colour - 1) * (self.num_masks - 1) + (nearest - 1))
        tokens = tokens.reshape(n, g * g).astype(np.int64)  # (n, T)
        return tokens[0] if single else tokens

    def token_parts(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(colour, mask)`` of each token, arrays shaped like ``tokens``: palette colour ``0..C`` and
        codebook row ``0..M-1``, both 0 for the empty patch (token 0)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        shifted = np.maximum(tokens - 1, 0)
        colour = np.where(tokens == 0, 0, 1 + shifted // (self.num_masks - 1))
        mask = np.where(tokens == 0, 0, 1 + shifted % (self.num_masks - 1))
        return colour, mask

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """Images of ``(T,)`` or ``(N, T)`` tokens: ``(H, W, 3)`` or ``(N, H, W, 3)`` uint8.

        :raises ValueError: for a token outside ``[0, vocab_size)`` or a wrong token count.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        single = tokens.ndim == 1
        if single:
            tokens = tokens[None]  # (1, T)
        if tokens.shape[1] != self.tokens_per_image:
            raise ValueError(f"expected {self.tokens_per_image} tokens per image, got {tokens.shape[1]}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"image tokens must lie in [0, {self.vocab_size})")
        n, g, p = len(tokens), self.grid, self.patch_size
        colour, mask_id = self.token_parts(tokens)  # (n, T) each
        mask = self.codebook[mask_id]  # (n, T, p * p)
        index = np.where(mask, colour[..., None], 0).astype(np.uint8)  # (n, T, p * p) palette ids
        index = index.reshape(n, g, g, p, p)  # (n, patch row, patch column, pixel row, pixel column)
        index = index.transpose(0, 1, 3, 2, 4)  # (n, g, p, g, p)
        index = index.reshape(n, g * p, g * p)  # (n, H, W)
        images = self.palette[index]  # (n, H, W, 3)
        return images[0] if single else images
