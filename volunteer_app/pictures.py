"""Small RGB pictures: PNG files (Pillow), grids, and terminal renderings with half blocks.

A picture here is a :class:`Picture`: width, height and raw RGB bytes (row by row from the top), the
form in which the worker sends drawings (``worker_protocol.EvalImage``). Three things are done with it:

* :func:`png_bytes` encodes it as a PNG and :func:`read_png` decodes one, both with Pillow: the one
  place in the project where PNG files are written or read (the ``shapes-dalle`` task's
  ``image_to_png_bytes`` comes here too); :func:`grid` tiles several pictures into one;
* :func:`half_block_cells` maps each pair of pixel rows to one row of terminal cells drawing ``▀``
  with the upper pixel as foreground and the lower one as background colour, so a 32x32 drawing
  takes 32 columns by 16 lines; :func:`ansi_lines` turns those cells into escape sequences, in true
  colour or, for terminals without it, the nearest of xterm's 256 colours;
* :func:`gallery_lines` lays several pictures out side by side with their captions, for the demo's
  summary (the TUI draws the same cells with its own styles).

Pillow is imported by the two PNG functions, not with this module: the TUI imports it for its half
blocks only and should not pay for an image library at start-up.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

RGB = tuple[int, int, int]
UPPER_HALF_BLOCK = "\u2580"
RESET = "\x1b[0m"


@dataclass(frozen=True)
class Picture:
    """An RGB picture: ``rgb`` holds ``width * height * 3`` bytes, rows top to bottom."""

    width: int
    height: int
    rgb: bytes

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1:
            raise ValueError(f"a picture needs a positive size, got {self.width}x{self.height}")
        if len(self.rgb) != self.width * self.height * 3:
            raise ValueError(
                f"{self.width}x{self.height} RGB needs {self.width * self.height * 3} bytes, got {len(self.rgb)}"
            )

    def pixel(self, x: int, y: int) -> RGB:
        i = 3 * (y * self.width + x)
        return self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]

    def scaled(self, factor: int) -> Picture:
        """Nearest-neighbour magnification by an integer ``factor``."""
        if factor < 1:
            raise ValueError("scale factor must be >= 1")
        if factor == 1:
            return self
        rows = []
        for y in range(self.height):
            row = self.rgb[3 * y * self.width : 3 * (y + 1) * self.width]
            wide = b"".join(row[3 * x : 3 * x + 3] * factor for x in range(self.width))
            rows.append(wide * factor)
        return Picture(self.width * factor, self.height * factor, b"".join(rows))


def png_bytes(picture: Picture, *, scale: int = 1) -> bytes:
    """The picture as an 8-bit RGB PNG (Pillow's encoder), magnified ``scale`` times (nearest neighbour).

    :param scale: an integer magnification, so that a 32 px drawing is not a speck in a browser or an
      image viewer (the coordinator's sample grids use 4, its "try it" drawings 8).
    """
    from PIL import Image

    if scale < 1:
        raise ValueError("scale factor must be >= 1")
    image = Image.frombytes("RGB", (picture.width, picture.height), picture.rgb)
    if scale > 1:
        image = image.resize((picture.width * scale, picture.height * scale), Image.Resampling.NEAREST)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def read_png(data: bytes) -> Picture:
    """Decode an 8-bit RGB PNG such as :func:`png_bytes` writes (for tests and tools), checking every
    chunk's CRC first, so that a damaged file is an error rather than a picture with wrong pixels.

    :raises ValueError: for anything that is not an intact 8-bit RGB PNG.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            image.verify()  # the CRCs of all chunks, image data included; the file cannot be decoded after it
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            if image.mode != "RGB":
                raise ValueError(f"only 8-bit RGB PNGs are read, this one is {image.mode}")
            image.load()
            return Picture(image.width, image.height, image.tobytes())
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        EOFError,
    ) as exc:  # Pillow reports a bad chunk as SyntaxError
        raise ValueError(f"not an intact PNG file: {exc}") from exc


def grid(
    pictures: Sequence[Picture], *, columns: int = 4, pad: int = 2, background: RGB = (255, 255, 255)
) -> Picture:
    """Tile equally sized pictures, ``columns`` per row, ``pad`` pixels apart and around.

    :raises ValueError: for no pictures or pictures of different sizes.
    """
    if not pictures:
        raise ValueError("a grid needs at least one picture")
    w, h = pictures[0].width, pictures[0].height
    if any(p.width != w or p.height != h for p in pictures):
        raise ValueError("the pictures of a grid must all have the same size")
    columns = max(1, min(columns, len(pictures)))
    rows = -(-len(pictures) // columns)
    width = columns * (w + pad) + pad
    height = rows * (h + pad) + pad
    canvas = bytearray(bytes(background) * (width * height))
    for index, picture in enumerate(pictures):
        row, col = divmod(index, columns)
        top, left = pad + row * (h + pad), pad + col * (w + pad)
        for y in range(h):
            start = 3 * ((top + y) * width + left)
            canvas[start : start + 3 * w] = picture.rgb[3 * y * w : 3 * (y + 1) * w]
    return Picture(width, height, bytes(canvas))


# ------------------------------------------------------------------------------------------ terminal


def half_block_cells(picture: Picture, *, background: RGB = (0, 0, 0)) -> list[list[tuple[RGB, RGB]]]:
    """Rows of ``(upper colour, lower colour)`` cells: cell ``(r, x)`` shows pixels ``(x, 2r)`` and
    ``(x, 2r + 1)`` as an upper half block; an odd last row is completed with ``background``."""
    rows = []
    for y in range(0, picture.height, 2):
        row = []
        for x in range(picture.width):
            lower = picture.pixel(x, y + 1) if y + 1 < picture.height else background
            row.append((picture.pixel(x, y), lower))
        rows.append(row)
    return rows


_CUBE = (0, 95, 135, 175, 215, 255)


def xterm_256(colour: RGB) -> int:
    """The nearest xterm-256 colour index (the 6x6x6 cube or the grey ramp) to ``colour``."""

    def nearest_level(value: int) -> int:
        return min(range(6), key=lambda i: abs(_CUBE[i] - value))

    r, g, b = (nearest_level(c) for c in colour)
    cube = 16 + 36 * r + 6 * g + b
    cube_rgb = (_CUBE[r], _CUBE[g], _CUBE[b])
    grey_level = min(23, max(0, round((sum(colour) / 3 - 8) / 10)))
    grey_rgb = (8 + 10 * grey_level,) * 3

    def distance(other: tuple[int, ...]) -> int:
        return sum((a - b) ** 2 for a, b in zip(colour, other, strict=True))

    return cube if distance(cube_rgb) <= distance(grey_rgb) else 232 + grey_level


def _sgr(upper: RGB, lower: RGB, truecolor: bool) -> str:
    if truecolor:
        return f"\x1b[38;2;{upper[0]};{upper[1]};{upper[2]};48;2;{lower[0]};{lower[1]};{lower[2]}m"
    return f"\x1b[38;5;{xterm_256(upper)};48;5;{xterm_256(lower)}m"


def ansi_lines(picture: Picture, *, truecolor: bool = True) -> list[str]:
    """The picture as terminal lines of upper half blocks with colour escapes (each ends with a reset).

    :param truecolor: 24-bit colours; False uses xterm's 256 colours (for terminals without true colour).
    """
    lines = []
    for row in half_block_cells(picture):
        parts, last = [], None
        for upper, lower in row:
            if (upper, lower) != last:
                parts.append(_sgr(upper, lower, truecolor))
                last = (upper, lower)
            parts.append(UPPER_HALF_BLOCK)
        lines.append("".join(parts) + RESET)
    return lines


def gallery_lines(
    pictures: Sequence[Picture],
    captions: Sequence[str],
    *,
    width: int = 80,
    truecolor: bool = True,
    gap: int = 2,
    caption_lines: int = 3,
) -> list[str]:
    """Pictures side by side with their captions wrapped under each, as many per row as ``width`` allows.

    :param pictures: equally wide pictures.
    :param captions: one caption per picture (a mark such as ``✓``/``✗`` can be part of it).
    :param width: the terminal width in columns.
    :param caption_lines: caption lines kept under each picture (longer captions end with ``…``).
    """
    if len(pictures) != len(captions):
        raise ValueError("one caption per picture")
    if not pictures:
        return []
    tile = max(p.width for p in pictures)
    per_row = max(1, (width + gap) // (tile + gap))
    lines: list[str] = []
    for start in range(0, len(pictures), per_row):
        chunk = list(range(start, min(start + per_row, len(pictures))))
        rendered = [ansi_lines(pictures[i], truecolor=truecolor) for i in chunk]
        wrapped = []
        for i in chunk:
            text = textwrap.wrap(captions[i], tile) or [""]
            if len(text) > caption_lines:
                text = text[:caption_lines]
                text[-1] = text[-1][: tile - 1] + "…"
            wrapped.append(text)
        height = max(len(r) for r in rendered)
        spacer = " " * gap
        for y in range(height):
            cells = []
            for i, r in zip(chunk, rendered, strict=True):
                cells.append(r[y] if y < len(r) else " " * pictures[i].width)
            lines.append(spacer.join(cells))
        for y in range(caption_lines):
            cells = [(w[y] if y < len(w) else "").ljust(tile) for w in wrapped]
            lines.append(spacer.join(cells).rstrip())
        lines.append("")
    return lines
