"""Does an image show what its prompt asks for? The automatic judge behind ``prompt_accuracy``.

The checker finds the blobs of an image (8-connected regions of one palette colour; pixels are snapped
to the nearest palette colour first) and, for each object of the parsed prompt, looks for a blob of
the object's colour whose bounding-box centre lies in the object's cell. That blob must have the right
size (its bounding box's longer side, measured against the :class:`data.Layout` sizes) and the right
shape: the shape template (:func:`data.shape_mask`) that overlaps it best, by intersection over union,
at the blob's size. Templates rather than a fill-ratio rule make the judgement robust to the image
tokenizer's quantisation and to a model's slightly ragged edges, while still telling a circle from a
square at 7 pixels.

An image is right for its prompt when every object is right and there is no other blob (a stray speck
or a duplicate shape is an error a person would see). :func:`prompt_accuracy` is the fraction of
*prompts* whose image is entirely right (the task's headline metric); :func:`object_accuracy` is the
more forgiving fraction of *objects* drawn right.

Needs numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workers.tasks.shapes_dalle import data

MIN_SHAPE_IOU = 0.6
"""A blob whose best template overlaps it less than this is no recognisable shape."""


@dataclass(frozen=True)
class Blob:
    """A connected region of one colour.

    :param colour: the colour name.
    :param area: its pixel count.
    :param top: first row of its bounding box.
    :param left: first column of its bounding box.
    :param mask: its footprint inside the bounding box, ``(height, width)`` bool.
    """

    colour: str
    area: int
    top: int
    left: int
    mask: np.ndarray

    @property
    def height(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    @property
    def centre(self) -> tuple[float, float]:
        """``(y, x)`` of the bounding box's centre, in continuous pixel coordinates."""
        return self.top + self.height / 2, self.left + self.width / 2


@dataclass(frozen=True)
class ObjectCheck:
    """How one requested object fared.

    :param expected: the object the prompt asks for.
    :param found: whether a blob of its colour is centred in its cell.
    :param shape: the shape of that blob (``None`` if none was found or it matches no template well).
    :param size: ``"small"``, ``"large"`` or ``None`` (no blob, or a size that is neither).
    :param ok: found, with the right shape and size.
    :param problem: what is wrong, for people; empty when ``ok``.
    """

    expected: data.SceneObject
    found: bool
    shape: str | None
    size: str | None
    ok: bool
    problem: str


@dataclass(frozen=True)
class ImageCheck:
    """The verdict on one image.

    :param objects: one :class:`ObjectCheck` per object of the prompt, in the scene's order.
    :param extra_blobs: blobs that belong to no requested object.
    :param ok: every object right and no extra blob.
    :param score: the fraction of objects that are right.
    """

    objects: tuple[ObjectCheck, ...]
    extra_blobs: int
    ok: bool
    score: float


def find_blobs(image: np.ndarray) -> list[Blob]:
    """The 8-connected single-colour regions of a ``(H, W, 3)`` image, background excluded, in scan order."""
    index = data.palette_indices(image)
    height, width = index.shape
    seen = np.zeros_like(index, dtype=bool)
    blobs = []
    flat = index.tolist()
    for y0, x0 in zip(*np.nonzero(index), strict=True):
        if seen[y0, x0]:
            continue
        colour = flat[y0][x0]
        stack = [(int(y0), int(x0))]
        seen[y0, x0] = True
        pixels = []
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for ny in (y - 1, y, y + 1):
                if not 0 <= ny < height:
                    continue
                for nx in (x - 1, x, x + 1):
                    if 0 <= nx < width and not seen[ny, nx] and flat[ny][nx] == colour:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
        ys, xs = np.array(pixels).T  # (pixels, 2) -> (2, pixels): rows and columns
        top, left = int(ys.min()), int(xs.min())
        mask = np.zeros((int(ys.max()) - top + 1, int(xs.max()) - left + 1), dtype=bool)
        mask[ys - top, xs - left] = True
        blobs.append(
            Blob(colour=data.COLOUR_NAMES[colour - 1], area=len(pixels), top=top, left=left, mask=mask)
        )
    return blobs


def classify_shape(mask: np.ndarray) -> tuple[str | None, float]:
    """The shape whose template best overlaps ``mask`` (a blob's bounding-box footprint), and that IoU.

    Templates are drawn at the blob's longer side and slid over the shorter one. Returns
    ``(None, iou)`` when even the best template overlaps less than :data:`MIN_SHAPE_IOU`.
    """
    height, width = mask.shape
    side = max(height, width)
    area = int(mask.sum())
    best_shape, best_iou = None, 0.0
    for shape in data.SHAPES:
        template = data.shape_mask(shape, side)
        template_area = int(template.sum())
        for dy in range(side - height + 1):
            for dx in range(side - width + 1):
                overlap = int(np.count_nonzero(template[dy : dy + height, dx : dx + width] & mask))
                iou = overlap / (area + template_area - overlap)
                if iou > best_iou:
                    best_shape, best_iou = shape, iou
    if best_iou < MIN_SHAPE_IOU:
        return None, best_iou
    return best_shape, best_iou


def classify_size(blob: Blob, geometry: data.Layout) -> str | None:
    """``"small"`` or ``"large"`` from the blob's longer side, or ``None`` when it is neither.

    Small objects are ``geometry.small`` pixels wide and large ones ``geometry.large``; the boundary is
    halfway, and one pixel of slack is allowed outside the two sizes.
    """
    extent = max(blob.height, blob.width)
    if geometry.small - 1 <= extent <= (geometry.small + geometry.large) / 2:
        return "small"
    if (geometry.small + geometry.large) / 2 < extent <= geometry.large + 1:
        return "large"
    return None


def blob_cell(blob: Blob, geometry: data.Layout) -> int:
    """The grid cell (``3 * row + col``) whose centre is nearest to the blob's bounding-box centre."""
    y, x = blob.centre
    centres = np.array([geometry.cell_centre(i) for i in range(3)])
    return int(np.abs(centres - y).argmin()) * 3 + int(np.abs(centres - x).argmin())


def check_image(image: np.ndarray, prompt: str | data.Scene) -> ImageCheck:
    """Judge one image against one prompt.

    :param image: a ``(S, S, 3)`` RGB image (S is taken from it).
    :param prompt: a caption (parsed with :func:`data.parse_prompt`) or a :class:`data.Scene`.
    :raises ValueError: when the prompt cannot be parsed.
    """
    scene = data.parse_prompt(prompt) if isinstance(prompt, str) else prompt
    geometry = data.layout(int(image.shape[0]))
    blobs = find_blobs(image)
    cells = [blob_cell(blob, geometry) for blob in blobs]
    used: set[int] = set()
    results = []
    for obj in scene.objects:
        candidates = [i for i, blob in enumerate(blobs) if blob.colour == obj.colour and cells[i] == obj.cell]
        if not candidates:
            results.append(
                ObjectCheck(obj, False, None, None, False, f"no {obj.colour} shape at {obj.position}")
            )
            continue
        chosen = max(candidates, key=lambda i: blobs[i].area)
        used.add(chosen)
        shape, _ = classify_shape(blobs[chosen].mask)
        size = classify_size(blobs[chosen], geometry)
        problems = []
        if shape != obj.shape:
            problems.append(f"shape is {shape or 'unrecognisable'}, not {obj.shape}")
        if size != obj.size:
            problems.append(f"size is {size or 'wrong'}, not {obj.size}")
        results.append(ObjectCheck(obj, True, shape, size, not problems, "; ".join(problems)))
    extra = len(blobs) - len(used)
    score = sum(result.ok for result in results) / len(results)
    return ImageCheck(objects=tuple(results), extra_blobs=extra, ok=score == 1.0 and extra == 0, score=score)


def check_images(
    images: Sequence[np.ndarray] | np.ndarray, prompts: Sequence[str | data.Scene]
) -> list[ImageCheck]:
    """:func:`check_image` for each (image, prompt) pair."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    return [check_image(np.asarray(image), prompt) for image, prompt in zip(images, prompts, strict=True)]


def prompt_accuracy(images: Sequence[np.ndarray] | np.ndarray, prompts: Sequence[str | data.Scene]) -> float:
    """The fraction of prompts whose image is entirely right (every object, nothing extra)."""
    checks = check_images(images, prompts)
    return sum(check.ok for check in checks) / len(checks) if checks else 0.0


def object_accuracy(images: Sequence[np.ndarray] | np.ndarray, prompts: Sequence[str | data.Scene]) -> float:
    """The fraction of requested objects drawn right, over all prompts."""
    checks = check_images(images, prompts)
    outcomes = [result.ok for check in checks for result in check.objects]
    return sum(outcomes) / len(outcomes) if outcomes else 0.0
