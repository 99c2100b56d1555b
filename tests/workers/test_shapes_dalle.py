"""Tests of the ``shapes-dalle`` task: data, tokenizers, checker, config and the torch runtime."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from tests.conftest import assert_spec_needs_neither_torch_nor_numpy
from volunteer_app.pictures import read_png
from workers.tasks import TaskConfigError, TaskRuntime, load_task
from workers.tasks.shapes_dalle import TASK, ShapesDalleConfig, checker, data
from workers.tasks.shapes_dalle.runtime import ShapesDalleRuntime
from workers.tasks.shapes_dalle.tokenizers import TEXT_LEN, ImageTokenizer, TextTokenizer

SMALL_MODEL = {
    "lr": 3e-3,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 2,
    "samples_per_shard": 64,
    "eval_samples": 64,
    "eval_prompts": 8,
}


def _examples(count: int, shards: int = 4) -> list[tuple[data.Scene, str]]:
    per_shard = count // shards
    return [data.example_for(shard, index, 0) for shard in range(shards) for index in range(per_shard)]


# ------------------------------------------------------------------------------------------------ data


def test_parse_prompt_recovers_every_generated_scene() -> None:
    for scene, text in _examples(3000):
        assert data.parse_prompt(text) == scene, text


def test_captions_use_every_phrasing() -> None:
    captions = [text for _, text in _examples(1000)]
    for marker in (
        ": ",
        "; ",
        " and ",
        ", ",
        "there is",
        "corner",
        " in ",
        "upper",
        "lower",
        "big",
        "tiny",
        "disc",
    ):
        assert any(marker in text for text in captions), f"no caption contains {marker!r}"
    objects_first = [text for text in captions if text.startswith(("a ", "an "))]
    positions_first = [text for text in captions if text.startswith(("at ", "in ", "on "))]
    assert objects_first and positions_first


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a small red circle at the top left", [("circle", "red", "small", "top left")]),
        (
            "top left: big blue square; bottom: tiny yellow triangle",
            [("square", "blue", "large", "top left"), ("triangle", "yellow", "small", "bottom")],
        ),
        ("in the middle there is a little diamond in white", [("diamond", "white", "small", "center")]),
        ("an orange disc on the right side and a large green square in the lower left corner", None),
        (
            "There is a LARGE purple triangle at the upper right, a small cyan circle on the left",
            [("triangle", "purple", "large", "top right"), ("circle", "cyan", "small", "left")],
        ),
    ],
)
def test_parse_prompt_reads_hand_written_prompts(
    text: str, expected: list[tuple[str, str, str, str]] | None
) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="size"):
            data.parse_prompt(text)  # the disc has no size
        return
    objects = tuple(data.SceneObject(*attributes) for attributes in expected)
    assert data.parse_prompt(text) == data.Scene(objects)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a red circle at the top",
        "a small red blue circle at the top",
        "a small red circle",
        "a small red circle at the top and a big blue square at the top",
    ],
)
def test_parse_prompt_rejects_incomplete_prompts(text: str) -> None:
    with pytest.raises(ValueError):
        data.parse_prompt(text)


def test_shards_are_deterministic_and_distinct() -> None:
    first = [data.example_for(7, index, 3) for index in range(50)]
    again = [data.example_for(7, index, 3) for index in range(50)]
    assert first == again
    assert all(
        np.array_equal(data.render(a), data.render(b)) for (a, _), (b, _) in zip(first, again, strict=True)
    )
    other_shard = [data.example_for(8, index, 3) for index in range(50)]
    other_seed = [data.example_for(7, index, 4) for index in range(50)]
    assert sum(a == b for a, b in zip(first, other_shard, strict=True)) < 5
    assert sum(a == b for a, b in zip(first, other_seed, strict=True)) < 5


def test_heldout_prompts_are_fixed_and_not_training_draws() -> None:
    heldout = data.heldout_examples(100, 0)
    assert data.heldout_prompts(40, 0) == [text for _, text in heldout[:40]]
    training = {text for shard in range(3) for _, text in (data.example_for(shard, i, 0) for i in range(100))}
    assert sum(text in training for _, text in heldout) < 5


def test_render_draws_non_overlapping_objects_in_their_cells() -> None:
    geometry = data.layout(32)
    for scene, _ in _examples(400):
        image = data.render(scene)
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        drawn = (image != data.BACKGROUND).any(axis=-1)
        expected = sum(
            int(data.shape_mask(obj.shape, geometry.size_px(obj.size)).sum()) for obj in scene.objects
        )
        assert drawn.sum() == expected  # objects never overlap and never leave the image
        for obj in scene.objects:
            top, left, side = geometry.box(obj)
            lo_y, lo_x = geometry.cell_start(obj.row), geometry.cell_start(obj.col)
            assert lo_y <= top and top + side <= lo_y + geometry.cell
            assert lo_x <= left and left + side <= lo_x + geometry.cell


def test_png_writer_round_trips_pixels() -> None:
    image = data.render(data.example_for(0, 1, 0)[0])
    png = data.image_to_png_bytes(image, scale=3)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    picture = read_png(png)
    assert (picture.width, picture.height) == (96, 96)
    pixels = np.frombuffer(picture.rgb, dtype=np.uint8).reshape(96, 96, 3)
    assert np.array_equal(pixels[::3, ::3], image) and np.array_equal(pixels[2::3, 2::3], image)
    with pytest.raises(ValueError, match="uint8"):
        data.image_to_png_bytes(image.astype(np.float32))


# ------------------------------------------------------------------------------------------ tokenizers


def test_text_tokenizer_round_trips_generated_captions() -> None:
    tokenizer = TextTokenizer()
    for _, text in _examples(2000):
        ids = tokenizer.encode(text)
        assert ids.shape == (TEXT_LEN,) and ids[0] == tokenizer.bos_id
        assert tokenizer.unk_id not in ids
        assert ids[-1] == tokenizer.pad_id  # the longest caption still fits
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("a zebra")[2] == tokenizer.unk_id


def test_image_tokenizer_encode_inverts_decode_on_random_tokens() -> None:
    rng = np.random.default_rng(0)
    for image_size, patch_size in ((32, 4), (32, 2), (48, 4)):
        tokenizer = ImageTokenizer(image_size, patch_size, 128)
        tokens = rng.integers(0, tokenizer.vocab_size, size=(64, tokenizer.tokens_per_image))
        images = tokenizer.decode(tokens)
        assert images.shape == (64, image_size, image_size, 3)
        assert np.array_equal(tokenizer.encode(images), tokens)


def test_image_tokenizer_keeps_shapes_recognisable() -> None:
    tokenizer = ImageTokenizer(32, 4, 128)
    assert tokenizer.tokens_per_image == 64
    examples = _examples(400)
    images = np.stack([data.render(scene) for scene, _ in examples])
    decoded = tokenizer.decode(tokenizer.encode(images))
    assert all(check.ok for check in checker.check_images(decoded, [scene for scene, _ in examples]))


def test_image_codebook_is_deterministic_and_starts_empty() -> None:
    a, b = ImageTokenizer(32, 4, 128), ImageTokenizer(32, 4, 128)
    assert np.array_equal(a.codebook, b.codebook)
    assert not a.codebook[0].any() and a.codebook[1:].any(axis=1).all()
    assert len({row.tobytes() for row in a.codebook}) == len(a.codebook)


# --------------------------------------------------------------------------------------------- checker


def _variants(obj: data.SceneObject) -> dict[str, data.SceneObject]:
    other_colour = data.COLOUR_NAMES[(data.COLOUR_NAMES.index(obj.colour) + 1) % len(data.COLOUR_NAMES)]
    other_shape = data.SHAPES[(data.SHAPES.index(obj.shape) + 1) % len(data.SHAPES)]
    other_size = "large" if obj.size == "small" else "small"
    other_position = data.POSITIONS[(obj.cell + 4) % 9]
    return {
        "colour": dataclasses.replace(obj, colour=other_colour),
        "shape": dataclasses.replace(obj, shape=other_shape),
        "size": dataclasses.replace(obj, size=other_size),
        "position": dataclasses.replace(obj, position=other_position),
    }


def test_checker_accepts_right_and_rejects_wrong_prompts() -> None:
    rejected = dict.fromkeys(("colour", "shape", "size", "position"), 0)
    tried = 0
    for scene, text in _examples(300):
        image = data.render(scene)
        verdict = checker.check_image(image, text)
        assert verdict.ok and verdict.score == 1.0 and verdict.extra_blobs == 0, text
        target = scene.objects[0]
        others = [obj.cell for obj in scene.objects[1:]]
        for what, wrong in _variants(target).items():
            if wrong.cell in others:
                continue
            tried += 1
            wrong_scene = data.Scene((wrong, *scene.objects[1:]))
            verdict = checker.check_image(image, wrong_scene)
            assert not verdict.ok, (what, text)
            assert not verdict.objects[wrong_scene.objects.index(wrong)].ok
            rejected[what] += 1
    assert tried > 1000 and all(count > 200 for count in rejected.values())


def test_checker_rejects_missing_and_extra_objects() -> None:
    two = [scene for scene, _ in _examples(200) if len(scene.objects) == 2]
    for scene in two[:50]:
        image = data.render(scene)
        only_first = data.Scene(scene.objects[:1])
        verdict = checker.check_image(image, only_first)
        assert verdict.objects[0].ok and verdict.extra_blobs == 1 and not verdict.ok
        verdict = checker.check_image(data.render(only_first), scene)
        assert not verdict.ok and verdict.score == 0.5
    blank = np.zeros((32, 32, 3), dtype=np.uint8) + np.array(data.BACKGROUND, dtype=np.uint8)
    assert checker.prompt_accuracy([blank], [two[0]]) == 0.0
    assert checker.object_accuracy([data.render(two[0])], [two[0]]) == 1.0


def test_checker_tells_all_shapes_apart_at_both_sizes() -> None:
    geometry = data.layout(32)
    for shape, size in itertools.product(data.SHAPES, data.SIZES):
        found, _ = checker.classify_shape(data.shape_mask(shape, geometry.size_px(size)).copy())
        assert found == shape


# ---------------------------------------------------------------------------------------------- config


def test_make_config_applies_presets_and_records_them() -> None:
    tiny = TASK.make_config({})
    assert tiny.preset == "tiny" and tiny.d_model == 128
    base = TASK.make_config({"preset": "base", "seed": 5})
    assert base.preset == "base" and base.d_model == 256 and base.seed == 5
    assert load_task("shapes-dalle") is TASK
    for config_field in dataclasses.fields(ShapesDalleConfig):
        assert config_field.default is not dataclasses.MISSING, config_field.name


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"d_model": 130, "n_heads": 4}, "d_model"),
        ({"samples_per_shard": 0}, "samples_per_shard"),
        ({"num_shards": -1}, "num_shards"),
        ({"image_size": 30}, "image_size"),
        ({"patch_size": 3}, "patch_size"),
        ({"max_objects": 3}, "max_objects"),
        ({"lr": 0.0}, "lr"),
        ({"dropout": 1.0}, "dropout"),
        ({"eval_top_k": 0}, "eval_top_k"),
        ({"seed": -1}, "seed"),
        ({"n_layers": "four"}, "n_layers"),
        ({"colour_count": 3}, "colour_count"),
        ({"preset": "huge"}, "preset"),
    ],
)
def test_make_config_rejects_bad_values(values: dict[str, object], field: str) -> None:
    with pytest.raises(TaskConfigError) as raised:
        TASK.make_config(values)
    assert field in raised.value.problems


def test_make_config_reports_every_problem_at_once() -> None:
    with pytest.raises(TaskConfigError) as raised:
        TASK.make_config({"d_model": 0, "lr": -1.0, "eval_prompts": 0})
    assert {"d_model", "lr", "eval_prompts"} <= raised.value.problems.keys()


def test_spec_import_needs_neither_torch_nor_numpy() -> None:
    assert_spec_needs_neither_torch_nor_numpy(
        "shapes-dalle",
        "config = spec.make_config({'preset': 'base'})\n"
        "assert spec.num_shards(config) == 4096 and spec.samples_per_shard(config) == 256\n",
    )


# --------------------------------------------------------------------------------------------- runtime


@pytest.fixture(scope="module")
def small_runtime() -> ShapesDalleRuntime:
    config = TASK.make_config({**SMALL_MODEL, "max_objects": 1})
    runtime = TASK.build_runtime(config)
    assert isinstance(runtime, ShapesDalleRuntime)
    return runtime


def test_runtime_satisfies_the_protocol(small_runtime: ShapesDalleRuntime) -> None:
    assert isinstance(small_runtime, TaskRuntime)
    batch = small_runtime.example_batch(5)
    assert small_runtime.batch_size_of(batch) == 5
    assert batch.shape == (5, TEXT_LEN + 64) and batch.dtype == torch.long


def test_shard_batches_cover_the_shard_once_in_a_seeded_order(small_runtime: ShapesDalleRuntime) -> None:
    batches = list(small_runtime.shard_batches(2, batch_size=24, seed=1))
    assert [len(b) for b in batches] == [24, 24, 16]
    rows = torch.cat(batches)
    shard = torch.from_numpy(np.array(small_runtime.shard_tokens(2)))
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, shard.tolist()))
    assert torch.equal(rows, torch.cat(list(small_runtime.shard_batches(2, batch_size=24, seed=1))))
    assert not torch.equal(rows, torch.cat(list(small_runtime.shard_batches(2, batch_size=24, seed=2))))
    fresh = ShapesDalleRuntime(small_runtime.config)
    assert np.array_equal(fresh.shard_tokens(2), small_runtime.shard_tokens(2))
    assert not np.array_equal(fresh.shard_tokens(3), small_runtime.shard_tokens(2))
    with pytest.raises(ValueError):
        small_runtime.shard_tokens(-1)


def test_model_init_is_deterministic_and_leaves_global_rng_alone(small_runtime: ShapesDalleRuntime) -> None:
    state = torch.random.get_rng_state()
    a, b = small_runtime.build_model(), small_runtime.build_model()
    assert torch.equal(state, torch.random.get_rng_state())
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    other = TASK.build_runtime(dataclasses.replace(small_runtime.config, seed=1)).build_model()
    assert not torch.equal(a.head.weight, other.head.weight)


def test_kv_cached_decoding_matches_a_full_forward(small_runtime: ShapesDalleRuntime) -> None:
    model = small_runtime.build_model().eval()
    tokens = small_runtime.example_batch(3)
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(3)
        steps = [model(tokens[:, :TEXT_LEN], cache)]
        steps += [model(tokens[:, i : i + 1], cache) for i in range(TEXT_LEN, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_factored_features_name_each_patch_tokens_colour_and_footprint(
    small_runtime: ShapesDalleRuntime,
) -> None:
    features = small_runtime.features
    tokenizer = small_runtime.image_tokenizer
    colours, masks, grid = tokenizer.num_colours, tokenizer.num_masks, tokenizer.grid
    assert len(features.tokens) == small_runtime.text_vocab + small_runtime.image_vocab
    assert len(features.positions) == small_runtime.seq_len
    image_features = features.tokens[small_runtime.text_vocab :]
    pictures = tokenizer.decode(
        np.arange(small_runtime.image_vocab).reshape(-1, 1).repeat(grid * grid, axis=1)
    )
    patch = tokenizer.patch_size
    for token, (colour, mask) in enumerate(image_features):
        drawn = data.palette_indices(pictures[token][:patch, :patch])  # the token painted in the first cell
        assert set(np.unique(drawn)) <= {0, colour}, token  # its colour feature is the colour it paints
        footprint = tokenizer.codebook[mask - colours - 1].reshape(patch, patch)
        assert np.array_equal(drawn != 0, footprint), token  # and its mask feature the footprint it paints
    assert image_features[0] == (0, colours + 1)  # the empty patch: background, empty mask
    assert len({f for row in features.tokens for f in row}) == 1 + colours + masks + 1  # + one for words
    # the position that reads the caption's last word predicts the first cell, row 0 and column 0
    assert features.positions[TEXT_LEN - 1] == (1, 1 + grid)
    assert features.positions[TEXT_LEN - 1 + grid + 2] == (2, 1 + grid + 2)
    plain = TASK.build_runtime(dataclasses.replace(small_runtime.config, factored_tokens=False))
    assert plain.features.tokens == () and plain.build_model().feature_head is None


def test_factored_tokens_learn_faster_per_sample() -> None:
    """The point of the features: the same model, the same batches, a lower held-out loss."""
    torch.manual_seed(0)
    losses = {}
    for factored in (False, True):
        config = {**SMALL_MODEL, "samples_per_shard": 256, "factored_tokens": factored}
        runtime = TASK.build_runtime(TASK.make_config(config))
        model = runtime.build_model()
        optimizer = runtime.make_optimizer(runtime.param_groups(model))
        for shard in range(16):  # 4,096 samples: held-out loss ~1.4 without the features, ~1.0 with them
            for batch in runtime.shard_batches(shard, batch_size=32, seed=0):
                loss = runtime.loss(model, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        losses[factored] = runtime.evaluate(model, max_samples=64)["loss"]
    assert losses[True] < 0.85 * losses[False], losses


def test_loss_falls_when_training_on_one_shard(small_runtime: ShapesDalleRuntime) -> None:
    torch.manual_seed(0)
    model = small_runtime.build_model()
    before = small_runtime.evaluate(model, max_samples=32)
    assert before["loss"] == pytest.approx(np.log(small_runtime.image_vocab), abs=0.25)
    optimizer = small_runtime.make_optimizer(model.parameters())
    (group,) = optimizer.param_groups
    assert (
        group["lr"] == small_runtime.config.lr and group["weight_decay"] == small_runtime.config.weight_decay
    )
    # hivemind hands the factory its own param groups and requires the optimizer to keep them as they are
    groups = [{"params": list(model.blocks.parameters())}, {"params": list(model.head.parameters())}]
    assert len(small_runtime.make_optimizer(groups).param_groups) == 2
    losses = []
    for epoch in range(6):
        for batch in small_runtime.shard_batches(0, batch_size=16, seed=epoch):
            loss = small_runtime.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    after = small_runtime.evaluate(model, max_samples=32)
    assert losses[-1] < 0.4 * losses[0]
    assert after["loss"] < 0.4 * before["loss"]  # it generalises to held-out prompts, not just memorises
    assert set(after) >= {"loss", "prompt_accuracy", "object_accuracy"}
    assert 0.0 <= after["prompt_accuracy"] <= after["object_accuracy"] <= 1.0


def test_sample_returns_reproducible_images(small_runtime: ShapesDalleRuntime) -> None:
    model = small_runtime.build_model()
    prompts = ["a small red circle at the top left", "bottom: big blue square; center: tiny white diamond"]
    images = small_runtime.sample(model, prompts, generator=torch.Generator().manual_seed(3))
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    again = small_runtime.sample(model, prompts, generator=torch.Generator().manual_seed(3))
    assert np.array_equal(images, again)
    greedy = small_runtime.sample(model, prompts, temperature=0.0, top_k=5)
    assert greedy.shape == (2, 32, 32, 3)
    assert model.training  # sampling restores the mode it found
