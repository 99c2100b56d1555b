"""The synthetic data set of ``shapes-dalle``: scenes of coloured shapes, their images and their captions.

Everything here is generated, deterministically, from numbers: sample ``index`` of shard ``shard`` is
drawn from a numpy generator seeded with ``(TRAIN_STREAM, seed, shard, index)``, so every volunteer
builds bit-identical shards without downloading anything, and the held-out set (seeded with
``(HELDOUT_STREAM, seed, index)``) can never coincide with a training draw.

A scene holds one or two objects. Each object has a shape (circle, square, triangle, diamond), a
colour (eight well-separated named colours), a size (small or large) and a position: one of the nine
cells of a 3x3 grid (top left, top, top right, left, center, right, bottom left, bottom, bottom right).
Two objects never share a cell, and cells are separated by background pixels, so objects never touch.
Small objects are jittered inside their cell (the jitter is not in the caption: the model has to learn
a distribution, not a lookup table).

Captions use varied phrasing, synonyms and word orders, so a model has to read them:
"a small red circle at the top left and a big square in blue at the bottom",
"top left: little red circle; bottom: large blue square",
"in the middle of the picture there is an orange diamond" and so on. :func:`parse_prompt` reads every
caption the generator can write (and the same language typed by a person) back into a :class:`Scene`.

This module needs numpy only (no torch; PNG files through ``volunteer_app.pictures``, on Pillow), so the
dashboard and the tests can use it anywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from volunteer_app.pictures import Picture, png_bytes

IMAGE_SIZE = 32
"""The default image side in pixels; :class:`Layout` scales the geometry to any side from 24 to 128."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "orange": (245, 145, 20),
    "yellow": (240, 225, 50),
    "green": (40, 190, 60),
    "cyan": (40, 210, 220),
    "blue": (50, 90, 235),
    "purple": (165, 60, 215),
    "white": (245, 245, 245),
}
"""Named colours, far apart in RGB (the closest pair, orange and yellow, is ~85 apart)."""
BACKGROUND: tuple[int, int, int] = (18, 18, 24)
SIZES: tuple[str, ...] = ("small", "large")
POSITIONS: tuple[str, ...] = (
    "top left",
    "top",
    "top right",
    "left",
    "center",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)
"""Cell names in row-major order: ``POSITIONS[3 * row + col]``."""
MAX_OBJECTS = 2

TRAIN_STREAM = 1
HELDOUT_STREAM = 2
"""First entropy words of the numpy seed sequences: training and held-out draws never share a stream."""

SIZE_WORDS: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc"),
    "square": ("square",),
    "triangle": ("triangle",),
    "diamond": ("diamond",),
}
_VERTICAL_WORDS = {"top": 0, "upper": 0, "bottom": 2, "lower": 2}
_HORIZONTAL_WORDS = {"left": 0, "right": 2}
_CENTRE_WORDS = ("center", "middle")
_CLAUSE_BREAKS = frozenset({"and", ";", ","})
PUNCTUATION = (",", ";", ":")

_FILLER_WORDS = (
    "a",
    "an",
    "at",
    "in",
    "on",
    "the",
    "of",
    "image",
    "picture",
    "corner",
    "side",
    "there",
    "is",
    "with",
    "and",
)
VOCABULARY: frozenset[str] = frozenset(
    [*_FILLER_WORDS, *PUNCTUATION, *COLOURS, *_VERTICAL_WORDS, *_HORIZONTAL_WORDS, *_CENTRE_WORDS]
    + [w for words in SIZE_WORDS.values() for w in words]
    + [w for words in SHAPE_WORDS.values() for w in words]
)
"""Every word and punctuation mark a caption can contain (the text tokenizer's vocabulary)."""


@dataclass(frozen=True)
class SceneObject:
    """One shape in a scene.

    :param shape: one of :data:`SHAPES`.
    :param colour: one of the keys of :data:`COLOURS`.
    :param size: ``"small"`` or ``"large"``.
    :param position: one of :data:`POSITIONS` (the cell of the 3x3 grid it sits in).
    :param jitter_x: horizontal offset of a small object inside its cell, in [-1, 1] (-1: flush left).
      Not part of the caption and ignored by ``==``; large objects fill their cell and ignore it.
    :param jitter_y: the same, vertically.
    """

    shape: str
    colour: str
    size: str
    position: str
    jitter_x: float = field(default=0.0, compare=False)
    jitter_y: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r} (known: {', '.join(SHAPES)})")
        if self.colour not in COLOURS:
            raise ValueError(f"unknown colour {self.colour!r} (known: {', '.join(COLOURS)})")
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r} (known: {', '.join(SIZES)})")
        if self.position not in POSITIONS:
            raise ValueError(f"unknown position {self.position!r} (known: {', '.join(POSITIONS)})")
        if not (-1.0 <= self.jitter_x <= 1.0 and -1.0 <= self.jitter_y <= 1.0):
            raise ValueError("jitter must lie in [-1, 1]")

    @property
    def cell(self) -> int:
        """The cell index, ``3 * row + col``."""
        return POSITIONS.index(self.position)

    @property
    def row(self) -> int:
        return self.cell // 3

    @property
    def col(self) -> int:
        return self.cell % 3

    def describe(self) -> str:
        """A canonical one-line description, e.g. ``"small red circle at top left"``."""
        return f"{self.size} {self.colour} {self.shape} at {self.position}"


@dataclass(frozen=True)
class Scene:
    """One to :data:`MAX_OBJECTS` objects in distinct cells, kept sorted by cell (so ``==`` ignores order).

    :param objects: the objects; any order is accepted and normalised.
    """

    objects: tuple[SceneObject, ...]

    def __post_init__(self) -> None:
        objects = tuple(sorted(self.objects, key=lambda obj: obj.cell))
        if not 1 <= len(objects) <= MAX_OBJECTS:
            raise ValueError(f"a scene holds 1 to {MAX_OBJECTS} objects, got {len(objects)}")
        cells = [obj.cell for obj in objects]
        if len(set(cells)) != len(cells):
            raise ValueError("two objects cannot share a position")
        object.__setattr__(self, "objects", objects)

    def describe(self) -> str:
        return "; ".join(obj.describe() for obj in self.objects)


@dataclass(frozen=True)
class Layout:
    """Pixel geometry of a square image of side ``image_size``.

    The image is cut into a 3x3 grid of cells ``cell`` pixels wide separated by ``gap`` >= 1 background
    pixels, so objects in different cells never touch. A large object fills its cell; a small one is
    ``small`` pixels wide and moves by up to ``cell - small`` pixels inside it.
    """

    image_size: int
    cell: int
    gap: int
    small: int

    @property
    def large(self) -> int:
        return self.cell

    def cell_start(self, index: int) -> int:
        """The first pixel row/column of grid row/column ``index``."""
        return index * (self.cell + self.gap)

    def cell_centre(self, index: int) -> float:
        """The centre, in continuous pixel coordinates, of grid row/column ``index``."""
        return self.cell_start(index) + self.cell / 2

    def size_px(self, size: str) -> int:
        return self.large if size == "large" else self.small

    def box(self, obj: SceneObject) -> tuple[int, int, int]:
        """``(top, left, side)`` of the square box that ``obj`` is drawn in."""
        side = self.size_px(obj.size)
        slack = self.cell - side
        top = self.cell_start(obj.row) + round(slack * (obj.jitter_y + 1) / 2)
        left = self.cell_start(obj.col) + round(slack * (obj.jitter_x + 1) / 2)
        return top, left, side


@functools.lru_cache(maxsize=16)
def layout(image_size: int = IMAGE_SIZE) -> Layout:
    """The :class:`Layout` for ``image_size`` (24 to 128 pixels)."""
    if not 24 <= image_size <= 128:
        raise ValueError(f"image_size must be between 24 and 128, got {image_size}")
    cell = (image_size - 2) // 3
    gap = (image_size - 3 * cell) // 2
    return Layout(image_size=image_size, cell=cell, gap=gap, small=round(0.7 * cell))


@functools.lru_cache(maxsize=64)
def shape_mask(shape: str, side: int) -> np.ndarray:
    """The boolean ``side x side`` footprint of ``shape`` (read-only; cached).

    Pixels are tested at their centres: a circle of diameter ``side``; a full square; an upward
    triangle whose base is the bottom row; a diamond touching the middle of each edge.
    """
    coords = np.arange(side) + 0.5
    v, u = np.meshgrid(coords, coords, indexing="ij")
    c = side / 2
    if shape == "circle":
        mask = (u - c) ** 2 + (v - c) ** 2 < c * c
    elif shape == "square":
        mask = np.ones((side, side), dtype=bool)
    elif shape == "triangle":
        mask = np.abs(u - c) <= (v + 0.5) / 2
    elif shape == "diamond":
        mask = np.abs(u - c) + np.abs(v - c) <= c + 1e-9
    else:
        raise ValueError(f"unknown shape {shape!r}")
    mask.setflags(write=False)
    return mask


def palette() -> np.ndarray:
    """The ``(1 + len(COLOURS), 3)`` uint8 palette: background first, then :data:`COLOURS` in order."""
    return np.array([BACKGROUND, *COLOURS.values()], dtype=np.uint8)


COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
"""Colour names in palette order (palette index ``i + 1``)."""


def palette_indices(images: np.ndarray) -> np.ndarray:
    """Each pixel's nearest :func:`palette` index (0 background, ``i + 1`` for ``COLOUR_NAMES[i]``).

    :param images: ``(..., H, W, 3)`` RGB values.
    :returns: ``(..., H, W)`` uint8 indices.
    """
    pixels = np.asarray(images, dtype=np.int32)[..., None, :]
    distances = ((pixels - palette().astype(np.int32)) ** 2).sum(axis=-1)
    return distances.argmin(axis=-1).astype(np.uint8)


def render(scene: Scene, image_size: int = IMAGE_SIZE) -> np.ndarray:
    """Draw ``scene`` on the plain background.

    :param scene: what to draw.
    :param image_size: the image side in pixels.
    :returns: a ``(image_size, image_size, 3)`` uint8 RGB array.
    """
    geometry = layout(image_size)
    image = np.empty((image_size, image_size, 3), dtype=np.uint8)
    image[...] = BACKGROUND
    for obj in scene.objects:
        top, left, side = geometry.box(obj)
        window = image[top : top + side, left : left + side]
        window[shape_mask(obj.shape, side)] = COLOURS[obj.colour]
    return image


# ---------------------------------------------------------------------------------------------- captions


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _with_article(rng: np.random.Generator, words: str) -> str:
    return ("an " if words[0] in "aeiou" else "a ") + words


def _object_phrase(obj: SceneObject, rng: np.random.Generator, *, article: bool) -> str:
    size = _pick(rng, SIZE_WORDS[obj.size])
    shape = _pick(rng, SHAPE_WORDS[obj.shape])
    words = f"{size} {obj.colour} {shape}" if rng.random() < 0.7 else f"{size} {shape} in {obj.colour}"
    return _with_article(rng, words) if article else words


def _position_name(obj: SceneObject, rng: np.random.Generator) -> str:
    """A bare name of the object's cell: "top left", "upper right", "bottom", "center", ..."""
    row, col = obj.row, obj.col
    if row == 1 and col == 1:
        return _pick(rng, _CENTRE_WORDS)
    vertical = "" if row == 1 else _pick(rng, ("top", "upper") if row == 0 else ("bottom", "lower"))
    horizontal = "" if col == 1 else ("left" if col == 0 else "right")
    if vertical and horizontal:
        return f"{vertical} {horizontal}"
    return vertical.replace("upper", "top").replace("lower", "bottom") or horizontal


def _position_phrase(obj: SceneObject, rng: np.random.Generator) -> str:
    """A prepositional phrase placing the object: "at the top left", "in the lower right corner", ..."""
    row, col = obj.row, obj.col
    of_image = _pick(rng, ("", "", " of the image", " of the picture"))
    name = _position_name(obj, rng)
    if row != 1 and col != 1:
        return _pick(rng, (f"at the {name}", f"in the {name}", f"in the {name} corner"))
    if row == 1 and col == 1:
        return _pick(rng, (f"in the {name}", f"at the {name}")) + of_image
    if col == 1:
        return _pick(rng, (f"at the {name}{of_image}", f"in the {name} middle"))
    return _pick(rng, (f"on the {name}", f"on the {name} side", f"at the {name}{of_image}"))


def _clause(obj: SceneObject, rng: np.random.Generator, style: int) -> str:
    if style == 0:
        return f"{_object_phrase(obj, rng, article=True)} {_position_phrase(obj, rng)}"
    if style == 1:
        return f"{_position_phrase(obj, rng)} there is {_object_phrase(obj, rng, article=True)}"
    return f"{_position_name(obj, rng)}: {_object_phrase(obj, rng, article=False)}"


def caption(scene: Scene, rng: np.random.Generator) -> str:
    """A randomly phrased English caption of ``scene`` that :func:`parse_prompt` reads back exactly.

    Objects are mentioned in random order; each is phrased as "<object> <position>",
    "<position> there is <object>" or "<position>: <object>", with synonyms for sizes, shapes and
    positions, joined by "and", ";" or ",", sometimes after "there is", "a picture of" or
    "an image with".

    :param scene: the scene to describe.
    :param rng: the source of phrasing choices (the same generator state gives the same caption).
    """
    objects = list(scene.objects)
    if len(objects) > 1 and rng.random() < 0.5:
        objects.reverse()
    if rng.random() < 0.25:
        return "; ".join(_clause(obj, rng, 2) for obj in objects)
    styles = [int(rng.random() < 0.35) for _ in objects]
    clauses = [_clause(obj, rng, style) for obj, style in zip(objects, styles, strict=True)]
    text = clauses[0]
    for clause in clauses[1:]:
        text += _pick(rng, (" and ", " and ", ", ", "; ")) + clause
    if styles[0] == 0:
        text = _pick(rng, ("", "", "there is ", "a picture of ", "an image with ")) + text
    return text


def words_of(text: str) -> list[str]:
    """Lower-cased words of ``text`` with ``,`` ``;`` ``:`` split off as words of their own."""
    text = text.lower()
    for mark in PUNCTUATION:
        text = text.replace(mark, f" {mark} ")
    return text.split()


def _parse_clause(words: list[str]) -> SceneObject | None:
    sizes = [size for w in words for size, names in SIZE_WORDS.items() if w in names]
    colours = [w for w in words if w in COLOURS]
    shapes = [shape for w in words for shape, names in SHAPE_WORDS.items() if w in names]
    rows = [_VERTICAL_WORDS[w] for w in words if w in _VERTICAL_WORDS]
    cols = [_HORIZONTAL_WORDS[w] for w in words if w in _HORIZONTAL_WORDS]
    centred = any(w in _CENTRE_WORDS for w in words)
    if not (sizes or colours or shapes or rows or cols or centred):
        return None
    clause = " ".join(words)
    for what, found in (("size", sizes), ("colour", colours), ("shape", shapes)):
        if len(found) != 1:
            raise ValueError(f"{clause!r} must name exactly one {what}, found {len(found)}")
    if len(set(rows)) > 1 or len(set(cols)) > 1:
        raise ValueError(f"{clause!r} names conflicting positions")
    if not (rows or cols or centred):
        raise ValueError(f"{clause!r} does not say where the {shapes[0]} is")
    row = rows[0] if rows else 1
    col = cols[0] if cols else 1
    return SceneObject(shape=shapes[0], colour=colours[0], size=sizes[0], position=POSITIONS[3 * row + col])


def parse_prompt(text: str) -> Scene:
    """Read a caption (generated or typed in the same language) back into a :class:`Scene`.

    The text is split into clauses at "and", "," and ";"; each clause that mentions anything must
    name exactly one size, colour and shape and at least one position word (top/upper, bottom/lower,
    left, right, center/middle; a missing direction means the middle). Other words are ignored.

    :raises ValueError: when the text does not describe 1 to :data:`MAX_OBJECTS` objects in distinct cells.
    """
    clause: list[str] = []
    objects: list[SceneObject] = []
    for word in [*words_of(text), ";"]:
        if word in _CLAUSE_BREAKS:
            obj = _parse_clause(clause)
            if obj is not None:
                objects.append(obj)
            clause = []
        else:
            clause.append(word)
    return Scene(tuple(objects))


# ---------------------------------------------------------------------------------------------- sampling


def random_scene(rng: np.random.Generator, *, max_objects: int = MAX_OBJECTS) -> Scene:
    """A random scene: 1 object (30%) or 2 (70%) when ``max_objects`` is 2, uniform attributes and cells.

    :param rng: the source of randomness.
    :param max_objects: 1 or 2.
    """
    if not 1 <= max_objects <= MAX_OBJECTS:
        raise ValueError(f"max_objects must be between 1 and {MAX_OBJECTS}")
    count = 1 if max_objects == 1 or rng.random() < 0.3 else 2
    cells = rng.choice(len(POSITIONS), size=count, replace=False)
    objects = []
    for cell in cells:
        size = SIZES[int(rng.integers(len(SIZES)))]
        jitter = (0.0, 0.0) if size == "large" else tuple(float(j) / 2 for j in rng.integers(-2, 3, size=2))
        objects.append(
            SceneObject(
                shape=SHAPES[int(rng.integers(len(SHAPES)))],
                colour=COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))],
                size=size,
                position=POSITIONS[int(cell)],
                jitter_x=jitter[0],
                jitter_y=jitter[1],
            )
        )
    return Scene(tuple(objects))


def example_for(shard: int, index: int, seed: int, *, max_objects: int = MAX_OBJECTS) -> tuple[Scene, str]:
    """Training sample ``index`` of data shard ``shard``: its scene and its caption.

    :param shard: the shard number (>= 0).
    :param index: the sample's index inside the shard (>= 0).
    :param seed: the run's data seed (>= 0).
    :param max_objects: the most objects per scene (1 or 2).
    """
    rng = np.random.default_rng((TRAIN_STREAM, seed, shard, index))
    scene = random_scene(rng, max_objects=max_objects)
    return scene, caption(scene, rng)


def scene_for(shard: int, index: int, seed: int, *, max_objects: int = MAX_OBJECTS) -> Scene:
    """The scene of training sample ``index`` of shard ``shard`` (see :func:`example_for`)."""
    return example_for(shard, index, seed, max_objects=max_objects)[0]


def heldout_examples(n: int, seed: int, *, max_objects: int = MAX_OBJECTS) -> list[tuple[Scene, str]]:
    """The first ``n`` held-out (scene, caption) pairs, from a seed stream no training shard uses.

    The list for a larger ``n`` starts with the list for a smaller one, so metrics on fewer samples are
    computed on a prefix of the same set.
    """
    examples = []
    for index in range(n):
        rng = np.random.default_rng((HELDOUT_STREAM, seed, index))
        scene = random_scene(rng, max_objects=max_objects)
        examples.append((scene, caption(scene, rng)))
    return examples


def heldout_prompts(n: int, seed: int, *, max_objects: int = MAX_OBJECTS) -> list[str]:
    """The captions of :func:`heldout_examples` (a fixed prompt set for evaluation and the dashboard)."""
    return [text for _, text in heldout_examples(n, seed, max_objects=max_objects)]


# ---------------------------------------------------------------------------------------------- pictures


def image_grid(images: Sequence[np.ndarray] | np.ndarray, columns: int = 8, pad: int = 1) -> np.ndarray:
    """Tile equally sized ``(H, W, 3)`` images into one image, ``columns`` per row, ``pad`` pixels apart."""
    images = np.asarray(images)
    if images.ndim != 4 or len(images) == 0:
        raise ValueError("image_grid needs a non-empty (N, H, W, 3) array")
    n, h, w, c = images.shape
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    grid = np.full((rows * (h + pad) - pad, columns * (w + pad) - pad, c), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, columns)
        grid[r * (h + pad) : r * (h + pad) + h, col * (w + pad) : col * (w + pad) + w] = image
    return grid


def image_to_png_bytes(image: np.ndarray, scale: int = 1) -> bytes:
    """Encode an RGB image as PNG bytes (for the dashboard's sample views and tools).

    The PNG itself is written by :func:`volunteer_app.pictures.png_bytes` (Pillow), the project's one PNG
    writer; this only checks and hands over the array.

    :param image: a ``(H, W, 3)`` uint8 array.
    :param scale: an integer nearest-neighbour magnification (a 32 px image at ``scale=8`` is 256 px).
    """
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {image.dtype} {image.shape}")
    if scale < 1:
        raise ValueError("scale must be >= 1")
    height, width = image.shape[:2]
    return png_bytes(Picture(width, height, image.tobytes()), scale=scale)  # tobytes: rows top to bottom


def all_single_objects() -> Iterable[SceneObject]:
    """Every distinct footprint one object can have: shape x size x cell x jitter step, in the first colour.

    Used to build the image tokenizer's mask codebook (a footprint does not depend on its colour).
    """
    jitters = [j / 2 for j in range(-2, 3)]
    for shape in SHAPES:
        for size in SIZES:
            for position in POSITIONS:
                offsets = [(jx, jy) for jy in jitters for jx in jitters] if size == "small" else [(0.0, 0.0)]
                for jx, jy in offsets:
                    yield SceneObject(shape, COLOUR_NAMES[0], size, position, jx, jy)
