"""Tests of the ``tiny-lm`` task: config validation, the corpus, shards, training and sampling."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import assert_spec_needs_neither_torch_nor_numpy
from workers.tasks import TaskConfigError, TaskRuntime, load_task
from workers.tasks.tiny_lm import TASK, TinyLmConfig, corpus
from workers.tasks.tiny_lm.runtime import TinyLmRuntime
from workers.tasks.transformer import CausalTransformer

SMALL_MODEL = {
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 2,
    "seq_len": 64,
    "samples_per_shard": 32,
    "eval_samples": 16,
}


def _train(runtime: TinyLmRuntime, model: CausalTransformer, shards: int, epochs: int = 1) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for epoch in range(epochs):
        for shard in range(shards):
            for batch in runtime.shard_batches(shard % runtime.config.shard_count, batch_size=16, seed=epoch):
                loss = runtime.loss(model, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------------- corpus


def test_fallback_corpus_is_deterministic_and_structured() -> None:
    text = corpus.fallback_corpus(50_000)
    corpus.fallback_corpus.cache_clear()
    assert corpus.fallback_corpus(50_000) == text
    assert len(text) == 50_000
    assert corpus.fallback_corpus(20_000) == text[:20_000]
    sums = re.findall(r"(\d) plus (\d) is (\d+)\.", text)
    assert len(sums) > 100 and all(int(a) + int(b) == int(c) for a, b, c in sums)
    assert text.count("\n") > 100 and "The " in text


def test_splitmix_matches_reference_values() -> None:
    rng = corpus.SplitMix64(1234567)
    # Published SplitMix64 outputs for seed 1234567.
    assert [rng.next() for _ in range(3)] == [6457827717110365317, 3203168211198807973, 9817491932198370423]


# ---------------------------------------------------------------------------------------------- config


def test_make_config_defaults_and_derived_shard_count() -> None:
    config = TASK.make_config({})
    assert config.preset == "tiny" and config.text_path is None
    windows = corpus.train_windows(config.fallback_chars, config.seq_len, config.heldout_fraction)
    assert TASK.num_shards(config) == math.ceil(windows / config.samples_per_shard)
    assert TASK.num_shards(dataclasses.replace(config, num_shards=7)) == 7
    assert load_task("tiny-lm") is TASK
    for config_field in dataclasses.fields(TinyLmConfig):
        assert config_field.default is not dataclasses.MISSING, config_field.name


def test_make_config_reports_a_missing_text_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(TaskConfigError) as raised:
        TASK.make_config({"text_path": str(missing)})
    assert "no such file" in raised.value.problems["text_path"]
    assert str(missing) in str(raised.value)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"d_model": 100, "n_heads": 3}, "d_model"),
        ({"seq_len": 4}, "seq_len"),
        ({"samples_per_shard": 0}, "samples_per_shard"),
        ({"num_shards": -2}, "num_shards"),
        ({"heldout_fraction": 0.0}, "heldout_fraction"),
        ({"fallback_chars": 500}, "fallback_chars"),
        ({"text_sha256": "abc"}, "text_sha256"),
        ({"lr": -1.0}, "lr"),
        ({"text_path": 3}, "text_path"),
    ],
)
def test_make_config_rejects_bad_values(values: dict[str, object], field: str) -> None:
    with pytest.raises(TaskConfigError) as raised:
        TASK.make_config(values)
    assert field in raised.value.problems


def test_make_config_checks_the_text_itself(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    with pytest.raises(TaskConfigError) as raised:
        TASK.make_config({"text_path": str(short)})
    assert "9 characters" in raised.value.problems["text_path"]
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe" * 5000)
    with pytest.raises(TaskConfigError) as raised:
        TASK.make_config({"text_path": str(binary)})
    assert "not UTF-8" in raised.value.problems["text_path"]
    good = tmp_path / "good.txt"
    good.write_text("abc " * 5000, encoding="utf-8")
    with pytest.raises(TaskConfigError) as raised:
        TASK.make_config({"text_path": str(good), "text_sha256": "0" * 64})
    assert "SHA-256" in raised.value.problems["text_sha256"]
    digest = hashlib.sha256(good.read_bytes()).hexdigest()
    assert TASK.make_config({"text_path": str(good), "text_sha256": digest}).text_sha256 == digest


def test_spec_import_needs_neither_torch_nor_numpy() -> None:
    assert_spec_needs_neither_torch_nor_numpy(
        "tiny-lm",
        "config = spec.make_config({'fallback_chars': 100000})\nassert spec.num_shards(config) > 1\n",
    )


# --------------------------------------------------------------------------------------------- runtime


@pytest.fixture(scope="module")
def fallback_runtime() -> TinyLmRuntime:
    runtime = TASK.build_runtime(TASK.make_config({**SMALL_MODEL, "fallback_chars": 60_000}))
    assert isinstance(runtime, TinyLmRuntime)
    return runtime


def test_shards_tile_the_training_text(fallback_runtime: TinyLmRuntime) -> None:
    runtime = fallback_runtime
    config = runtime.config
    assert isinstance(runtime, TaskRuntime)
    text = corpus.fallback_corpus(config.fallback_chars)
    train_chars = len(text) - corpus.heldout_chars(len(text), config.seq_len, config.heldout_fraction)
    covered = []
    for shard in range(config.shard_count):
        windows = runtime.shard_tokens(shard)
        assert windows.shape == (config.samples_per_shard, config.seq_len + 1)
        covered += [runtime.decode(window) for window in windows]
    assert covered[0] == text[: config.seq_len + 1]
    assert covered[1].startswith(covered[0][-1])  # consecutive windows share one character
    distinct = set(covered)
    assert len(distinct) == runtime.windows
    assert all(window in text[:train_chars] for window in list(distinct)[:50])
    beyond = runtime.shard_tokens(config.shard_count)  # past the epoch the text repeats
    last_window = (config.shard_count * config.samples_per_shard) % runtime.windows
    assert runtime.decode(beyond[0]) == covered[last_window]
    with pytest.raises(ValueError):
        runtime.shard_tokens(-1)


def test_shard_batches_are_seeded_shuffles(fallback_runtime: TinyLmRuntime) -> None:
    runtime = fallback_runtime
    batches = list(runtime.shard_batches(1, batch_size=10, seed=0))
    assert [runtime.batch_size_of(b) for b in batches] == [10, 10, 10, 2]
    rows = torch.cat(batches)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, runtime.shard_tokens(1).tolist()))
    assert torch.equal(rows, torch.cat(list(runtime.shard_batches(1, batch_size=10, seed=0))))
    assert not torch.equal(rows, torch.cat(list(runtime.shard_batches(1, batch_size=10, seed=1))))


def test_loss_falls_on_the_fallback_corpus(fallback_runtime: TinyLmRuntime) -> None:
    runtime = fallback_runtime
    model = runtime.build_model()
    before = runtime.evaluate(model)
    assert before["loss"] == pytest.approx(math.log(runtime.vocab_size), abs=0.15)
    losses = _train(runtime, model, shards=6, epochs=4)
    after = runtime.evaluate(model)
    assert losses[-1] < 0.7 * losses[0]
    assert after["loss"] < 0.7 * before["loss"]
    assert after["bits_per_char"] == pytest.approx(after["loss"] / math.log(2))


def test_trains_and_samples_on_a_given_text_file(tmp_path: Path) -> None:
    path = tmp_path / "poem.txt"
    verse = "Row, row, row your boat, gently down the stream; merrily, merrily, life is but a dream. ¿Sí? "
    path.write_text(verse * 200, encoding="utf-8")
    config = TASK.make_config({**SMALL_MODEL, "text_path": str(path)})
    runtime = TinyLmRuntime(config)
    assert "".join(runtime.chars) == "".join(sorted(set(verse)))
    assert runtime.vocab_size == len(set(verse))
    model = runtime.build_model()
    before = runtime.evaluate(model)["loss"]
    _train(runtime, model, shards=config.shard_count, epochs=3)
    after = runtime.evaluate(model)["loss"]
    assert after < 0.5 * before
    text = runtime.sample(model, "Row, row", max_new_chars=150, temperature=0.0)
    assert text.startswith("Row, row") and len(text) == len("Row, row") + 150
    assert "row your boat" in text  # a memorised, repeated text is reproduced greedily
    drawn = runtime.sample(model, "Row", max_new_chars=20, generator=torch.Generator().manual_seed(1))
    assert drawn == runtime.sample(model, "Row", max_new_chars=20, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="not in the training text"):
        runtime.sample(model, "Zebra")


def test_runtime_refuses_a_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_text("hello world " * 2000, encoding="utf-8")
    config = TASK.make_config({"text_path": str(path), "text_sha256": corpus.file_sha256(str(path))})
    path.write_text("goodbye world " * 2000, encoding="utf-8")
    with pytest.raises(ValueError, match="SHA-256"):
        TASK.build_runtime(config)


def test_model_init_is_deterministic(fallback_runtime: TinyLmRuntime) -> None:
    a, b = fallback_runtime.build_model(), fallback_runtime.build_model()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert np.isfinite(fallback_runtime.evaluate(a, max_samples=2)["loss"])
