"""What a training task is: a torch-free description plus a runtime that builds the torch parts.

A task has two halves so that the coordinator can validate a run without importing torch:

* :class:`TaskSpec` (this module, torch-free) names the task, holds its config dataclass and presets,
  and says how many samples a data shard holds. ``volunteer-coordinator runs create`` uses it to check
  a run's task config and to size its shard queue.
* A runtime (any object satisfying :class:`TaskRuntime`, built by :meth:`TaskSpec.build_runtime`) owns
  the model, the data, the loss, the evaluation and, where it makes sense, the sampler. Only the worker,
  the profiler's micro-benchmark and the coordinator's swarm/checkpointer processes build runtimes.

A config is a frozen dataclass whose fields all have defaults. Presets are named override dicts (a
preset that runs on a laptop CPU is expected). ``TaskSpec.make_config`` applies the preset named by
the ``preset`` key first, then the explicit overrides, then the dataclass's own ``validate()``, and
collects every problem into one :class:`TaskConfigError` so that an organizer sees all mistakes at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
"""A SHA-256 as ``sha256sum`` prints it: the name of a content-addressed file."""


class TaskConfigError(ValueError):
    """A run's task config is wrong. ``problems`` maps a field name (or ``"*"``) to what is wrong with it."""

    def __init__(self, task: str, problems: Mapping[str, str]):
        self.task = task
        self.problems = dict(problems)
        listed = "; ".join(f"{name}: {why}" for name, why in self.problems.items())
        super().__init__(f"invalid config for task {task!r}: {listed}")


class UnknownTaskError(LookupError):
    """No task with that name or dotted path could be loaded."""


Batch = Any
"""Whatever a task's data yields for one micro-batch (usually a tuple of tensors); only the task reads it."""


@runtime_checkable
class TaskRuntime(Protocol):
    """The torch half of a task. Built once per process by :meth:`TaskSpec.build_runtime`."""

    config: Any

    def build_model(self) -> Any:
        """A fresh ``torch.nn.Module`` with deterministic initial weights (seeded from ``config.seed``)."""
        ...

    def shard_batches(
        self, shard: int, *, batch_size: int, seed: int, device: Any = "cpu"
    ) -> Iterator[Batch]:
        """Every sample of data shard ``shard`` exactly once, shuffled with ``seed``, in micro-batches.

        The last micro-batch may be smaller. The same ``(shard, seed)`` always gives the same batches, and
        the union over all shards is the run's data set (``spec.num_shards(config)`` shards of
        ``spec.samples_per_shard(config)`` samples each).
        """
        ...

    def example_batch(self, batch_size: int, device: Any = "cpu") -> Batch:
        """A fixed micro-batch of ``batch_size`` real training samples (the same at every call): for fitting
        the micro-batch size, benchmarks, and checking a downloaded state's loss."""
        ...

    def batch_size_of(self, batch: Batch) -> int:
        """How many samples ``batch`` holds (credited work is counted in samples)."""
        ...

    def loss(self, model: Any, batch: Batch) -> Any:
        """The scalar training loss of ``model`` on ``batch`` (a 0-dim tensor that requires grad)."""
        ...

    def evaluate(self, model: Any, *, max_samples: int | None = None) -> dict[str, float]:
        """Held-out metrics, always including ``"loss"``; the task's headline metric is ``spec.metric``."""
        ...


class Showcase(Protocol):
    """What a runtime that can show its model's work adds (both built-in tasks do; it is optional).

    The worker's evaluate command, the coordinator's checkpoint grids and its ``generate`` endpoint call
    these, so every place that shows the model shows the same prompts drawn the same way.
    """

    def showcase_prompts(self) -> list[str]:
        """A fixed handful (about 8) of prompts that show what the model can do, in a fixed order."""
        ...

    def answer_prompts(self, model: Any, prompts: list[str]) -> list[PromptResult]:
        """The model's answer to each prompt, deterministically (greedy decoding or a fixed seed).

        A prompt the task cannot read is answered with ``error`` set, never by raising.
        """
        ...


@dataclass
class PromptResult:
    """The model's answer to one prompt.

    :param prompt: the prompt as given.
    :param kind: ``"image"`` or ``"text"``.
    :param text: the generated text (text tasks).
    :param image: the drawing, an ``(H, W, 3)`` uint8 array (image tasks).
    :param correct: the task's program check of the answer, None where the task has none.
    :param error: why the prompt could not be answered (then ``text`` and ``image`` are None).
    """

    prompt: str
    kind: str
    text: str | None = None
    image: Any = None
    correct: bool | None = None
    error: str | None = None


@dataclass(frozen=True)
class TaskSpec:
    """The torch-free description of a task; one instance per task module, named ``TASK``.

    :param name: the name organizers pass to ``runs create --task``.
    :param summary: one line shown by ``runs create --help`` and the dashboard.
    :param config_cls: a frozen dataclass with a default on every field and an optional
      ``validate(self) -> dict[str, str]`` method returning field -> problem for invalid values.
    :param presets: preset name -> field overrides. ``default_preset`` is applied when none is named.
    :param runtime: ``"module:function"``; the function takes the validated config and returns a
      :class:`TaskRuntime`. It is imported only by :meth:`build_runtime`, so torch is never imported
      by a process that only validates configs.
    :param metric: the name of the headline evaluation metric (a key of ``TaskRuntime.evaluate``).
    :param samples_per_shard_field: the config field that gives the samples in one shard.
    :param num_shards_field: the config field that gives the number of shards in one data epoch.
    :param file_fields: config fields that name a file every peer needs (``text_path``) -> the field that
      holds the file's SHA-256 (``text_sha256``). The path is the organizer's, on the coordinator; a
      volunteer's computer never opens it: it fetches the file by its SHA-256 into the agent's cache, and
      :meth:`bind_files` puts the cached copy's path in the config (docs/security.md).
    """

    name: str
    summary: str
    config_cls: type
    runtime: str
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    default_preset: str | None = None
    metric: str = "loss"
    samples_per_shard_field: str = "samples_per_shard"
    num_shards_field: str = "num_shards"
    file_fields: Mapping[str, str] = field(default_factory=dict)

    def make_config(self, values: Mapping[str, Any] | None = None) -> Any:
        """Build and validate a config from a preset name (``values["preset"]``) and field overrides.

        Raises :class:`TaskConfigError` listing every unknown field, wrongly typed value and invalid value.
        """
        values = dict(values or {})
        problems: dict[str, str] = {}
        preset = values.pop("preset", None)
        merged: dict[str, Any] = {}
        if preset is None:
            preset = self.default_preset
        if preset is not None:
            if preset not in self.presets:
                known = ", ".join(sorted(self.presets)) or "none"
                problems["preset"] = f"unknown preset {preset!r} (known: {known})"
            else:
                merged.update(self.presets[preset])
        merged.update(values)
        fields = {f.name: f for f in dataclasses.fields(self.config_cls)}
        hints = typing.get_type_hints(self.config_cls)
        coerced: dict[str, Any] = {}
        for name, value in merged.items():
            if name not in fields:
                problems[name] = f"unknown field (known: {', '.join(sorted(fields))})"
                continue
            try:
                coerced[name] = _coerce(value, hints[name])
            except (TypeError, ValueError) as exc:
                problems[name] = str(exc)
        if "preset" in fields and preset is not None:
            coerced["preset"] = preset
        if problems:
            raise TaskConfigError(self.name, problems)
        config = self.config_cls(**coerced)
        validate: Callable[[], Mapping[str, str]] | None = getattr(config, "validate", None)
        if validate is not None:
            problems.update(validate() or {})
        if problems:
            raise TaskConfigError(self.name, problems)
        return config

    def file_digests(self, values: Mapping[str, Any]) -> dict[str, str]:
        """File field -> SHA-256 for the file fields that ``values`` (a task config, as sent) sets.

        :raises TaskConfigError: when a set file field has no valid SHA-256 beside it.
        """
        digests: dict[str, str] = {}
        problems: dict[str, str] = {}
        for path_field, digest_field in self.file_fields.items():
            if values.get(path_field) is None:
                continue
            digest = values.get(digest_field)
            if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
                problems[digest_field] = (
                    f"{path_field} names a file, so {digest_field} must hold its SHA-256 (64 lower-case hex "
                    "digits): peers fetch the file by it"
                )
                continue
            digests[path_field] = digest
        if problems:
            raise TaskConfigError(self.name, problems)
        return digests

    def bind_files(self, values: Mapping[str, Any], files: Mapping[str, str]) -> dict[str, Any]:
        """``values`` with each file field's path replaced by the local copy of the file with its SHA-256.

        ``files`` maps SHA-256 -> a local path (the agent's cache, an export's folder). The path that
        ``values`` names is never used, only its digest: a config from the network names files by content.

        :raises TaskConfigError: when a file the config needs is not in ``files``.
        """
        bound = dict(values)
        problems: dict[str, str] = {}
        for path_field, digest in self.file_digests(values).items():
            local = files.get(digest)
            if local is None:
                problems[path_field] = (
                    f"the file with SHA-256 {digest[:16]}… is not here (it was not fetched)"
                )
            else:
                bound[path_field] = local
        if problems:
            raise TaskConfigError(self.name, problems)
        return bound

    def config_to_dict(self, config: Any) -> dict[str, Any]:
        """The JSON-ready form of a config (the inverse of ``make_config`` for a full dict)."""
        return dataclasses.asdict(config)

    def samples_per_shard(self, config: Any) -> int:
        return int(getattr(config, self.samples_per_shard_field))

    def num_shards(self, config: Any) -> int:
        return int(getattr(config, self.num_shards_field))

    def build_runtime(self, config: Any) -> TaskRuntime:
        """Import the torch half of the task and build it for ``config``."""
        module_name, _, attr = self.runtime.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attr)(config)


def _coerce(value: Any, hint: Any) -> Any:
    """Check ``value`` against a simple type hint (int, float, str, bool, Optional, Literal, tuple)."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError(" or ".join(errors))
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return (
            tuple(_coerce(v, item) for v in value) if origin is tuple else [_coerce(v, item) for v in value]
        )
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"must be a string, got {value!r}")
        return value
    return value


LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "inverse_sqrt")
"""The learning-rate schedules a task config may name (``workers.optim.lr_multiplier`` computes them)."""


def schedule_problems(config: Any) -> dict[str, str]:
    """Field -> problem for a config's learning-rate schedule fields (``lr_schedule``, ``warmup_samples``,
    ``decay_samples``, ``min_lr_ratio``); fields a config does not have are not checked."""
    problems: dict[str, str] = {}
    schedule = getattr(config, "lr_schedule", "constant")
    if schedule not in LR_SCHEDULES:
        problems["lr_schedule"] = f"must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}"
    if getattr(config, "warmup_samples", 0) < 0:
        problems["warmup_samples"] = "must be >= 0"
    if getattr(config, "decay_samples", 1) < 1:
        problems["decay_samples"] = "must be at least 1"
    if not 0.0 <= getattr(config, "min_lr_ratio", 0.0) <= 1.0:
        problems["min_lr_ratio"] = "must be between 0 and 1"
    return problems
