"""A small decoder-only (GPT-style) transformer with a key/value cache, shared by the built-in tasks.

Both ``shapes-dalle`` and ``tiny-lm`` build their network from this module (it sits beside
:mod:`workers.tasks.base`, not inside either task, because neither owns it); a task adds only its
vocabulary, its features and the slice of the head it scores.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> GELU MLP -> residual),
learned token and position embeddings, a final LayerNorm and an untied output head. Attention uses
:func:`torch.nn.functional.scaled_dot_product_attention`, which picks the fastest kernel on CPU and GPU.

Optionally, tokens and positions also have *features* (:class:`Features`): a token's embedding is then
its own vector plus one learned vector per feature it has, and a token's logit is its own score plus
one learned score per feature. A task whose tokens are combinations of a few parts (``shapes-dalle``'s
patch tokens are a colour and a footprint; its image positions a row and a column) names the parts,
so that what the model learns about "red" serves every red patch at once instead of each of the 127
red tokens on its own: ``shapes-dalle`` learns about twice as much per sample with them.

Decoding token by token goes through a :class:`KVCache`: each step feeds one new token and attends to
the cached keys and values of all earlier ones, so sampling ``n`` tokens costs ``n`` single-position
steps rather than ``n`` full forward passes.

Tensor shapes are written after every reshape in nanoGPT's style, ``# (B, nh, T, hs)``, with:

* ``B``: batch size (sequences decoded or trained together);
* ``T``: positions fed in this call (the whole sequence, a prompt, or 1 per cached decoding step);
* ``C``: the residual stream width, ``d_model``;
* ``nh``: attention heads, ``n_heads``; ``hs``: the head size, ``C // nh``;
* ``L``: ``max_len``, the positions a :class:`KVCache` holds;
* ``V``: the token ids scored (the whole vocabulary, or the slice a task asks
  :meth:`CausalTransformer.logits` for);
* ``F``: features per token or per position (:class:`Features`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TransformerShape:
    """The hyper-parameters of a :class:`CausalTransformer`.

    :param vocab_size: input token ids are in ``[0, vocab_size)``; the head predicts the same ids.
    :param max_len: the longest sequence (positions have learned embeddings).
    :param d_model: the residual stream width.
    :param n_layers: the number of blocks.
    :param n_heads: attention heads per block (must divide ``d_model``).
    :param mlp_ratio: the MLP's hidden width over ``d_model``.
    :param dropout: dropout on attention weights and residual branches during training.
    """

    vocab_size: int
    max_len: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0


@dataclass(frozen=True)
class Features:
    """Learned features shared by several tokens or positions (see the module docstring).

    :param tokens: for every token id, the ids of its features (the same count per token: repeat one
      to give a token fewer), or empty for none.
    :param positions: the same for every position ``[0, max_len)``, or empty.
    """

    tokens: tuple[tuple[int, ...], ...] = ()
    positions: tuple[tuple[int, ...], ...] = ()


class KVCache:
    """Keys and values of the positions decoded so far, one preallocated buffer per layer.

    :param batch: the batch size of the decoding run.
    :param shape: the model's shape.
    :param device: where the buffers live.
    :param dtype: the buffers' dtype (the model's activation dtype).
    """

    def __init__(self, batch: int, shape: TransformerShape, device: torch.device, dtype: torch.dtype):
        head_dim = shape.d_model // shape.n_heads
        size = (batch, shape.n_heads, shape.max_len, head_dim)  # (B, nh, L, hs)
        self.keys = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.n_layers)]
        self.values = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.n_layers)]
        self.length = 0
        """How many positions are cached; the next token fed is at position ``length``."""


class SelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused query/key/value projection."""

    def __init__(self, shape: TransformerShape):
        super().__init__()
        self.n_heads = shape.n_heads
        self.dropout = shape.dropout
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.proj = nn.Linear(shape.d_model, shape.d_model)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        batch, length, width = x.shape  # (B, T, C)
        qkv = self.qkv(x)  # (B, T, 3 * C)
        qkv = qkv.view(batch, length, 3, self.n_heads, width // self.n_heads)  # (B, T, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hs) -> q, k, v each (B, nh, T, hs)
        if cache is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )  # (B, nh, T, hs)
        else:
            start = cache.length
            cache.keys[layer][:, :, start : start + length] = k  # into (B, nh, L, hs) at [start, start + T)
            cache.values[layer][:, :, start : start + length] = v
            if start == 0:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
            elif length == 1:
                keys = cache.keys[layer][:, :, : start + 1]  # (B, nh, start + 1, hs)
                values = cache.values[layer][:, :, : start + 1]  # (B, nh, start + 1, hs)
                out = F.scaled_dot_product_attention(q, keys, values)  # (B, nh, 1, hs)
            else:
                raise ValueError("after the first call, a cached forward takes one token at a time")
        out = out.transpose(1, 2)  # (B, T, nh, hs)
        out = out.reshape(batch, length, width)  # (B, T, C): the heads side by side again
        return F.dropout(self.proj(out), self.dropout, self.training)  # (B, T, C)


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, shape: TransformerShape):
        super().__init__()
        self.norm1 = nn.LayerNorm(shape.d_model)
        self.attn = SelfAttention(shape)
        self.norm2 = nn.LayerNorm(shape.d_model)
        self.fc = nn.Linear(shape.d_model, shape.mlp_ratio * shape.d_model)
        self.out = nn.Linear(shape.mlp_ratio * shape.d_model, shape.d_model)
        self.dropout = shape.dropout

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache, layer)  # (B, T, C)
        hidden = F.gelu(self.fc(self.norm2(x)), approximate="tanh")  # (B, T, mlp_ratio * C)
        return x + F.dropout(self.out(hidden), self.dropout, self.training)


class CausalTransformer(nn.Module):
    """A decoder-only transformer over one token vocabulary.

    ``forward`` returns the final hidden states, not logits, so callers apply :attr:`head` only where
    they need predictions (and to the slice of the vocabulary they need), which saves time and memory.

    :param shape: the hyper-parameters.
    :param seed: the seed of the initial weights; the same seed gives bit-identical weights on every
      machine with the same kind of CPU (elsewhere torch's vectorised ``randn`` may round the last bit
      differently), and the global torch RNG is left untouched.
    """

    def __init__(self, shape: TransformerShape, seed: int = 0, features: Features | None = None):
        super().__init__()
        if shape.d_model % shape.n_heads:
            raise ValueError(f"d_model {shape.d_model} is not a multiple of n_heads {shape.n_heads}")
        self.shape = shape
        features = features or Features()
        token_features = _feature_table(features.tokens, shape.vocab_size, "token")
        position_features = _feature_table(features.positions, shape.max_len, "position")
        self.token_features: torch.Tensor | None
        self.position_features: torch.Tensor | None
        self.register_buffer("token_features", token_features, persistent=False)
        self.register_buffer("position_features", position_features, persistent=False)
        with torch.random.fork_rng(devices=[]):  # the layers' default init draws from the global RNG
            self.token_embedding = nn.Embedding(shape.vocab_size, shape.d_model)
            self.position_embedding = nn.Embedding(shape.max_len, shape.d_model)
            self.token_feature_embedding = self.feature_head = self.position_feature_embedding = None
            if token_features is not None:
                count = int(token_features.max()) + 1
                self.token_feature_embedding = nn.Embedding(count, shape.d_model)
                self.feature_head = nn.Linear(shape.d_model, count)
            if position_features is not None:
                self.position_feature_embedding = nn.Embedding(
                    int(position_features.max()) + 1, shape.d_model
                )
            self.blocks = nn.ModuleList([Block(shape) for _ in range(shape.n_layers)])
            self.norm = nn.LayerNorm(shape.d_model)
            self.head = nn.Linear(shape.d_model, shape.vocab_size)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style initialisation from ``seed``: N(0, 0.02) weights, residual output projections
        scaled down by ``sqrt(2 * n_layers)``, zero biases, unit LayerNorms."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.shape.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.proj", ".out")) else 0.02
                weight = torch.randn(module.weight.shape, generator=generator, dtype=torch.float32) * std
                module.weight.copy_(weight.to(module.weight.dtype))
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.zero_()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Hidden states ``(batch, length, d_model)`` of ``tokens`` ``(batch, length)``.

        :param tokens: token ids.
        :param cache: when given, ``tokens`` continue the cached sequence (the whole prompt on the first
          call, then one token per call) and the cache is extended.
        """
        start = 0 if cache is None else cache.length
        length = tokens.shape[1]
        if start + length > self.shape.max_len:
            raise ValueError(f"sequence of {start + length} tokens exceeds max_len {self.shape.max_len}")
        positions = torch.arange(start, start + length, device=tokens.device)  # (T,)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, C) + (T, C)
        if self.token_feature_embedding is not None and self.token_features is not None:
            # token_features[tokens]: (B, T, F); embedded (B, T, F, C); summed over F: (B, T, C)
            x = x + self.token_feature_embedding(self.token_features[tokens]).sum(dim=-2)
        if self.position_feature_embedding is not None and self.position_features is not None:
            # position_features[positions]: (T, F); embedded (T, F, C); summed over F: (T, C)
            x = x + self.position_feature_embedding(self.position_features[positions]).sum(dim=-2)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer)  # (B, T, C)
        if cache is not None:
            cache.length += length
        return self.norm(x)  # (B, T, C)

    def logits(self, hidden: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Scores of the token ids ``[start, stop)`` (default: to the end of the vocabulary) for ``hidden``
        ``(..., d_model)``: ``(..., stop - start)``, in the head's dtype.

        Scoring only the slice a position can take (a task whose sequences mix vocabularies) saves the
        rest of the head's work; a token's features add their own scores to its own.
        """
        stop = self.shape.vocab_size if stop is None else stop
        weight, bias = self.head.weight[start:stop], self.head.bias[start:stop]  # (V, C), (V,)
        if self.feature_head is not None and self.token_features is not None:
            # folded into the head's rows (a few hundred kB) rather than added to every position's scores
            for column in self.token_features[start:stop].unbind(dim=1):  # (V, F) -> F columns of (V,)
                weight = weight + self.feature_head.weight.index_select(0, column)  # (V, C)
                bias = bias + self.feature_head.bias.index_select(0, column)  # (V,)
        return F.linear(hidden, weight, bias)  # (..., V)

    def new_cache(self, batch: int) -> KVCache:
        """An empty :class:`KVCache` for decoding ``batch`` sequences with this model."""
        parameter = self.head.weight
        return KVCache(batch, self.shape, parameter.device, parameter.dtype)

    def num_parameters(self) -> int:
        return sum(parameter.numel() for parameter in self.parameters())


def _feature_table(rows: tuple[tuple[int, ...], ...], expected: int, what: str) -> torch.Tensor | None:
    """``rows`` as a ``(expected, k)`` int64 tensor of feature ids, or None when there are none."""
    if not rows:
        return None
    if len(rows) != expected or len({len(row) for row in rows}) != 1 or not rows[0]:
        raise ValueError(
            f"{what} features need the same number (>= 1) of feature ids for each of {expected} {what}s"
        )
    table = torch.tensor(rows, dtype=torch.int64, device="cpu")  # (expected, F): small, real even on "meta"
    if int(table.min()) < 0:
        raise ValueError(f"{what} feature ids must be >= 0")
    return table


def pick_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token id per row of ``logits`` ``(B, V)``, as ``(B,)``: the argmax at temperature 0, else a sample.

    :param logits: unnormalised scores.
    :param temperature: divides the logits; 0 means greedy.
    :param top_k: when set, only the ``top_k`` highest-scoring ids of each row can be drawn.
    :param generator: the random source (on the logits' device), for reproducible draws.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, top_k) -> (B, 1): the k-th best
        logits = logits.masked_fill(logits < kth, float("-inf"))
    picked = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
    return picked.squeeze(1)  # (B,)


def adamw_for(params: Iterable[Any], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with ``betas=(0.9, 0.95)``, which keeps small transformers stable at high learning rates.

    The parameter groups are passed through unchanged: hivemind's ``TrainingStateAverager`` calls an
    optimizer factory with its own param-group dicts and requires the optimizer to keep exactly those
    groups. A group's own ``weight_decay`` (see :func:`workers.optim.param_groups`, which exempts biases,
    LayerNorms and embeddings) wins over the argument.

    :param params: parameters, or param-group dicts, as ``torch.optim`` accepts them.
    :param lr: the learning rate.
    :param weight_decay: decoupled weight decay.
    """
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
