"""``shapes-dalle``: the flagship task, a small DALL-E-like transformer that draws what a caption asks for.

What the volunteers train
    One decoder-only causal transformer reads a caption such as "a small red circle at the top left
    and a big square in blue at the bottom" and then writes a 32x32 picture of it, patch token by patch
    token, like the original DALL-E: the sequence is ``[<bos>, caption words..., <pad>..., image
    tokens...]`` and the loss is the cross-entropy of each image token given everything before it
    (optionally plus a small weight on predicting the caption's words).

The data (``data.py``)
    Synthetic, unlimited and reproducible: sample ``i`` of shard ``s`` is a scene of one or two shapes
    (circle, square, triangle, diamond) in eight named colours, two sizes and nine grid positions,
    drawn from a generator seeded with ``(seed, s, i)``, rendered on a plain background and described by
    a randomly phrased caption. Nothing is downloaded; every volunteer builds identical shards.

The tokenizers (``tokenizers.py``)
    Captions are word-level (a fixed vocabulary of 44 words and 3 special tokens, 32 tokens per caption). Images are
    cut into 4x4 patches, 64 per image; a patch's token is (palette colour, footprint mask from a fixed
    codebook), so tokens decode to pixels exactly and the codebook needs no training.

How it is judged (``checker.py``)
    The headline metric ``prompt_accuracy`` samples pictures for a fixed set of held-out captions and
    checks each with a hand-written judge: for every object in the caption, is there a blob of that
    colour, in that cell, of that size, best matching that shape's template, and nothing else? It is
    the fraction of pictures that are entirely right, which a person can confirm by looking at them.

The torch half (``runtime.py``)
    :func:`runtime.build_runtime` returns the :class:`~workers.tasks.base.TaskRuntime`: model, shards,
    loss, evaluation and a KV-cached sampler. This module imports neither torch nor numpy, so the
    coordinator can validate configs in a light web process.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.tasks.base import TaskSpec, schedule_problems

__all__ = ["SHOWCASE_PROMPTS", "TASK", "ShapesDalleConfig"]

SHOWCASE_PROMPTS: tuple[str, ...] = (
    "a big red circle in the center",
    "a small blue square at the top left",
    "a large green triangle in the bottom right corner",
    "a big yellow diamond on the left",
    "a small white circle at the top and a large orange square at the bottom",
    "a big purple triangle at the top right and a small cyan diamond at the bottom left",
    "a little green square on the right",
    "a large blue circle at the bottom and a small red triangle in the upper left corner",
)
"""Fixed captions the demo, the volunteer's model view and the checkpoint grids draw: every colour but
one, every shape at both sizes, one and two objects, and several phrasings."""

_MAX_SEQUENCE = 1024
"""The longest token sequence (caption plus image) a config may ask for; beyond it attention cost explodes."""


@dataclass(frozen=True)
class ShapesDalleConfig:
    """Everything that defines a ``shapes-dalle`` run. Every volunteer must use the same values."""

    # The preset these values started from; TaskSpec.make_config records it. Informational only.
    preset: str = "tiny"
    # Seeds the initial weights, every data draw and the held-out set. A new seed is a new run.
    seed: int = 0
    # Shards in one data epoch. Data is generated, so any number works; 4096 x 256 is ~1M samples,
    # more than a tiny model needs to converge, so an epoch is rarely finished.
    num_shards: int = 4096
    # Samples per shard, the unit of volunteer work. 256 is ~2.5 s for `tiny` on one CPU core and a
    # fraction of a second on a GPU; raise it for GPU-heavy swarms so that coordination stays cheap.
    samples_per_shard: int = 256
    # Objects per scene: 2 mixes one- and two-object scenes (30% / 70%); 1 is an easier task, for
    # demos and warm-ups (captions are then at most 15 words and images hold a single shape).
    max_objects: int = 2
    # Image side in pixels (24 to 128, a multiple of patch_size). Image tokens per sample are
    # (image_size / patch_size) ** 2, so cost grows with the square; 32 is the designed size.
    image_size: int = 32
    # Patch side in pixels, 2 or 4. 4 gives 64 image tokens at 32 px and, with the default codebook,
    # keeps every shape recognisable; 2 is lossless with 14 masks but makes sequences 4x longer.
    patch_size: int = 4
    # Footprint masks in the image codebook, the empty patch included. At 32 px with 4 px patches, 179
    # footprints occur; 128 keeps every shape recognisable after encoding (the 51 rarest are replaced by
    # their nearest mask), while 64 turns 13% of small shapes into the wrong shape. The image
    # vocabulary is 1 + 8 * (codebook_size - 1): 1017 tokens at 128.
    codebook_size: int = 128
    # Give image tokens and positions shared features: a patch token's embedding and score are its own plus
    # those of its colour and its footprint, an image position's its own plus its row's and column's, so
    # what the model learns about "red" or "the top row" serves every token or position that has it. One
    # process, mini, lr 2e-3 decayed over 60k samples (tests/perf/bench_learning.py single): held-out loss
    # 0.53 / 0.16 / 0.08 at 10k / 30k / 50k samples with them, 1.22 / 0.41 / 0.22 without; prompt
    # accuracy at 50k 0.58 with them, 0.16 without; 2% more parameters. Set it false only to load a
    # run created before it existed (its checkpoints hold no feature weights).
    factored_tokens: bool = True
    # Transformer width. Must be a multiple of n_heads. Cost grows with its square.
    d_model: int = 128
    # Transformer blocks; cost grows linearly with them.
    n_layers: int = 4
    # Attention heads per block; d_model / n_heads of 32 or 64 is a good head width.
    n_heads: int = 4
    # MLP hidden width as a multiple of d_model (4 is the GPT default).
    mlp_ratio: int = 4
    # Dropout on attention and residual branches. Data never repeats within an epoch: keep it 0.
    dropout: float = 0.0
    # Weight of next-word prediction on the caption, added to the image loss (DALL-E used 1/8). It can
    # help the model read; 0 trains on image tokens only, which is what prompt_accuracy rewards.
    text_loss_weight: float = 0.0
    # Peak learning rate of each peer's AdamW (betas 0.9, 0.95), reached after the warmup. 1e-3 took `tiny`
    # to ~90% prompt_accuracy at 32 samples per step; 3e-4 to 6e-4 is safer for `base`.
    lr: float = 1e-3
    # The schedule after the warmup, on the samples the whole swarm has trained (hivemind steps it on the
    # global epoch, so every peer uses the same rate): "constant", "cosine" (to min_lr_ratio over
    # decay_samples, then flat) or "inverse_sqrt" (lr / sqrt(1 + t / decay_samples), for open-ended runs).
    lr_schedule: str = "cosine"
    # Samples over which the rate rises linearly to lr. Adam's first steps are its largest; a short warmup
    # keeps them from wrecking the random initialisation.
    warmup_samples: int = 1024
    # cosine: samples after the warmup until the floor (set it to the run's planned length; `tiny` has
    # learned most of what it can by 150k samples); inverse_sqrt: the decay's time scale.
    decay_samples: int = 150_000
    # The floor of the decay, as a fraction of lr.
    min_lr_ratio: float = 0.1
    # Samples per optimizer step of one peer when the run's update mode is local or diloco (each peer steps
    # on its own; with gradient averaging a step is the run's target batch). The learning rate was tuned
    # at 32: one process with AdamW at lr 1e-3 and 32 samples per step is the baseline the swarm must match.
    local_batch_size: int = 32
    # AdamW weight decay of the weight matrices; biases, LayerNorms and embeddings take none
    # (workers.optim.param_groups). Small models on unlimited data need little; 0.01 is a safe default.
    weight_decay: float = 0.01
    # Held-out samples whose image-token cross-entropy is reported as "loss". More is steadier and slower.
    eval_samples: int = 512
    # Held-out captions drawn (token by token, with a KV cache) and judged for "prompt_accuracy".
    # 64 take under a second on one core for `tiny`; the metric's standard error is up to 6 points at 64.
    eval_prompts: int = 64
    # Sampling temperature for evaluation; 0 (the default) is greedy decoding: deterministic, and it shows
    # what the model can draw. 1 samples the model's own distribution (varied placement, more stray
    # patches). After ~97k training samples the tiny preset scored 89% greedy and 68% at temperature 1.
    eval_temperature: float = 0.0
    # Keep only the k most likely image tokens when sampling for evaluation (None: all of them).
    eval_top_k: int | None = None

    def validate(self) -> dict[str, str]:
        """Field -> problem for every invalid value (empty when the config is usable)."""
        problems: dict[str, str] = {}
        for name in ("num_shards", "samples_per_shard", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                problems[name] = "must be at least 1"
        for name in ("eval_samples", "eval_prompts"):
            if getattr(self, name) < 1:
                problems[name] = "must be at least 1 (evaluate always reports it)"
        if self.seed < 0:
            problems["seed"] = "must be >= 0"
        if self.max_objects not in (1, 2):
            problems["max_objects"] = "must be 1 or 2"
        if self.patch_size not in (2, 4):
            problems["patch_size"] = "must be 2 or 4 (8-pixel patches cannot draw small shapes)"
        if not 24 <= self.image_size <= 128:
            problems["image_size"] = "must be between 24 and 128 pixels"
        elif self.patch_size in (2, 4) and self.image_size % self.patch_size:
            problems["image_size"] = f"must be a multiple of patch_size ({self.patch_size})"
        elif self.patch_size in (2, 4):
            sequence = 32 + (self.image_size // self.patch_size) ** 2
            if sequence > _MAX_SEQUENCE:
                problems["image_size"] = (
                    f"gives {sequence} tokens per sample (over {_MAX_SEQUENCE}); use a larger patch_size"
                )
        if not 2 <= self.codebook_size <= 1024:
            problems["codebook_size"] = "must be between 2 and 1024"
        if self.d_model >= 1 and self.n_heads >= 1 and self.d_model % self.n_heads:
            problems["d_model"] = f"must be a multiple of n_heads ({self.n_heads})"
        if not 0.0 <= self.dropout < 1.0:
            problems["dropout"] = "must be in [0, 1)"
        if self.text_loss_weight < 0:
            problems["text_loss_weight"] = "must be >= 0"
        if not self.lr > 0:
            problems["lr"] = "must be > 0"
        if self.weight_decay < 0:
            problems["weight_decay"] = "must be >= 0"
        if self.local_batch_size < 1:
            problems["local_batch_size"] = "must be at least 1"
        problems.update(schedule_problems(self))
        if self.eval_temperature < 0:
            problems["eval_temperature"] = "must be >= 0 (0 is greedy decoding)"
        if self.eval_top_k is not None and self.eval_top_k < 1:
            problems["eval_top_k"] = "must be at least 1, or null for no limit"
        return problems


TASK = TaskSpec(
    name="shapes-dalle",
    summary="A small DALL-E: a transformer that draws coloured shapes from captions (synthetic data, 32x32).",
    config_cls=ShapesDalleConfig,
    runtime="workers.tasks.shapes_dalle.runtime:build_runtime",
    presets={
        # 1.08M parameters. Measured: 112 samples/s on ONE CPU core (torch.set_num_threads(1), forward +
        # backward + AdamW step, micro-batch 32; tests/perf/bench_task_speed.py). Reaches ~90%
        # prompt_accuracy (greedy) after ~100k samples, i.e. ~15 core-minutes.
        "tiny": {"d_model": 128, "n_layers": 4, "n_heads": 4, "mlp_ratio": 4, "lr": 1e-3},
        # 0.36M parameters, ~2x tiny's samples per second on a CPU core: the demo's model. lr 2e-3, a local step
        # every 16 samples: what else was tried, and what each learnt, is in docs/learning-per-sample.md.
        "mini": {
            "d_model": 64,
            "n_layers": 4,
            "n_heads": 2,
            "mlp_ratio": 4,
            "lr": 2e-3,
            "local_batch_size": 16,
        },
        # 6.89M parameters, for GPUs and patient CPUs: 20 samples/s on one CPU core.
        "base": {"d_model": 256, "n_layers": 8, "n_heads": 8, "mlp_ratio": 4, "lr": 5e-4},
    },
    default_preset="tiny",
    metric="prompt_accuracy",
)
