"""``tiny-lm``: a character-level causal language model on a text the organizer gives.

It is the second built-in task, small on purpose: it shows that the task interface is not tied to
``shapes-dalle``. The organizer points ``text_path`` at a UTF-8 file on the coordinator's server
(``runs create --config text_path=...``); the coordinator keeps a copy named by its SHA-256 (recorded in
``text_sha256``) and serves it, and each volunteer's agent fetches it into its own cache and checks it
(``TASK.file_fields``): a volunteer's computer never opens the path a run names. Without a file, a
deterministic generated corpus is used (``corpus.py``), so a run can be tried with nothing to
distribute.

The data
    The last ``heldout_fraction`` of the characters are held out. The rest is cut into windows of
    ``seq_len + 1`` characters with stride ``seq_len``; shard ``s`` holds windows
    ``s * samples_per_shard`` to ``(s + 1) * samples_per_shard - 1``, wrapping around to the start of
    the text when it runs out (so every shard is full). With ``num_shards = 0`` (the default) the
    number of shards is derived from the text: the fewest shards that cover every window once, exposed
    as ``config.shard_count`` (the field ``TASK`` reports as the number of shards).

The model and the metrics
    The shared decoder-only transformer (``workers.tasks.transformer``) over the text's
    characters (the vocabulary is the sorted set of characters in the text, so its size depends on the
    text). ``evaluate`` reports the held-out ``loss`` (nats per character, the headline metric) and
    ``bits_per_char``. ``runtime.TinyLmRuntime.sample`` continues a prompt.

This module imports neither torch nor numpy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from workers.tasks.base import SHA256_HEX, TaskSpec, schedule_problems
from workers.tasks.tiny_lm import corpus

__all__ = ["TASK", "TinyLmConfig"]


@dataclass(frozen=True)
class TinyLmConfig:
    """Everything that defines a ``tiny-lm`` run. Every volunteer must use the same values."""

    # The preset these values started from; TaskSpec.make_config records it. Informational only.
    preset: str = "tiny"
    # A UTF-8 text file to learn, on the coordinator's server (volunteers fetch the coordinator's copy by
    # its SHA-256). None trains on the generated fallback corpus (no file needed). A few MB suits the tiny
    # preset.
    text_path: str | None = None
    # The hex SHA-256 of text_path's file (`sha256sum FILE`); the coordinator fills it in when a run is
    # created. Every copy is checked against it, so every peer trains on the same text.
    text_sha256: str | None = None
    # Length in characters of the generated corpus used when text_path is None (at least 10,000).
    fallback_chars: int = 1_000_000
    # Fraction of the text (at its end) held out for evaluation; at least one window is always kept.
    heldout_fraction: float = 0.05
    # Characters of context per sample. Longer sees more structure but costs ~quadratically more.
    seq_len: int = 128
    # Windows per shard, the unit of volunteer work (64 windows of 128 characters is ~1 s of work for
    # the tiny preset on one CPU core).
    samples_per_shard: int = 64
    # Shards per data epoch. 0 derives it from the text (every window once per epoch); a larger number
    # repeats the text within an epoch, a smaller one uses only its beginning.
    num_shards: int = 0
    # Seeds the initial weights (the text and its split do not depend on it).
    seed: int = 0
    # Transformer width; must be a multiple of n_heads.
    d_model: int = 128
    # Transformer blocks.
    n_layers: int = 4
    # Attention heads per block.
    n_heads: int = 4
    # MLP hidden width as a multiple of d_model.
    mlp_ratio: int = 4
    # Dropout on attention and residual branches; worth 0.1 on a small text that repeats many times.
    dropout: float = 0.0
    # Peak learning rate of the collaborative AdamW optimizer, reached after the warmup.
    lr: float = 1e-3
    # The schedule after the warmup, on the samples the whole swarm has trained: "constant", "cosine"
    # (to min_lr_ratio over decay_samples) or "inverse_sqrt" (lr / sqrt(1 + t / decay_samples)).
    lr_schedule: str = "constant"
    # Samples over which the rate rises linearly to lr.
    warmup_samples: int = 0
    # cosine: samples after the warmup until the floor; inverse_sqrt: the decay's time scale.
    decay_samples: int = 100_000
    # The floor of the decay, as a fraction of lr.
    min_lr_ratio: float = 0.1
    # Samples per optimizer step of one peer when the run's update mode is local or diloco (each peer steps
    # on its own; with gradient averaging a step is the run's target batch). The learning rate was tuned
    # at 32: one process with AdamW at lr 1e-3 and 32 samples per step is the baseline the swarm must match.
    local_batch_size: int = 32
    # AdamW weight decay of the weight matrices (biases, LayerNorms and embeddings take none).
    weight_decay: float = 0.01
    # Held-out windows evaluated for "loss" (fewer if the held-out part is shorter).
    eval_samples: int = 256

    @property
    def shard_count(self) -> int:
        """Shards in one data epoch: ``num_shards``, or when it is 0 the fewest that cover every window.

        Deriving it reads (or generates) the text, so it is only computed when asked for.
        """
        if self.num_shards > 0:
            return self.num_shards
        text = corpus.load_corpus(self.text_path, self.fallback_chars)
        windows = corpus.train_windows(len(text), self.seq_len, self.heldout_fraction)
        return max(1, math.ceil(windows / self.samples_per_shard))

    def validate(self) -> dict[str, str]:
        """Field -> problem for every invalid value, including a missing, unreadable or too short text."""
        problems: dict[str, str] = {}
        for name in ("samples_per_shard", "d_model", "n_layers", "n_heads", "mlp_ratio", "eval_samples"):
            if getattr(self, name) < 1:
                problems[name] = "must be at least 1"
        if self.num_shards < 0:
            problems["num_shards"] = "must be >= 0 (0 derives it from the text)"
        if self.seed < 0:
            problems["seed"] = "must be >= 0"
        if not 8 <= self.seq_len <= 4096:
            problems["seq_len"] = "must be between 8 and 4096"
        if not 0.0 < self.heldout_fraction <= 0.5:
            problems["heldout_fraction"] = "must be in (0, 0.5]"
        if self.d_model >= 1 and self.n_heads >= 1 and self.d_model % self.n_heads:
            problems["d_model"] = f"must be a multiple of n_heads ({self.n_heads})"
        if not 0.0 <= self.dropout < 1.0:
            problems["dropout"] = "must be in [0, 1)"
        if not self.lr > 0:
            problems["lr"] = "must be > 0"
        if self.weight_decay < 0:
            problems["weight_decay"] = "must be >= 0"
        if self.local_batch_size < 1:
            problems["local_batch_size"] = "must be at least 1"
        problems.update(schedule_problems(self))
        if self.text_sha256 is not None and not SHA256_HEX.fullmatch(self.text_sha256):
            problems["text_sha256"] = "must be 64 lower-case hex digits (the output of sha256sum)"
        if self.text_path is None:
            if self.text_sha256 is not None:
                problems["text_sha256"] = "only applies with a text_path"
            if self.fallback_chars < 10_000:
                problems["fallback_chars"] = "must be at least 10000"
            elif "seq_len" not in problems and "heldout_fraction" not in problems:
                self._check_length(self.fallback_chars, "fallback_chars", problems)
            return problems
        problems.update(self._check_file(self.text_path))
        return problems

    def _check_file(self, path: str) -> dict[str, str]:
        if not os.path.isfile(path):
            return {
                "text_path": f"no such file: {path!r} (on the coordinator's server; volunteers fetch its copy)"
            }
        try:
            text = corpus.read_text(path)
        except UnicodeDecodeError as exc:
            return {"text_path": f"{path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})"}
        except OSError as exc:
            return {"text_path": f"cannot read {path!r}: {exc.strerror}"}
        problems: dict[str, str] = {}
        if 8 <= self.seq_len <= 4096 and 0.0 < self.heldout_fraction <= 0.5:
            self._check_length(len(text), "text_path", problems)
        if self.text_sha256 is not None and "text_sha256" not in problems:
            actual = corpus.file_sha256(path)
            if actual != self.text_sha256:
                problems["text_sha256"] = f"{path!r} has SHA-256 {actual}, not the configured one"
        return problems

    def _check_length(self, total: int, field_name: str, problems: dict[str, str]) -> None:
        needed = self.seq_len + 1 + corpus.heldout_chars(total, self.seq_len, self.heldout_fraction)
        if corpus.train_windows(total, self.seq_len, self.heldout_fraction) < 1:
            problems[field_name] = (
                f"the text has {total} characters; seq_len {self.seq_len} needs at least {needed} "
                "(one training window and one held-out window)"
            )


TASK = TaskSpec(
    name="tiny-lm",
    summary="A character-level language model on the organizer's UTF-8 text (or a generated one).",
    config_cls=TinyLmConfig,
    runtime="workers.tasks.tiny_lm.runtime:build_runtime",
    presets={
        # 0.82M parameters; 93 samples (128-character windows) per second on one CPU core.
        "tiny": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128, "lr": 1e-3},
        # 6.41M parameters and 256 characters of context, for GPUs and texts of tens of MB (6 samples/s
        # on one CPU core).
        "base": {"d_model": 256, "n_layers": 8, "n_heads": 8, "seq_len": 256, "lr": 5e-4},
    },
    default_preset="tiny",
    metric="loss",
    num_shards_field="shard_count",
    file_fields={"text_path": "text_sha256"},
)
